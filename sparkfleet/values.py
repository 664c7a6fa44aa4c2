"""What one data key's value may be: the checked types that Settings' fields are made of.

Each type judges its value alone and says in words what is wrong with it; config.py adds
the host, the key and the fix. What holds only across keys is the model's own check.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, SecretStr

from sparkfleet.profiles import PROFILES

_SAFE_PATH = re.compile(r"^(?!.*/\.\.(?:/|$))/[A-Za-z0-9._/+-]*$")  # no /../
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# registry[:port]/path[:tag][@sha256:digest] — lower-case path, as registries require.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._/-][a-z0-9]+)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_HOSTNAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$")


def _matching(pattern: re.Pattern, message: str) -> AfterValidator:
    """A value check: ``pattern`` matches the whole value, or ValueError(``message``)."""
    def check(value: str) -> str:
        if not pattern.match(value):
            raise ValueError(message)
        return value
    return AfterValidator(check)


RepoId = Annotated[str, _matching(_REPO_ID, "not a Hugging Face repo id (org/name)")]
ImageRef = Annotated[str, _matching(_IMAGE_REF, "not an image reference")]
Url = Annotated[str, _matching(re.compile(r"^https?://[A-Za-z0-9.:\[\]_-]+(?:/[A-Za-z0-9._~/$()%+-]*)?$"),
                                "must be an http(s) URL")]
Word = Annotated[str, _matching(re.compile(r"^[A-Za-z0-9_.-]*$"), "only letters, digits and ._- are allowed")]
# A pip requirement without spaces, markers or shell characters, e.g. olah==0.5.4.
Requirement = Annotated[str, _matching(re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9,._-]+\])?(?:(?:==|>=|<=|~=|!=|>|<)[A-Za-z0-9.*+!_-]+)?$"),
    "not a pip requirement (name, optionally ==version)")]
HostPath = Annotated[str, _matching(_SAFE_PATH, "must be an absolute path of letters, digits and ._/+-")]
ControllerPath = Annotated[str, _matching(re.compile(r"^[^\n\x00]+$"), "must be a directory on the controller")]
ProfileName = Annotated[str, _matching(re.compile(f"^({'|'.join(map(re.escape, PROFILES))})$"),
                                       f"unknown profile; valid profiles: {', '.join(sorted(PROFILES))}")]
VersionText = Annotated[str, _matching(re.compile(r"^\d+(?:\.\d+)*$"), "use a dotted version such as 2.30.4")]
NetdevNames = Annotated[str, _matching(re.compile(r"^[A-Za-z0-9_.:-]+(?:,[A-Za-z0-9_.:-]+)*$"),
                                       "must be 'auto' or device names (comma-separated)")]
RunId = Annotated[str, _matching(re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"),
                                 "names a results directory: use letters, digits and ._-")]
IpAddress = Annotated[str, AfterValidator(lambda value: ipaddress.ip_address(value) and value)]  # ValueError if not


def _revisions(value: dict[str, str]) -> dict[str, str]:
    for repo, rev in value.items():
        if not _REPO_ID.match(repo):
            raise ValueError(f"{repo!r} is not a repo id (org/name)")
        if not _REVISION.match(rev):
            raise ValueError(f"revision {rev!r} of {repo} is not a branch, tag or commit")
    return value


#: {repo id: branch, tag or commit}
Revisions = Annotated[dict[str, str], AfterValidator(_revisions)]


def _host_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise ValueError("must be a host name, an IPv4 or an IPv6 address")
    if value.lower().rstrip(".").endswith(".local"):
        # Resolved by mDNS (avahi, nss-mdns) on the host alone: the serving image's
        # containers on the host network, which fetch from it, have no mDNS resolver.
        raise ValueError("is an mDNS (.local) name, which the hosts' containers cannot resolve")
    return value


#: A host name or an IP address (an IPv6 one with or without its brackets), as other hosts
#: and their containers reach it: not a .local name.
HostAddress = Annotated[str, AfterValidator(_host_address)]

#: fleet_mirror, fleet_endpoint and fleet_monitor values that turn the role off.
ROLE_OFF = (None, "", "none", "off", "false")


def _role_host(value: Any) -> Any:
    if value is False or (isinstance(value, str) and value.strip().lower() in ROLE_OFF):
        return None
    if value is not None and (not isinstance(value, str) or "\n" in value or not value.strip()):
        raise ValueError("must be 'auto', a host name of the inventory, or none")
    return value


#: Which host takes a fleet's role: 'auto', a host of the inventory, or None (off).
RoleHost = Annotated[str | None, BeforeValidator(_role_host)]


def _subnet(value: str) -> str:
    try:
        net = ipaddress.IPv4Network(value, strict=False)
    except ValueError:
        raise ValueError("not an IPv4 network like 192.168.100.0/24") from None
    if net.num_addresses < 4:
        raise ValueError("too small for a pair: use a /30 or larger")
    return str(net)


#: An IPv4 network with room for a pair's two link addresses.
PairSubnet = Annotated[str, AfterValidator(_subnet)]


def _one_line_args(value: list[str]) -> list[str]:
    for arg in value:
        if "\n" in arg or "\x00" in arg:
            raise ValueError(f"argument {arg!r} contains a newline")
    return value


#: Arguments added to `vllm serve`, each one line.
ServeArgs = Annotated[list[str], AfterValidator(_one_line_args)]


def _environment(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        if not re.match(r"^[A-Z_][A-Z0-9_]*$", key) or "\n" in str(val):
            raise ValueError(f"{key!r} is not a valid environment variable")
        # serve.env is world-readable and its SF_*/HF_* entries are the deploy's own.
        if key.startswith(("SF_", "HF_")) or key in ("VLLM_API_KEY", "VLLM_CACHE_ROOT"):
            raise ValueError(f"{key} is set by sparkfleet itself; use the matching setting instead")
        if re.search(r"TOKEN|SECRET|PASSWORD|_KEY$", key):
            raise ValueError(f"{key} looks like a secret: serve.env is not private (use api_key/hf_token)")
    return value


#: Variables added to serve.env: none of sparkfleet's own, no secret.
ServeEnv = Annotated[dict[str, str], AfterValidator(_environment)]


def _api_key(value: SecretStr) -> SecretStr:
    raw = value.get_secret_value()
    if raw not in ("auto", "none") and (len(raw) < 16 or not re.match(r"^[A-Za-z0-9._~+-]+$", raw)):
        raise ValueError("must be 'auto', 'none' or 16+ characters of letters, digits and ._~+-")
    return value


ApiKey = Annotated[SecretStr, AfterValidator(_api_key)]


def _comma_list(value: Any) -> Any:
    # `--data checks=smoke,decode` arrives as one string.
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


#: A list, also given as one comma-separated string.
Names = Annotated[list[str], BeforeValidator(_comma_list)]

def _check_names(value: list[str]) -> list[str]:
    known = {"smoke", "tools", "decode", "e2e", "agent"}
    unknown = [name for name in value if name not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(sorted(known))}")
    return value


#: Post-deploy checks and benches (checks/), by name.
CheckNames = Annotated[Names, AfterValidator(_check_names)]


def _lock_update(value: list[str]) -> list[str]:
    for name in value:
        if name not in ("all", "image") and not _REPO_ID.match(name):
            raise ValueError(f"{name!r} is neither all, image nor a repo id")
    return value


#: What sparkfleet.lock moves: all, image, or repo ids.
LockUpdate = Annotated[Names, AfterValidator(_lock_update)]

#: The stack under the engine (sparkfleet/stack.py): what stack_versions may name.
STACK_COMPONENTS = ("driver", "toolkit", "docker", "kernel")
_APT_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")  # Debian policy 5.6.1
_APT_VERSION = re.compile(r"^(?:[0-9]+:)?[0-9][A-Za-z0-9.+~-]*$")  # [epoch:]upstream[-revision], 5.6.12


def _stack(value: dict[str, dict[str, str | None]]) -> dict[str, dict[str, str | None]]:
    for component, versions in value.items():
        if component not in STACK_COMPONENTS:
            raise ValueError(f"unknown component {component!r}: the stack is {', '.join(STACK_COMPONENTS)}")
        for package, version in versions.items():
            if not _APT_PACKAGE.match(package):
                raise ValueError(f"{package!r} ({component}) is not an apt package name")
            if version is not None and not _APT_VERSION.match(version):
                raise ValueError(f"{version!r} of {package} is not an apt version (as `apt-cache policy` shows)")
    return value


#: {component: {apt package: version, or None: held where it is}}
StackVersions = Annotated[dict[str, dict[str, str | None]], AfterValidator(_stack)]


def _rollout_batch(value: Any) -> list[int | str]:
    """A count of hosts, a share of them ("25%"), or a list of those: each batch takes the next
    and the last repeats ([1, "25%"]: one host first, then a quarter of the fleet at a time)."""
    if isinstance(value, str) and value.strip().startswith("["):
        raise ValueError("give a list as JSON: [1, \"25%\"]")
    steps = value if isinstance(value, list) else [value]
    if not steps:
        raise ValueError("give at least one batch size")
    found: list[int | str] = []
    for step in steps:
        text = str(step).strip()
        share = re.fullmatch(r"(\d{1,3})%", text)
        if share and 1 <= int(share[1]) <= 100:
            found.append(f"{int(share[1])}%")
        elif isinstance(step, int | str) and not isinstance(step, bool) and text.isdigit() and 1 <= int(text) <= 1024:
            found.append(int(text))
        else:
            raise ValueError(f"{step!r} is not a batch size: a number of hosts (1-1024) or a share of them (1%-100%)")
    return found


#: Hosts per batch of a rollout: counts and shares, the last one repeating (rollout.batch_sizes).
RolloutBatch = Annotated[list[int | str], BeforeValidator(_rollout_batch)]
