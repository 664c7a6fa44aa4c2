"""One model validates every host's merged data before any host is touched.

pyinfra merges data as ``--data`` > host data > ``group_data/<group>.py`` >
``group_data/all.py``. :func:`fleet_settings` validates that merged dict for *every* host
of the inventory the first time a deploy file asks, and raises one
:class:`ConfigError` naming host, key, value and fix for everything that is wrong —
while nothing has run on any host yet. ``group_data/all.py`` holds every default; the
model has none of its own, so there is exactly one place to read them. Each key's type
(sparkfleet/values.py) judges its value alone; the model judges the keys together.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import runpy
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from runtime import serve_args, startup  # the one builder of the `vllm serve` argv (also in the container)
from sparkfleet.profiles import FP8_DONOR, INTEL_INT4, PROFILES, Profile
from sparkfleet.values import (
    ApiKey,
    CheckNames,
    ControllerPath,
    HostAddress,
    HostPath,
    ImageRef,
    IpAddress,
    LockUpdate,
    Names,
    NetdevNames,
    PairSubnet,
    ProfileName,
    RepoId,
    Requirement,
    Revisions,
    RoleHost,
    RolloutBatch,
    RunId,
    ServeArgs,
    ServeEnv,
    StackVersions,
    Url,
    VersionText,
    Word,
)

try:  # pyinfra is the runtime, but the model is also used by plain unit tests
    from pyinfra.api.exceptions import PyinfraError as _BaseError
except ImportError:  # pragma: no cover
    _BaseError = Exception

# The reference recipe measured 0.82 as the most a 128 GiB Spark takes without swapping the OS.
MEASURED_GPU_MEMORY_UTILIZATION = 0.82
MAX_CONTEXT = 262144
CONTAINER_MODEL_DIR = "/model"

# Data keys that belong to pyinfra's connectors, not to sparkfleet.
_CONNECTOR_PREFIXES = ("ssh_", "_", "docker_", "chroot_", "local_", "winrm_", "vagrant_", "terraform_", "fake_")

FIXES: dict[str, str] = {
    "profile": "pick one of the profiles, e.g. --data profile=dense",
    "gpu_memory_utilization": ("use a fraction between 0.10 and 0.95: 0.82 (the default) of a Spark's 121.7 GiB starts "
                               "on a headless Spark (~101-102 GiB available); above ~0.83 vLLM refuses to start there"),
    "max_model_len": f"use a context length from 1 to {MAX_CONTEXT}",
    "port": "use a TCP port from 1 to 65535",
    "num_speculative_tokens": "use 0 (off) to 16, or leave it unset for the profile's default",
    "image": "use a reference like registry/name:tag or registry/name@sha256:<64 hex>",
    "model": "use a Hugging Face repo id like org/name",
    "api_key": "use 'auto' (generated per fleet), 'none' (trusted network only) or a key of 16+ characters",
    "fleet_mirror": "use 'auto' (the first host of group `mirror`, else of the inventory), a host of the inventory, or none",
    "mirror_olah": "use a pip requirement like olah==0.5.4",
    "mirror_address": "use an IP address of the mirror host that every host reaches (`ip -4 addr` on it) or a "
                      "DNS name, or leave it unset: the deploy finds the address the hosts route to",
    "fleet_endpoint": "use 'auto' (the first host of group `endpoint`, else none), a host of the inventory, or none",
    "fleet_monitor": "use 'auto' (the first host of group `monitor`, else the fleet endpoint's host, else none), "
                     "a host of the inventory, or none",
    "pair_subnet": "use an IPv4 network for the pairs' links, e.g. 192.168.100.0/24",
    "pair_interface": "use 'auto' (the ConnectX-7 port ibdev2netdev shows Up) or a netdev such as enp1s0f1np1",
    "pair_gid_index": "use 'auto' (this host's RoCE v2 GID of the link's address, per show_gids) or an index "
                      "such as 3",
    "pair_graphs_min_vllm": "use a version such as 0.27.1",
    "pair_graphs_min_nccl": "use a version such as 2.30.4",
    "pair_hcas": "use 'auto' (the RoCE devices of the cabled port) or a comma list such as rocep1s0f1,roceP2p1s0f1",
    "stack_versions": "use {component: {apt package: version or None}} with components driver, toolkit, docker, "
                      "kernel and versions as `apt-cache policy PACKAGE` lists them (None: held where it is)",
    "fleet_lock_update": "use all, image, or the repo ids to move (comma-separated), e.g. --data fleet_lock_update=all",
}


#: The serve.env variables whose refusal a setting of the data causes: (its key, the fix).
_COMMAND_KEYS = {
    "SF_EXTRA_ARGS": ("extra_serve_args", "remove that flag from extra_serve_args; the API key and the HF token "
                                          "reach vLLM from 0600 files: set them as api_key and hf_token"),
    "SF_PATCHES": ("patches", "name patches from the known ones, or leave patches unset for the profile's"),
}


def _unbuildable(said: str) -> str:
    """What serve_args refuses in the serving command (``SF_EXTRA_ARGS: --api-key is
    refused ...``), named by the data key behind that variable, with its fix."""
    found = re.match(r"(SF_[A-Z_]+): ", said)
    if not found or found.group(1) not in _COMMAND_KEYS:
        return f"the serving command cannot be built: {said}"
    key, fix = _COMMAND_KEYS[found.group(1)]
    return f"`{key}`: {said[found.end():]} (the serving command cannot be built). Fix: {fix}"


class ConfigError(_BaseError, ValueError):
    """Invalid configuration; raised before any operation runs on any host."""


class PairValues(Protocol):
    """A pair member's part of serve.env (``fleet.PairMember``): its ``pair.*`` values."""

    def value(self, name: str) -> Any: ...


