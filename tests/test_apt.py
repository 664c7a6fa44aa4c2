"""apt.installed: a repository's key, its list (only that list refreshed) and the install;
the host's own archives without one; nothing when the programs are there. The four steps
that install with it run the commands they ran before it (no fleet: a recording host, and
@fake hosts in a pyinfra state of their own)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import OperationError
from pyinfra.context import ctx_host, ctx_state

from sparkfleet import apt, container_runtime, endpoint, oomguard, snapshot
from sparkfleet.hostpaths import ARCHIVE_APT_KEYRING, NVIDIA_APT_KEYRING
from sparkfleet.mirror import registry

REPO, KEY = "https://apt.example/flat", "https://apt.example/key.asc"
NVIDIA = "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)"

ARCHIVE_SOURCE = [
    "curl -fsSL --retry 3 https://apt.example/key.asc -o /usr/share/keyrings/sparkfleet-archive.asc",
    "echo 'deb [signed-by=/usr/share/keyrings/sparkfleet-archive.asc] https://apt.example/flat /' "
    "> /etc/apt/sources.list.d/sparkfleet-archive.list",
    "apt-get update -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/sparkfleet-archive.list "
    "-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0",
]
INSTALL = "DEBIAN_FRONTEND=noninteractive apt-get install -y"
CONFOLD = "-o Dpkg::Options::=--force-confold"


def test_a_signed_repository_gets_its_key_its_list_and_only_that_list_refreshed():
    assert apt.commands(["earlyoom"], REPO, KEY, keep_config=True) == [
        *ARCHIVE_SOURCE, f"{INSTALL} {CONFOLD} earlyoom"]
    # Another keyring and list: the key goes there, the list names it, only it is refreshed.
    commands = apt.commands(["nvidia-container-toolkit"], NVIDIA, f"{NVIDIA}/gpgkey", keyring=NVIDIA_APT_KEYRING,
                            sources="/etc/apt/sources.list.d/nvidia-container-toolkit.list")
    assert commands == [
        f"curl -fsSL --retry 3 '{NVIDIA}/gpgkey' -o {NVIDIA_APT_KEYRING}",  # $(ARCH) is apt's, not the shell's
        f"echo 'deb [signed-by={NVIDIA_APT_KEYRING}] {NVIDIA} /' > /etc/apt/sources.list.d/nvidia-container-toolkit.list",
        "apt-get update -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/nvidia-container-toolkit.list "
        "-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0",
        f"{INSTALL} nvidia-container-toolkit",
    ]


def test_without_a_repository_the_hosts_own_archives_are_refreshed_whole():
    assert apt.commands(["docker-registry", "skopeo"], keep_config=True, no_recommends=True) == [
        "apt-get update", f"{INSTALL} {CONFOLD} --no-install-recommends docker-registry skopeo"]
    assert apt.commands(["haproxy"], None, None) == ["apt-get update", f"{INSTALL} haproxy"]


def test_a_repository_without_its_key_or_nothing_to_install_is_refused():
    with pytest.raises(OperationError, match="needs its signing key"):
        apt.commands(["earlyoom"], REPO, None)
    with pytest.raises(OperationError, match="no packages"):
        apt.commands([], REPO, KEY)


@pytest.fixture()
def recorded(monkeypatch):
    """Every module's ``host`` records its noops and answers facts from ``present``
    (program or fact class name -> answer); ``snapshot.program`` answers from it too."""
    present: dict = {}
    noops: list[str] = []

    def get_fact(fact, **kwargs):
        return present.get(kwargs.get("command", fact.__name__))

    fake = SimpleNamespace(noop=noops.append, get_fact=get_fact)
    for module in (apt, container_runtime, endpoint, registry):
        monkeypatch.setattr(module, "host", fake)
    monkeypatch.setattr(snapshot, "program", present.get)
    return SimpleNamespace(present=present, noops=noops)


def test_nothing_is_installed_when_every_program_is_there(recorded):
    recorded.present.update({"docker-registry": "/usr/bin/docker-registry", "skopeo": "/usr/bin/skopeo"})
    assert list(apt.installed._inner(["docker-registry", "skopeo"], apt_repo=REPO, apt_key_url=KEY)) == []
    assert recorded.noops == ["docker-registry and skopeo are installed"]
    # One missing: the whole install, source first.
    del recorded.present["skopeo"]
    commands = list(apt.installed._inner(["docker-registry", "skopeo"], apt_repo=REPO, apt_key_url=KEY))
    assert commands == [*ARCHIVE_SOURCE, f"{INSTALL} docker-registry skopeo"]
    assert recorded.noops == ["docker-registry and skopeo are installed"]


def test_the_programs_looked_for_and_how_are_the_steps(recorded):
    asked = []

    def which(program):
        asked.append(program)
        return program == "nvidia-ctk"

    commands = list(apt.installed._inner(["nvidia-container-toolkit"], programs=["nvidia-ctk", "hook"],
                                         which=which))
    assert asked == ["nvidia-ctk", "hook"] and commands[-1] == f"{INSTALL} nvidia-container-toolkit"
    assert list(apt.installed._inner(["nvidia-container-toolkit"], programs=["nvidia-ctk"], which=which)) == []
    assert recorded.noops == ["nvidia-container-toolkit is installed"]
    assert apt.installed_message(["a", "b", "c"]) == "a, b and c are installed"


# --- the four steps, as they installed before ---------------------------------------------------


@pytest.fixture()
def through_inner(monkeypatch):
    """apt.installed as a step calls it, run at once: its commands, pyinfra's own arguments aside."""
    inner = apt.installed._inner

    def op(name=None, **kwargs):
        assert name, "every step names its operation"
        return list(inner(**kwargs))

    op._inner = inner
    monkeypatch.setattr(apt, "installed", op)


