"""One model validates every host's merged data before any host is touched.

pyinfra merges data as ``--data`` > host data > ``group_data/<group>.py`` >
``group_data/all.py``. :func:`fleet_settings` validates that merged dict for *every* host
of the inventory the first time a deploy file asks, and raises one
:class:`ConfigError` naming host, key, value and fix for everything that is wrong —
while nothing has run on any host yet. ``group_data/all.py`` holds every default; the
model has none of its own, so there is exactly one place to read them.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from runtime import serve_args  # the one builder of the `vllm serve` argv (also in the container)
from sparkfleet.profiles import INTEL_INT4, PROFILES, Profile

try:  # pyinfra is the runtime, but the model is also used by plain unit tests
    from pyinfra.api.exceptions import PyinfraError as _BaseError
except ImportError:  # pragma: no cover
    _BaseError = Exception

log = logging.getLogger("sparkfleet")

# The reference recipe measured 0.82 as the most a 128 GiB Spark takes without swapping the OS.
MEASURED_GPU_MEMORY_UTILIZATION = 0.82
MAX_CONTEXT = 262144
CONTAINER_MODEL_DIR = "/model"

# Data keys that belong to pyinfra's connectors, not to sparkfleet.
_CONNECTOR_PREFIXES = ("ssh_", "_", "docker_", "chroot_", "local_", "winrm_", "vagrant_", "terraform_", "fake_")

_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/+-]*$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# registry[:port]/path[:tag][@sha256:digest] — lower-case path, as registries require.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._/-][a-z0-9]+)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_WORD = re.compile(r"^[A-Za-z0-9_.-]*$")
_URL = re.compile(r"^https?://[A-Za-z0-9.:\[\]_-]+(?:/[A-Za-z0-9._~/$()%+-]*)?$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")
# A pip requirement without spaces, markers or shell characters, e.g. olah==0.5.4.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9,._-]+\])?(?:(?:==|>=|<=|~=|!=|>|<)[A-Za-z0-9.*+!_-]+)?$")
#: fleet_mirror values that turn the mirror off.
MIRROR_OFF = (None, "", "none", "off", "false")

_FIXES: dict[str, str] = {
    "profile": "pick one of the profiles, e.g. --data profile=dense",
    "gpu_memory_utilization": "use a fraction between 0.10 and 0.95; the reference recipe measured 0.82 as safe on a 128 GiB Spark",
    "max_model_len": f"use a context length from 1 to {MAX_CONTEXT}",
    "port": "use a TCP port from 1 to 65535",
    "num_speculative_tokens": "use 0 (off) to 16, or leave it unset for the profile's default",
    "image": "use a reference like registry/name:tag or registry/name@sha256:<64 hex>",
    "model": "use a Hugging Face repo id like org/name",
    "api_key": "use 'auto' (generated per fleet), 'none' (trusted network only) or a key of 16+ characters",
    "fleet_mirror": "use 'auto' (the first host of group `mirror`, else of the inventory), a host of the inventory, or none",
    "mirror_olah": "use a pip requirement like olah==0.5.4",
    "fleet_endpoint": "use 'auto' (the first host of group `endpoint`, else none), a host of the inventory, or none",
    "pair_subnet": "use an IPv4 network for the pairs' links, e.g. 192.168.100.0/24",
    "pair_interface": "use 'auto' (the ConnectX-7 port ibdev2netdev shows Up) or a netdev such as enp1s0f1np1",
    "pair_hcas": "use 'auto' (the RoCE devices of the cabled port) or a comma list such as rocep1s0f1,roceP2p1s0f1",
}


class ConfigError(_BaseError, ValueError):
    """Invalid configuration; raised before any operation runs on any host."""


class Settings(BaseModel):
    """The declared state of one Spark. Defaults live in group_data/all.py."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # What to serve
    profile: str
    model: str | None
    model_revisions: dict[str, str]
    model_dir: str | None
    build_hybrid: bool
    verify_weights: bool
    hybrid_dir: str
    # Where it comes from
    image: str
    hf_home: str
    hf_endpoint: str | None
    hf_token: SecretStr | None
    # The mirror: one host serves the others the image and the weights (sparkfleet/mirror/)
    fleet_mirror: str | None
    mirror_address: str | None
    mirror_hf_port: int = Field(ge=1, le=65535)
    mirror_registry_port: int = Field(ge=1, le=65535)
    mirror_dir: str
    mirror_olah: str
    mirror_tls_dir: str
    image_registry_url: str | None
    # The fleet endpoint: HAProxy over every serving host (sparkfleet/endpoint.py)
    fleet_endpoint: str | None
    endpoint_port: int = Field(ge=1, le=65535)
    endpoint_metrics_port: int = Field(ge=1, le=65535)
    endpoint_timeout_s: int = Field(ge=60, le=86400)
    # Pairs: an inventory group pair_* serves one model over the ConnectX-7 link (sparkfleet/link.py)
    pair_subnet: str
    pair_mtu: int = Field(ge=1280, le=9216)
    pair_interface: str
    pair_hcas: str
    pair_master_port: int = Field(ge=1, le=65535)
    # Serving settings (the reference recipe's validated stack)
    served_model_name: str
    bind_address: str
    port: int = Field(ge=1, le=65535)
    max_model_len: int = Field(ge=1, le=MAX_CONTEXT)
    max_num_seqs: int = Field(ge=1, le=256)
    max_num_batched_tokens: int = Field(ge=256, le=1048576)
    gpu_memory_utilization: float = Field(ge=0.10, le=0.95)
    engine_startup_memory_gib: float = Field(ge=0)
    oom_guard_min_available_gib: float = Field(gt=0)
    load_format: str
    attention_backend: str
    drafter_attention_backend: str
    tool_call_parser: str
    reasoning_parser: str
    chunked_prefill: bool
    prefix_caching: bool
    num_speculative_tokens: int | None = Field(ge=0, le=16)
    extra_serve_args: list[str]
    vllm_env: dict[str, str]
    patches: list[str] | None
    # Access
    api_key: SecretStr
    api_key_file: str
    # Lifecycle
    serving: bool
    force: bool
    ready_timeout_s: int = Field(ge=10, le=7200)
    # Rolling changes (sparkfleet/rollout.py)
    rollout: Literal["rolling", "all"]
    rollout_batch: int = Field(ge=1, le=1024)
    drain_timeout_s: int = Field(ge=0, le=86400)
    rollout_min_acceptance: float = Field(ge=1.0, le=17.0)
    # Host preparation
    nvidia_apt_repo: str
    nvidia_apt_key_url: str
    apt_repo: str | None
    apt_key_url: str | None
    image_size_gib: float = Field(gt=0)
    image_unpack_ratio: float = Field(ge=1)
    artifact_sizes_gib: dict[str, float]
    disk_margin_gib: float = Field(ge=0)
    # Post-deploy checks (see checks/)
    checks: list[str]
    bench: list[str]
    bench_runs: int = Field(ge=1, le=100)
    bench_warmup: int = Field(ge=0, le=20)
    bench_max_tokens: int = Field(ge=2, le=32768)
    agent_state_db: str | None
    agent_sessions: int = Field(ge=1, le=1000)
    agent_max_context_tokens: int = Field(ge=256, le=MAX_CONTEXT)
    agent_max_tokens: int = Field(ge=1, le=32768)
    bench_prompt: str | None
    bench_timeout_s: int = Field(ge=10, le=7200)
    bench_runner: Literal["docker", "host"]
    bench_dir: str
    run_id: str | None = Field(coerce_numbers_to_str=True)
    results_dir: str

    # --- field checks -------------------------------------------------------------

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(f"unknown profile; valid profiles: {', '.join(sorted(PROFILES))}")
        return value

    @field_validator("model")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and not _REPO_ID.match(value):
            raise ValueError("not a Hugging Face repo id (org/name)")
        return value

    @field_validator("model_revisions")
    @classmethod
    def _revisions(cls, value: dict[str, str]) -> dict[str, str]:
        for repo, rev in value.items():
            if not _REPO_ID.match(repo):
                raise ValueError(f"{repo!r} is not a repo id (org/name)")
            if not _REVISION.match(rev):
                raise ValueError(f"revision {rev!r} of {repo} is not a branch, tag or commit")
        return value

    @field_validator("fleet_mirror", "fleet_endpoint", mode="before")
    @classmethod
    def _mirror_name(cls, value: Any) -> Any:
        if value is False or (isinstance(value, str) and value.strip().lower() in MIRROR_OFF):
            return None
        if value is not None and (not isinstance(value, str) or "\n" in value or not value.strip()):
            raise ValueError("must be 'auto', a host name of the inventory, or none")
        return value

    @field_validator("mirror_address")
    @classmethod
    def _hostname(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(ipaddress.ip_address(value.strip("[]")))
        except ValueError:
            pass
        if not _HOSTNAME.match(value):
            raise ValueError("must be a host name, an IPv4 or an IPv6 address")
        return value

    @field_validator("pair_subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        try:
            net = ipaddress.IPv4Network(value, strict=False)
        except ValueError:
            raise ValueError("not an IPv4 network like 192.168.100.0/24") from None
        if net.num_addresses < 4:
            raise ValueError("too small for a pair: use a /30 or larger")
        return str(net)

    @field_validator("pair_interface", "pair_hcas")
    @classmethod
    def _netdev_names(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9_.:-]+(?:,[A-Za-z0-9_.:-]+)*$", value):
            raise ValueError("must be 'auto' or device names (comma-separated)")
        return value

    @field_validator("mirror_olah")
    @classmethod
    def _requirement(cls, value: str) -> str:
        if not _REQUIREMENT.match(value):
            raise ValueError("not a pip requirement (name, optionally ==version)")
        return value

    @field_validator("mirror_tls_dir")
    @classmethod
    def _controller_path(cls, value: str) -> str:
        if not value or "\n" in value or "\x00" in value:
            raise ValueError("must be a directory on the controller")
        return value

    @field_validator("model_dir", "hybrid_dir", "hf_home", "bench_dir", "mirror_dir")
    @classmethod
    def _host_path(cls, value: str | None) -> str | None:
        if value is not None and (not _SAFE_PATH.match(value) or "/../" in value + "/"):
            raise ValueError("must be an absolute path of letters, digits and ._/+-")
        return value

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str) -> str:
        if not _IMAGE_REF.match(value):
            raise ValueError("not an image reference")
        return value

    @field_validator("hf_endpoint", "nvidia_apt_repo", "nvidia_apt_key_url", "apt_repo",
                     "apt_key_url", "image_registry_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not _URL.match(value):
            raise ValueError("must be an http(s) URL")
        return value

    @field_validator("bind_address")
    @classmethod
    def _address(cls, value: str) -> str:
        ipaddress.ip_address(value)
        return value

    @field_validator(
        "served_model_name", "load_format", "attention_backend", "drafter_attention_backend",
        "tool_call_parser", "reasoning_parser",
    )
    @classmethod
    def _word(cls, value: str) -> str:
        if not _WORD.match(value):
            raise ValueError("only letters, digits and ._- are allowed")
        return value

    @field_validator("extra_serve_args")
    @classmethod
    def _extra_args(cls, value: list[str]) -> list[str]:
        for arg in value:
            if "\n" in arg or "\x00" in arg:
                raise ValueError(f"argument {arg!r} contains a newline")
        return value

    @field_validator("vllm_env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not re.match(r"^[A-Z_][A-Z0-9_]*$", key) or "\n" in str(val):
                raise ValueError(f"{key!r} is not a valid environment variable")
            # serve.env is world-readable and its SF_*/HF_* entries are the deploy's own.
            if key.startswith(("SF_", "HF_")) or key in ("VLLM_API_KEY", "VLLM_CACHE_ROOT"):
                raise ValueError(f"{key} is set by sparkfleet itself; use the matching setting instead")
            if re.search(r"TOKEN|SECRET|PASSWORD|_KEY$", key):
                raise ValueError(f"{key} looks like a secret: serve.env is not private (use api_key/hf_token)")
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if raw not in ("auto", "none") and (len(raw) < 16 or not re.match(r"^[A-Za-z0-9._~+-]+$", raw)):
            raise ValueError("must be 'auto', 'none' or 16+ characters of letters, digits and ._~+-")
        return value

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", str(value)):
            raise ValueError("names a results directory: use letters, digits and ._-")
        return value

    @field_validator("checks", "bench", "patches", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        # `--data checks=smoke,decode` arrives as one string.
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("checks", "bench")
    @classmethod
    def _check_names(cls, value: list[str]) -> list[str]:
        known = {"smoke", "tools", "decode", "e2e", "agent"}
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(sorted(known))}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> "Settings":
        if self.build_hybrid and self.profile != "dense":
            raise ValueError("build_hybrid=true only makes sense with profile=dense")
        if self.build_hybrid and self.model_dir:
            raise ValueError("set either model_dir or build_hybrid, not both")
        if "agent" in self.checks + self.bench and not self.agent_state_db:
            raise ValueError(
                "the agent bench replays turns from an agent's session database (Hermes' state.db): "
                "set agent_state_db "
                "(e.g. --data agent_state_db=~/.hermes/state.db)"
            )
        if (self.apt_repo is None) != (self.apt_key_url is None):
            raise ValueError("set both apt_repo and apt_key_url, or neither")
        if (self.apt_repo and self.apt_repo.rstrip("/") == self.nvidia_apt_repo.rstrip("/")
                and self.apt_key_url != self.nvidia_apt_key_url):
            # apt takes one Signed-By per URL: both lists name one keyring (container_runtime.py).
            raise ValueError("apt_repo is nvidia_apt_repo: give it the same key (apt_key_url = nvidia_apt_key_url)")
        if self.num_speculative_tokens and not self.profile_spec.speculative_method:
            raise ValueError(
                f"profile {self.profile} has no speculative decoder; "
                "use profile dflash, dense or mtp, or num_speculative_tokens=0"
            )
        # The serving command is built here too, by the same code the container runs, so
        # a flag it refuses (e.g. a secret in extra_serve_args) fails now, not after a restart.
        try:
            serve_args.build_serve_argv(self.serve_env())
        except ValueError as exc:
            raise ValueError(f"the serving command cannot be built: {exc}") from None
        return self

    # --- what the profile and the overrides add up to -----------------------------

    @property
    def profile_spec(self) -> Profile:
        return PROFILES[self.profile]

    @property
    def speculative_tokens(self) -> int:
        if self.num_speculative_tokens is None:
            return self.profile_spec.num_speculative_tokens
        return self.num_speculative_tokens

    @property
    def speculative_method(self) -> str | None:
        return self.profile_spec.speculative_method if self.speculative_tokens else None

    @property
    def drafter(self) -> str | None:
        return self.profile_spec.drafter if self.speculative_method == "dflash" else None

    @property
    def model_repo(self) -> str:
        return self.model or self.profile_spec.model

    def revision(self, repo: str) -> str:
        return self.model_revisions.get(repo, "main")

    @property
    def local_model_dir(self) -> str | None:
        """Host directory served instead of a hub checkpoint, if any."""
        if self.build_hybrid:
            return self.hybrid_dir
        return self.model_dir

    @property
    def repos_to_fetch(self) -> list[str]:
        """Hub repositories this host needs in its HF cache."""
        repos: list[str] = []
        if self.build_hybrid:
            repos.append(INTEL_INT4)  # the builder's input; the donor is fetched shard-wise
        elif not self.model_dir:
            repos.append(self.model_repo)
        if self.drafter:
            repos.append(self.drafter)
        return repos

    @property
    def patch_plan(self) -> list[str]:
        """The runtime patches the serve wrapper applies: ``patches``, else the profile's."""
        if self.patches is not None:
            return list(self.patches)
        patches = [p for p in self.profile_spec.patches if p != "kv_unify" or self.speculative_method == "dflash"]
        if self.prefix_caching and self.speculative_method == "dflash":
            patches.insert(patches.index("kv_unify") + 1, "prefix_align")
        return patches

    @property
    def speculative_config(self) -> dict[str, Any] | None:
        method = self.speculative_method
        if method is None:
            return None
        config: dict[str, Any] = {"method": method}
        if self.drafter:
            config["model"] = self.drafter
            if self.drafter in self.model_revisions:
                config["revision"] = self.model_revisions[self.drafter]
        config["num_speculative_tokens"] = self.speculative_tokens
        if self.drafter:
            # The drafter is non-causal: only FLASH_ATTN supports it on sm121.
            config["attention_backend"] = self.drafter_attention_backend
        return config

    @property
    def compile_signature(self) -> str:
        """What invalidates vLLM's torch.compile cache (the reference recipe's startup crash): the
        engine, the checkpoint served, the patches and the speculative decoder."""
        env = self.serve_env()
        parts = [self.image, env["SF_MODEL"], env["SF_REVISION"], env["SF_PATCHES"], env["SF_SPECULATIVE_CONFIG"]]
        return f"profile={self.profile} " + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    @property
    def serve_middleware(self) -> str:
        """vLLM's own key check guards /v1 only: with a key, runtime/key_guard.py guards the rest."""
        return "" if self.api_key.get_secret_value() == "none" else "key_guard.KeyGuard"

    @property
    def serve_model(self) -> str:
        """What vLLM serves: the container's /model for a local checkpoint, else the repo."""
        return CONTAINER_MODEL_DIR if self.local_model_dir else self.model_repo

    @property
    def serve_revision(self) -> str:
        return "" if self.local_model_dir else self.revision(self.model_repo)

    def serve_env(self, member: "PairMember | None" = None) -> dict[str, str]:
        """The non-secret environment of the serving container: runtime/serve_args.py's
        SERVE_ENV rendered from these settings (docs/architecture.md) and, for a pair
        member, from its place in the pair (``pair.*``); then ``vllm_env``."""
        def setting(name: str) -> Any:
            if name.startswith("pair."):
                return member.value(name[5:]) if member is not None else None
            return getattr(self, name)

        env = serve_args.render_env(setting)
        env.update(self.vllm_env)
        return env

    def artifact_size_gib(self, name: str) -> float:
        return self.artifact_sizes_gib.get(name, 0.0)


# --- fleet-wide validation ----------------------------------------------------------


def sparkfleet_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """The data keys that are sparkfleet's (connector and private keys removed)."""
    return {k: v for k, v in raw.items() if not k.startswith(_CONNECTOR_PREFIXES)}


def _close_matches(key: str) -> str:
    matches = difflib.get_close_matches(key, Settings.model_fields.keys(), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


def validate_host_data(host_name: str, raw: dict[str, Any]) -> Settings:
    """Validate one host's merged data; raise ConfigError with every problem found."""
    data = sparkfleet_keys(raw)
    problems: list[str] = []
    for key in sorted(set(data) - set(Settings.model_fields)):
        problems.append(f"{host_name}: unknown key `{key}` = {_show(key, data[key])}{_close_matches(key)}")
    known = {k: v for k, v in data.items() if k in Settings.model_fields}
    missing = [k for k, f in Settings.model_fields.items() if f.is_required() and k not in known]
    for key in missing:
        problems.append(
            f"{host_name}: missing key `{key}`: run pyinfra from the sparkfleet project directory "
            "so group_data/all.py (every default) is loaded"
        )
    if not missing:
        try:
            settings = Settings.model_validate(known)
        except ValidationError as exc:
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"]) or "(settings)"
                value = _show(key, known.get(key.split(".")[0], None)) if err["loc"] else ""
                fix = _FIXES.get(key.split(".")[0], "see group_data/all.py for the allowed values")
                message = err["msg"].removeprefix("Value error, ")
                where = f"`{key}` = {value}: " if err["loc"] else ""
                problems.append(f"{host_name}: {where}{message}. Fix: {fix}")
        else:
            if not problems:
                return settings
    raise ConfigError("\n  ".join(["invalid configuration:", *problems]))


def _show(key: str, value: Any) -> str:
    if key in ("hf_token", "api_key") and value not in (None, "auto", "none"):
        return "'***'"
    return repr(value)


def validate_fleet(hosts: Iterable[Any]) -> dict[str, Settings]:
    """Validate every host; one error lists all problems of all hosts."""
    hosts = list(hosts)
    settings: dict[str, Settings] = {}
    problems: list[str] = []
    for host in hosts:
        try:
            settings[host.name] = validate_host_data(host.name, host.data.dict())
        except ConfigError as exc:
            problems.extend(str(exc).split("\n  ")[1:])
    if not problems:
        problems = (_mirror_problems(hosts, settings) + chosen_endpoint(hosts, settings)[1]
                    + fleet_pairs(hosts, settings)[1])
    if problems:
        raise ConfigError(
            "\n  ".join(["invalid configuration, nothing was changed on any host:", *problems])
        )
    for name, s in settings.items():
        if s.gpu_memory_utilization > MEASURED_GPU_MEMORY_UTILIZATION:
            log.warning(
                "%s: gpu_memory_utilization=%s is above the %s the reference recipe measured as safe; "
                "a Spark's unified memory may swap and stall the host",
                name, s.gpu_memory_utilization, MEASURED_GPU_MEMORY_UTILIZATION,
            )
    return settings


_FLEET_CACHE: dict[int, dict[str, Settings]] = {}
_PAIR_CACHE: dict[int, dict[str, "Pair"]] = {}
_MIRROR_CACHE: dict[int, dict[str, "Mirror | None"]] = {}
_SUDO_CHECKED: set[tuple[int, str]] = set()


def fleet_settings() -> Settings:
    """The current host's settings, validating the whole inventory once per run."""
    from pyinfra import host, state

    key = id(state)
    if (key, host.name) not in _SUDO_CHECKED:  # before any fact: sudo must not prompt mid-run
        from sparkfleet.remote import check_sudo

        check_sudo(host)
        _SUDO_CHECKED.add((key, host.name))
    if key not in _FLEET_CACHE:
        fleet = validate_fleet(state.inventory)
        # Hosts outside --limit are not connected to, and count as reachable.
        unreachable = {h.name for h in state.inventory
                       if state.is_host_in_limit(h) and h not in state.activated_hosts}
        _MIRROR_CACHE[key] = fleet_mirrors(state.inventory, fleet, unreachable)
        _PAIR_CACHE[key] = fleet_pairs(state.inventory, fleet)[0]
        _FLEET_CACHE[key] = fleet
    return _FLEET_CACHE[key][host.name]


def all_settings() -> dict[str, Settings]:
    """Every host's settings by inventory name (validated once per run)."""
    from pyinfra import state

    fleet_settings()
    return _FLEET_CACHE[id(state)]


def all_mirrors() -> dict[str, "Mirror | None"]:
    """Every host's mirror by inventory name, as chosen once per run (among the reachable
    hosts): without their addresses, which :func:`host_mirror` finds."""
    from pyinfra import state

    fleet_settings()
    return _MIRROR_CACHE[id(state)]


def all_pairs() -> dict[str, "Pair"]:
    """Every pair member's Pair by inventory name (hosts outside a pair are absent)."""
    from pyinfra import state

    fleet_settings()
    return _PAIR_CACHE[id(state)]


def host_pair(name: str | None = None) -> "Pair | None":
    """The pair the current host (or the host ``name``) belongs to, None if it serves alone."""
    from pyinfra import host

    return all_pairs().get(name or host.name)


def mirror_route(name: str, mirror: "Mirror") -> tuple[str, str] | None:
    """(source, via) when pair member ``name`` reaches ``mirror`` over its pair's link: the
    mirror is another member of the pair, so the image and the weights cross the link (200
    Gb/s) rather than the management network. link.netplan routes the mirror's fleet address
    via the mirror's link address, and ``name``'s packets then come from its own link address
    (what the mirror's firewall allows). None otherwise, or when that address is not IPv4
    (the link has IPv4 only)."""
    pair = all_pairs().get(name)
    if pair is None or mirror.host == name or mirror.host not in pair.members:
        return None
    try:
        if ipaddress.ip_address(str(mirror.address)).version != 4:
            return None
    except ValueError:
        return None
    return pair.address, pair.addresses[pair.members.index(mirror.host)]


def host_mirror() -> "Mirror | None":
    """The mirror the current host downloads the image and model files from (None: upstream)."""
    from pyinfra import host, state

    fleet_settings()
    from sparkfleet.mirror.names import located  # it asks the hosts: the mirror's address

    return located(state, host, _MIRROR_CACHE[id(state)])


# --- the mirror (fleet_mirror) ----------------------------------------------------------------

#: An inventory group of this name picks the mirror for fleet_mirror="auto".
MIRROR_GROUP = "mirror"


@dataclass(frozen=True)
class Mirror:
    """The host that serves the fleet's model files (an HF mirror) and image (a registry)."""

    host: str  # its inventory name
    address: str | None  # how the other hosts reach it (None: found on the hosts, mirror.names)
    hf_port: int
    registry_port: int
    is_self: bool  # the current host is the mirror

    @property
    def netloc_host(self) -> str:
        """The address as URLs and registry names write it (IPv6 in brackets)."""
        return f"[{self.address}]" if self.address and ":" in self.address else str(self.address)

    @property
    def hf_endpoint(self) -> str:
        return f"http://{self.netloc_host}:{self.hf_port}"

    @property
    def registry(self) -> str:
        return f"{self.netloc_host}:{self.registry_port}"


def _auto_mirror(hosts: list[Any], unreachable: set[str]) -> str | None:
    """``fleet_mirror=auto``: the first reachable host of group ``mirror``, else of the
    inventory. A host the controller cannot reach is never chosen: its peers could not
    reach it either, and every one of them would fail at its first download."""
    names = [h.name for h in hosts]
    grouped = [h.name for h in hosts if MIRROR_GROUP in (getattr(h, "groups", None) or ())]
    up = [n for n in names if n not in unreachable]
    chosen = next((n for n in grouped if n in up), None) or next(iter(up), None)
    first = (grouped or names or [None])[0]
    if chosen != first and first is not None:
        log.warning("%s is unreachable, so %s serves the mirror (fleet_mirror=auto) in this run",
                    first, chosen or "no host")
    return chosen


def _chosen_mirrors(hosts: list[Any], settings: dict[str, Settings],
                    unreachable: frozenset[str] | set[str] = frozenset()) -> tuple[dict[str, str | None], list[str]]:
    names = [h.name for h in hosts]
    auto = _auto_mirror(hosts, set(unreachable)) if any(settings[n].fleet_mirror == "auto" for n in names) else None
    chosen: dict[str, str | None] = {}
    problems: list[str] = []
    for name in names:
        want = settings[name].fleet_mirror
        if want is None or want in names:
            chosen[name] = want
        elif want == "auto":
            chosen[name] = auto
        else:
            problems.append(
                f"{name}: `fleet_mirror` = {want!r} is not a host of the inventory ({', '.join(names)}). "
                f"Fix: {_FIXES['fleet_mirror']}"
            )
    for mirror in sorted({m for m in chosen.values() if m}):
        if chosen.get(mirror) != mirror:
            users = ", ".join(n for n, m in chosen.items() if m == mirror)
            problems.append(
                f"{mirror}: serves the mirror for {users}, so it must use it too, but its own "
                f"`fleet_mirror` = {settings[mirror].fleet_mirror!r}. Fix: give every host the same fleet_mirror"
            )
        elif mirror in unreachable:
            users = ", ".join(n for n, m in chosen.items() if m == mirror and n != mirror)
            problems.append(
                f"{mirror}: `fleet_mirror` names it as the mirror of {users}, but it is unreachable. "
                "Fix: bring it back, or deploy with --data fleet_mirror=auto (a reachable host serves "
                "the mirror) or --data fleet_mirror=none (every host downloads from upstream)"
            )
    return chosen, problems


def _mirror_problems(hosts: list[Any], settings: dict[str, Settings]) -> list[str]:
    return _chosen_mirrors(hosts, settings)[1]


def fleet_mirrors(hosts: Iterable[Any], settings: dict[str, Settings],
                  unreachable: frozenset[str] | set[str] = frozenset()) -> dict[str, Mirror | None]:
    """Each host's mirror, from fleet_mirror: ``"auto"`` is the first reachable host of
    the inventory group ``mirror`` if there is one, else of the inventory. A named mirror
    that is ``unreachable`` (the controller could not connect to it) stops the run before
    any host changes."""
    hosts = list(hosts)
    chosen, problems = _chosen_mirrors(hosts, settings, unreachable)
    if problems:
        raise ConfigError("\n  ".join(["invalid configuration, nothing was changed on any host:", *problems]))
    sources: dict[str, Mirror | None] = {}
    for name, mirror in chosen.items():
        if mirror is None:
            sources[name] = None
            continue
        ms = settings[mirror]
        # The controller's name for the mirror (an SSH alias, a .local name) may mean
        # nothing to the other hosts: unless mirror_address says, it is found on them.
        sources[name] = Mirror(mirror, ms.mirror_address, ms.mirror_hf_port, ms.mirror_registry_port, name == mirror)
    return sources


#: An inventory group of this name picks the fleet endpoint for fleet_endpoint="auto".
ENDPOINT_GROUP = "endpoint"


def chosen_endpoint(hosts: list[Any], settings: dict[str, Settings]) -> tuple[str | None, list[str]]:
    """The host that serves the fleet endpoint (None: none), and what is wrong. ``auto``
    is the first host of the inventory group ``endpoint``, else none: a router is a new
    port and a new way in on a host, so the inventory opts in."""
    names = [h.name for h in hosts]
    grouped = [h.name for h in hosts if ENDPOINT_GROUP in (getattr(h, "groups", None) or ())]
    chosen: dict[str, str | None] = {}
    problems: list[str] = []
    for name in names:
        want = settings[name].fleet_endpoint
        if want == "auto":
            chosen[name] = (grouped or [None])[0]
        elif want is None or want in names:
            chosen[name] = want
        else:
            problems.append(f"{name}: `fleet_endpoint` = {want!r} is not a host of the inventory "
                            f"({', '.join(names)}). Fix: {_FIXES['fleet_endpoint']}")
    if not problems and len(set(chosen.values())) > 1:
        problems.append("the hosts name different fleet endpoints ("
                        + ", ".join(f"{n}: {e or 'none'}" for n, e in chosen.items())
                        + "). Fix: give every host the same fleet_endpoint")
    return (next(iter(chosen.values()), None) if not problems else None), problems


# --- pairs (inventory groups pair_*) ------------------------------------------------------------

#: An inventory group whose name starts so is a pair: its hosts serve one model together.
PAIR_GROUP_PREFIX = "pair_"
#: What every member of a pair must agree on, besides the serving command itself.
_PAIR_AGREED = ("profile", "model_repo", "image", "serving", "pair_subnet", "pair_master_port", "pair_mtu")


@dataclass(frozen=True)
class Pair:
    """Hosts cabled by their ConnectX-7 that serve one model with vLLM's multi-node tensor
    parallelism, as the current host sees it. Rank 0 (the head) serves HTTP; the others
    run headless."""

    group: str  # the inventory group, e.g. pair_a
    members: tuple[str, ...]  # inventory names, in rank order
    rank: int  # the current host's
    addresses: tuple[str, ...]  # each member's address on the link, in rank order
    prefix_len: int
    port: int  # the head's rendezvous port (--master-port)

    @property
    def head(self) -> str:
        return self.members[0]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def headless(self) -> bool:
        """Ranks above 0 run ``--headless``: they serve no HTTP."""
        return not self.is_head

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def address(self) -> str:
        return self.addresses[self.rank]

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    @property
    def peer_addresses(self) -> tuple[str, ...]:
        return tuple(a for r, a in enumerate(self.addresses) if r != self.rank)


@dataclass(frozen=True)
class PairMember:
    """One member's part of its pair's engine: the ``pair.*`` values of serve.env."""

    pair: Pair
    interface: str  # the CX7 netdev NCCL, Gloo and vLLM use (link.resolved)
    hcas: str  # NCCL_IB_HCA: the RoCE devices of the cabled port
    ib_disable: str = "0"
    ignore_cpu_affinity: str = "1"

    def value(self, name: str) -> Any:
        """A ``pair.*`` value of serve.env: this member's own, else its Pair's."""
        return getattr(self, name) if name in self.__dataclass_fields__ else getattr(self.pair, name)


def _group_members(hosts: Any, group: str) -> list[str]:
    """The group's hosts in inventory order, which is their rank order: pyinfra keeps one
    order of hosts (where each is first listed), not a group's own."""
    return [h.name for h in hosts if group in (getattr(h, "groups", None) or ())]


def _pair_value(s: Settings, key: str) -> Any:
    return getattr(s, key) if key != "model_repo" else f"{s.model_repo}@{s.revision(s.model_repo)}"


def fleet_pairs(hosts: Iterable[Any], settings: dict[str, Settings]) -> tuple[dict[str, Pair], list[str]]:
    """Each pair member's Pair, from the inventory's pair_* groups, and what is wrong with
    them: a host in two pairs, a pair of one, members that would not run one engine."""
    listed = list(hosts)
    groups = sorted({g for h in listed for g in (getattr(h, "groups", None) or ())
                     if str(g).startswith(PAIR_GROUP_PREFIX)})
    pairs: dict[str, Pair] = {}
    problems: list[str] = []
    seen: dict[str, str] = {}
    for group in groups:
        members = [n for n in _group_members(hosts, group) if n in settings]
        for name in members:
            if name in seen:
                problems.append(f"{name}: is in two pairs, {seen[name]} and {group}. Fix: a Spark has one "
                                "ConnectX-7 cable to one peer: list it in one pair_* group")
            seen.setdefault(name, group)
        if len(members) < 2:
            problems.append(f"{group}: a pair needs two hosts, the inventory lists {', '.join(members) or 'none'}. "
                            f"Fix: add its peer to {group}, or rename the group (pair_* groups are pairs)")
            continue
        head = settings[members[0]]
        head_env = head.serve_env()
        for name in members[1:]:
            s = settings[name]
            differ_in = [key for key in _PAIR_AGREED if _pair_value(s, key) != _pair_value(head, key)]
            for key in differ_in:
                shown = "model@revision" if key == "model_repo" else key
                problems.append(
                    f"{group}: {members[0]} and {name} differ in `{shown}` ({_pair_value(head, key)!r} vs "
                    f"{_pair_value(s, key)!r}); a pair runs one engine. Fix: give both hosts the same {shown} "
                    f"(set it in group_data/{group}.py)")
            env = s.serve_env()
            differ = sorted(k for k in head_env.keys() | env.keys() if head_env.get(k) != env.get(k))
            if differ and not differ_in:
                problems.append(f"{group}: {members[0]} and {name} would start different engines ({', '.join(differ)} "
                                f"differ). Fix: give both hosts the same serving settings (group_data/{group}.py)")
        net = ipaddress.IPv4Network(head.pair_subnet)
        if len(members) > net.num_addresses - 2:
            problems.append(f"{group}: pair_subnet {net} has no address for each of its {len(members)} hosts. "
                            f"Fix: {_FIXES['pair_subnet']}")
            continue
        addresses = tuple(str(net.network_address + 1 + r) for r in range(len(members)))
        for rank, name in enumerate(members):
            if name not in pairs:
                pairs[name] = Pair(group, tuple(members), rank, addresses, net.prefixlen, head.pair_master_port)
    return pairs, problems


def project_defaults() -> dict[str, Any]:
    """group_data/all.py of this project, for code that runs outside a pyinfra run."""
    import runpy

    path = Path(__file__).resolve().parents[1] / "group_data" / "all.py"
    return {k: v for k, v in runpy.run_path(str(path)).items() if not k.startswith("__")}