class Settings(BaseModel):
    """The declared state of one Spark. Defaults live in group_data/all.py."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # What to serve
    profile: ProfileName
    model: RepoId | None
    model_revisions: Revisions
    model_dir: HostPath | None
    build_hybrid: bool
    verify_weights: bool
    hybrid_dir: HostPath
    # Where it comes from
    image: ImageRef
    hf_home: HostPath
    hf_endpoint: Url | None
    hf_token: SecretStr | None
    # The mirror: one host serves the others the image and the weights (sparkfleet/mirror/)
    fleet_mirror: RoleHost
    mirror_address: HostAddress | None
    mirror_hf_port: int = Field(ge=1, le=65535)
    mirror_registry_port: int = Field(ge=1, le=65535)
    mirror_dir: HostPath
    mirror_olah: Requirement
    mirror_tls_dir: ControllerPath
    image_registry_url: Url | None
    mirror_hf_offline_port: int = Field(ge=1, le=65535)
    mirror_keep_previous: int = Field(ge=0, le=100)
    fleet_fanout: int = Field(ge=1, le=64)
    # The fleet lock: sparkfleet.lock (sparkfleet/fleetlock.py)
    fleet_lock_file: ControllerPath | None
    fleet_lock_update: LockUpdate
    # The fleet endpoint: HAProxy over every serving host (sparkfleet/endpoint.py)
    fleet_endpoint: RoleHost
    endpoint_port: int = Field(ge=1, le=65535)
    endpoint_metrics_port: int = Field(ge=1, le=65535)
    endpoint_timeout_s: int = Field(ge=60, le=86400)
    # The fleet monitor: Prometheus, the node exporters, the alert rules (sparkfleet/monitor.py)
    fleet_monitor: RoleHost
    monitor_bind_address: IpAddress
    monitor_port: int = Field(ge=1, le=65535)
    node_exporter_port: int = Field(ge=1, le=65535)
    monitor_scrape_interval_s: int = Field(ge=1, le=3600)
    alert_for_s: int = Field(ge=0, le=86400)
    alert_memory_available_gib: float = Field(ge=0)
    alert_psi_full_pct: float = Field(gt=0, le=100)
    alert_disk_free_pct: float = Field(gt=0, lt=100)
    alert_acceptance_window_s: int = Field(ge=10, le=86400)
    # Pairs: an inventory group pair_* serves one model over the ConnectX-7 link (sparkfleet/link.py)
    pair_subnet: PairSubnet
    pair_mtu: int = Field(ge=1280, le=9216)
    pair_interface: NetdevNames
    pair_hcas: NetdevNames
    pair_master_port: int = Field(ge=1, le=65535)
    pair_check_port: int = Field(ge=1, le=65535)
    pair_enforce_eager: bool
    pair_disable_custom_all_reduce: bool
    pair_graphs_min_vllm: VersionText
    pair_graphs_min_nccl: VersionText
    pair_gid_index: Literal["auto"] | Annotated[int, Field(ge=0, le=255)]
    pair_min_busbw_gbs: float = Field(ge=0, le=100)
    # Serving settings (the reference recipe's validated stack)
    served_model_name: Word
    bind_address: IpAddress
    port: int = Field(ge=1, le=65535)
    max_model_len: int = Field(ge=1, le=MAX_CONTEXT)
    max_num_seqs: int = Field(ge=1, le=256)
    max_num_batched_tokens: int = Field(ge=256, le=1048576)
    gpu_memory_utilization: float = Field(ge=0.10, le=0.95)
    engine_startup_memory_gib: float = Field(ge=0)
    oom_guard_min_available_gib: float = Field(gt=0)
    # The watchdog (sparkfleet/watchdog.py)
    watchdog_interval_s: int = Field(ge=1, le=600)
    wedge_timeout_s: int = Field(ge=5, le=86400)
    wedge_max_restarts: int = Field(ge=0, le=100)
    wedge_restart_window_s: int = Field(ge=60, le=604800)
    memory_stop_psi_full_pct: float = Field(gt=0, le=100)
    memory_stop_available_gib: float = Field(gt=0)
    watchdog_agent_port: int = Field(ge=1, le=65535)
    load_format: Word
    attention_backend: Word
    drafter_attention_backend: Word
    tool_call_parser: Word
    reasoning_parser: Word
    chunked_prefill: bool
    prefix_caching: bool
    num_speculative_tokens: int | None = Field(ge=0, le=16)
    extra_serve_args: ServeArgs
    vllm_env: ServeEnv
    patches: Names | None
    # Access
    api_key: ApiKey
    api_key_file: str
    # Lifecycle
    serving: bool
    force: bool
    ready_timeout_s: int | None = Field(ge=10, le=7200)  # None: derived (runtime/startup.py)
    startup_time_scale: float = Field(gt=0, le=1)
    # Rolling changes (sparkfleet/rollout.py)
    rollout: Literal["rolling", "all"]
    rollout_batch: RolloutBatch
    drain_timeout_s: int = Field(ge=0, le=86400)
    rollout_min_acceptance: float = Field(ge=1.0, le=17.0)
    rollout_min_decode_tok_s: float = Field(ge=0, le=1000)
    # Host preparation
    stack_versions: StackVersions

    nvidia_apt_repo: Url
    nvidia_apt_key_url: Url
    apt_repo: Url | None
    apt_key_url: Url | None
    image_size_gib: float = Field(gt=0)
    image_unpack_ratio: float = Field(ge=1)
    artifact_sizes_gib: dict[str, float]
    disk_margin_gib: float = Field(ge=0)
    # Post-deploy checks (see checks/)
    checks: CheckNames
    bench: CheckNames
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
    bench_dir: HostPath
    run_id: RunId | None = Field(coerce_numbers_to_str=True)
    results_dir: str

    # --- checks across keys (a key's own value is judged by its type: sparkfleet/values.py) ---

    @model_validator(mode="after")
    def _coherent(self) -> "Settings":
        if self.build_hybrid and self.profile != "dense":
            raise ValueError("build_hybrid=true only makes sense with profile=dense")
        if self.build_hybrid and self.model_dir:
            raise ValueError("set either model_dir or build_hybrid, not both")
        if "agent" in self.checks + self.bench and not self.agent_state_db:
            raise ValueError("the agent bench replays turns from an agent's session database (Hermes' state.db): "
                             "set agent_state_db (e.g. --data agent_state_db=~/.hermes/state.db)")
        if self.memory_stop_available_gib <= self.oom_guard_min_available_gib:
            raise ValueError(f"memory_stop_available_gib ({self.memory_stop_available_gib:g}) must be above "
                             f"oom_guard_min_available_gib ({self.oom_guard_min_available_gib:g}): the engine is "
                             "stopped cleanly before earlyoom has to kill it")
        if (self.apt_repo is None) != (self.apt_key_url is None):
            raise ValueError("set both apt_repo and apt_key_url, or neither")
        if (self.apt_repo and self.apt_repo.rstrip("/") == self.nvidia_apt_repo.rstrip("/")
                and self.apt_key_url != self.nvidia_apt_key_url):
            # apt takes one Signed-By per URL: both lists name one keyring (container_runtime.py).
            raise ValueError("apt_repo is nvidia_apt_repo: give it the same key (apt_key_url = nvidia_apt_key_url)")
        if self.num_speculative_tokens and not self.profile_spec.speculative_method:
            raise ValueError(f"profile {self.profile} has no speculative decoder; "
                             "use profile dflash, dense or mtp, or num_speculative_tokens=0")
        # The serving command is built here too, by the same code the container runs, so
        # a flag it refuses (e.g. a secret in extra_serve_args) fails now, not after a restart.
        try:
            serve_args.build_serve_argv(self.serve_env())
        except ValueError as exc:
            raise ValueError(_unbuildable(str(exc))) from None
        return self

    @property
    def checkpoint_gib(self) -> float:
        """The served checkpoint's size, as the disk preflight counts it."""
        name = "hybrid-build" if self.build_hybrid else self.model_repo
        return self.artifact_size_gib(name) + (self.artifact_size_gib(self.drafter) if self.drafter else 0.0)

    def ready_wait_s(self, pair: bool = False) -> int:
        """How long READY may take after a (re)start: ``ready_timeout_s``, else a cold start of
        this checkpoint with this loader (runtime/startup.py) times its slack, in this fleet's
        time; a pair's (two Sparks over the link start slower: startup.PAIR_FACTOR) for a pair's member."""
        if self.ready_timeout_s is not None:
            return self.ready_timeout_s
        return startup.ready_timeout_s(self.checkpoint_gib, self.load_format, pair=pair,
                                       time_scale=self.startup_time_scale)

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
    def hub_repos(self) -> list[str]:
        """Hub repositories whose revision this host uses: those it fetches, and the FP8
        donor a hybrid build reads shard-wise (sparkfleet.lock pins each)."""
        return self.repos_to_fetch + ([FP8_DONOR] if self.build_hybrid else [])

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

    def serve_env(self, member: PairValues | None = None) -> dict[str, str]:
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


def hf_token(settings: Settings) -> str | None:
    """HF token from data, else from the controller's environment."""
    if settings.hf_token is not None:
        return settings.hf_token.get_secret_value() or None
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


# --- one host's data, validated ------------------------------------------------------


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
                fix = FIXES.get(key.split(".")[0], "see group_data/all.py for the allowed values")
                message = err["msg"].removeprefix("Value error, ")
                where = f"`{key}` = {value}: " if err["loc"] else ""
                if not err["loc"] and ". Fix: " in message:  # a check across settings names key and fix itself
                    problems.append(f"{host_name}: {message}")
                else:
                    problems.append(f"{host_name}: {where}{message}. Fix: {fix}")
        else:
            if not problems:
                return settings
    raise ConfigError("\n  ".join(["invalid configuration:", *problems]))


def _show(key: str, value: Any) -> str:
    secret = key in ("hf_token", "api_key") and value not in (None, "auto", "none")
    return "'***'" if secret else repr(value)


def project_defaults() -> dict[str, Any]:
    """group_data/all.py of this project, for code that runs outside a pyinfra run."""
    path = Path(__file__).resolve().parents[1] / "group_data" / "all.py"
    return {k: v for k, v in runpy.run_path(str(path)).items() if not k.startswith("__")}