def _settings(repo: str | None):
    return SimpleNamespace(apt_repo=repo, apt_key_url=KEY if repo else None)


STEPS = {
    "earlyoom": (lambda repo: oomguard.installed(name="earlyoom installed", apt_repo=repo,
                                                 apt_key_url=KEY if repo else None),
                 f"{INSTALL} {CONFOLD} earlyoom", {"earlyoom": "/usr/bin/earlyoom"}, "earlyoom is installed"),
    "registry": (lambda repo: registry.installed(name="docker-registry and skopeo installed", apt_repo=repo,
                                                 apt_key_url=KEY if repo else None),
                 f"{INSTALL} {CONFOLD} --no-install-recommends docker-registry skopeo",
                 {"docker-registry": "/usr/bin/docker-registry", "skopeo": "/usr/bin/skopeo"},
                 "docker-registry and skopeo are installed"),
    "haproxy": (lambda repo: endpoint.haproxy_installed(_settings(repo), name="fleet endpoint: haproxy installed"),
                f"{INSTALL} {CONFOLD} --no-install-recommends haproxy", {"HAProxyInstalled": True},
                "haproxy is installed"),
}


@pytest.mark.parametrize("step", STEPS)
def test_each_archive_step_installs_as_it_did(step, recorded, through_inner):
    call, install, present, message = STEPS[step]
    assert call(REPO) == [*ARCHIVE_SOURCE, install]
    assert call(None) == ["apt-get update", install]
    assert recorded.noops == []
    recorded.present.update(present)
    assert call(REPO) == [] and call(None) == []
    assert recorded.noops == [message, message]


def test_the_toolkit_comes_from_nvidias_list_with_the_keyring_apt_allows(recorded):
    def toolkit(keyring, gpu_works=False):
        return list(container_runtime.toolkit_installed._inner(NVIDIA, f"{NVIDIA}/gpgkey", keyring, gpu_works))

    for keyring in (NVIDIA_APT_KEYRING, ARCHIVE_APT_KEYRING):  # the archive's when apt_repo is NVIDIA's URL
        assert toolkit(keyring) == [
            f"curl -fsSL --retry 3 '{NVIDIA}/gpgkey' -o {keyring}",
            f"echo 'deb [signed-by={keyring}] {NVIDIA} /' > /etc/apt/sources.list.d/nvidia-container-toolkit.list",
            "apt-get update -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/nvidia-container-toolkit.list "
            "-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0",
            f"{INSTALL} nvidia-container-toolkit",
        ]
    # Both programs, found by pyinfra's Which: installed.
    recorded.present.update({"nvidia-container-runtime-hook": "/usr/bin/nvidia-container-runtime-hook"})
    assert toolkit(NVIDIA_APT_KEYRING) != []
    recorded.present.update({"nvidia-ctk": "/usr/bin/nvidia-ctk"})
    assert toolkit(NVIDIA_APT_KEYRING) == [] and recorded.noops == ["nvidia-container-toolkit is installed"]
    # A GPU container works: nothing installed, nothing looked for.
    recorded.present.clear()
    assert toolkit(NVIDIA_APT_KEYRING, gpu_works=True) == []
    assert recorded.noops[-1] == "GPU containers work: nothing to install"


# --- planned by pyinfra, on a @fake host --------------------------------------------------------


def _planned(responses: dict, declare) -> list[str] | None:
    """The commands pyinfra plans for the operation ``declare()`` makes on a @fake host
    answering ``responses``; None when it plans none."""
    inventory = Inventory((["@fake/spark-1"], {"fake_responses": responses, "fake_delay": 0,
                                               "fake_delay_jitter": 0}))
    state = State(inventory, Config())
    with ctx_state.use(state):
        connect_all(state)
        target = inventory.get_host("@fake/spark-1")
        with ctx_host.use(target):
            meta = declare()
            if not meta.will_change:
                return None
            generate = state.get_op_data_for_host(target, meta._hash).command_generator
            return [command.get_raw_value() for command in generate()]


def _snapshot_programs(**programs) -> dict:
    return {"python3 -c": json.dumps({"programs": programs})}


def test_pyinfra_plans_the_install_only_where_a_program_is_missing():
    def earlyoom():
        return oomguard.installed(name="earlyoom installed", apt_repo=REPO, apt_key_url=KEY)

    assert _planned(_snapshot_programs(earlyoom=None), earlyoom) == [*ARCHIVE_SOURCE, f"{INSTALL} {CONFOLD} earlyoom"]
    assert _planned(_snapshot_programs(earlyoom="/usr/bin/earlyoom"), earlyoom) is None

    # A step's own way of looking (haproxy: its fact; the toolkit: pyinfra's Which) travels too.
    def haproxy():
        return endpoint.haproxy_installed(_settings(None), name="fleet endpoint: haproxy installed")

    assert _planned({"command -v haproxy": "no"}, haproxy)[0] == "apt-get update"
    assert _planned({"command -v haproxy": "yes"}, haproxy) is None

    def toolkit():
        return container_runtime.toolkit_installed(name="NVIDIA container toolkit installed", apt_repo=NVIDIA,
                                                   apt_key_url=f"{NVIDIA}/gpgkey", keyring=NVIDIA_APT_KEYRING,
                                                   gpu_works=False)

    found = {"command -v nvidia-container-runtime-hook": "/usr/bin/nvidia-container-runtime-hook",
             "command -v nvidia-ctk": "/usr/bin/nvidia-ctk"}
    assert _planned(found, toolkit) is None
    assert _planned({}, toolkit)[-1] == f"{INSTALL} nvidia-container-toolkit"
