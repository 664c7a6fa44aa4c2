"""The fleet endpoint: one OpenAI-compatible URL over every serving host.

HAProxy from the distribution's archives runs on one host of the inventory
(``fleet_endpoint``; resolved in fleet.chosen_endpoint) as the packaged ``haproxy.service``
(master-worker, ``systemctl reload`` is seamless). Its members are the inventory's serving
hosts, at the address each has on its route to the endpoint host (inventory names may be
SSH aliases only the controller resolves). Clients need the fleet API key (anything else
is answered 401 by HAProxy itself); HAProxy checks every member each second with a real
request carrying that key and routes leastconn over those that answer. Its Prometheus
exporter answers on ``endpoint_metrics_port`` with the same key.

Why HAProxy and not vllm-router: a static bearer-key ACL (vllm-router authenticates
clients only through an external validation URL), active HTTP checks that send headers,
drain / ready through the runtime API, the Prometheus exporter, seamless reloads in
master-worker mode, and it comes from the OS archives (no wheels on the hosts).

The runtime API, for a rollout (controller side, over SSH, sudo honoured)::

    ep = endpoint_host(state)           # the pyinfra Host serving the endpoint, or None
    members(ep)                         # {inventory name: Member(state, sessions, ...)}
    drain(ep, "spark-2", timeout_s=600) # no new requests; waits for in-flight ones
    ready(ep, "spark-2", timeout_s=30)  # back in rotation; True once its checks pass
"""

from __future__ import annotations

import hashlib
import io
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import gevent
import jinja2
from pyinfra import host, logger
from pyinfra.api import FactBase, FileUploadCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import Sha256File
from pyinfra.operations import systemd

from sparkfleet import apt, credentials, haproxy, remote
from sparkfleet.config import Settings
from sparkfleet.facts import RouteSource
from sparkfleet.fleet import all_pairs, all_settings, chosen_endpoint, reached_at, ssh_address

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATE = PROJECT / "templates" / "haproxy.cfg.j2"
UNIT = haproxy.UNIT
CONFIG = "/etc/haproxy/haproxy.cfg"
MARKER = "The sparkfleet fleet endpoint"

# --- facts ------------------------------------------------------------------------------


class HAProxyInstalled(FactBase[bool]):
    """Whether haproxy is installed."""

    @staticmethod
    def default():
        return False

    def command(self) -> str:
        return "command -v haproxy >/dev/null 2>&1 || test -x /usr/sbin/haproxy && echo yes || echo no"

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


class OurConfig(FactBase["dict[str, str]"]):
    """The members (server name -> address:port) of sparkfleet's HAProxy config here; None
    when the host's HAProxy config is not sparkfleet's."""

    def command(self) -> str:
        return (f"if grep -qs {shlex.quote(MARKER)} {CONFIG}; then echo ours; "
                f"sed -n 's/^ *server \\([^ ]*\\) \\([^ ]*\\).*/\\1 \\2/p' {CONFIG}; fi")

    def process(self, output):
        if not output or output[0].strip() != "ours":
            return None
        return dict(line.split(None, 1) for line in output[1:] if len(line.split()) == 2)


# --- the configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One member as HAProxy reaches it."""

    name: str  # inventory name
    server: str  # name in HAProxy
    address: str
    port: int


def render(settings: Settings, members: list[Target], key: str | None) -> str:
    """The HAProxy configuration (templates/haproxy.cfg.j2)."""
    template = jinja2.Template(TEMPLATE.read_text(), keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return template.render(
        admin_socket=haproxy.ADMIN_SOCKET, state_file=haproxy.STATE_FILE, timeout_s=settings.endpoint_timeout_s,
        port=settings.endpoint_port, metrics_port=settings.endpoint_metrics_port, key=key,
        model_regex=re.escape(settings.served_model_name),
        members=[{"server": m.server, "address": f"[{m.address}]" if ":" in m.address else m.address, "port": m.port}
                 for m in members],
    )


def _targets(settings: Settings) -> list[Target]:
    """Every serving host of the inventory (of a pair, its head), at the address it has on
    its route to this host.

    A host that cannot be asked (unreachable now) keeps the address it has in the current
    configuration: an unreachable host does not change the membership.
    """
    state = host.state
    every = all_settings()
    pairs = all_pairs()
    own = ssh_address(host)
    current = host.get_fact(OurConfig) or {}
    targets = []
    for member in state.inventory:
        ms = every.get(member.name)
        if ms is None or not ms.serving:
            continue
        if member.name in pairs and not pairs[member.name].is_head:  # its pair is one member: the head
            continue
        server = haproxy.server_name(member.name)
        address = None
        if member is host:
            address = own
        elif own and member in state.activated_hosts and member not in state.failed_hosts:
            try:
                address = member.get_fact(RouteSource, address=own) or None
            except Exception:  # noqa: BLE001 - an unreachable member keeps its address
                address = None
        if not address and server in current:
            address = current[server].rsplit(":", 1)[0].strip("[]")
        address = address or reached_at(member)
        if ms.served_model_name != settings.served_model_name:
            logger.warning(f"{member.name}: serves `{ms.served_model_name}`, the fleet endpoint checks for "
                           f"`{settings.served_model_name}`: it stays out of rotation")
        targets.append(Target(member.name, server, address, ms.port))
    return targets


# --- operations -------------------------------------------------------------------------


def haproxy_installed(settings: Settings, **op_args):
    """
    An operation: haproxy installed from the distribution's archives when it is missing.

    + settings: validated settings (``apt_repo``/``apt_key_url``: a repository
      to take it from; None: the host's own archives, Debian/Ubuntu main)
    """
    # Our haproxy.cfg replaces the package's; keep it on upgrades.
    return apt.installed(packages=["haproxy"], apt_repo=settings.apt_repo, apt_key_url=settings.apt_key_url,
                         keep_config=True, no_recommends=True, which=_haproxy_at, **op_args)


def _haproxy_at(_program: str) -> bool:
    return host.get_fact(HAProxyInstalled)


@operation()
def config_written(text: str):
    """
    Write the HAProxy configuration, root:haproxy 0640, only once HAProxy accepts it.

    + text: the rendered configuration (it holds the API key: compared by hash, never shown)
    """
    if host.get_fact(Sha256File, path=CONFIG) == hashlib.sha256(text.encode()).hexdigest():
        return
    new = f"{CONFIG}.sparkfleet-new"
    yield f"install -m 0640 -o root -g haproxy /dev/null {new}"
    yield FileUploadCommand(io.BytesIO(text.encode()), new)
    # A configuration HAProxy refuses never replaces the running one.
    yield StringCommand(
        "sh", "-c",
        shlex.quote(f"chown root:haproxy {new} && chmod 0640 {new} && haproxy -c -q -f {new} && mv -f {new} {CONFIG} "
                    f"|| {{ rc=$?; rm -f {new}; echo 'haproxy refused the new configuration' >&2; exit $rc; }}"),
    )


@operation(is_idempotent=False)
def reloaded():
    """
    Reload HAProxy for its new configuration: the new worker takes the listening sockets,
    the old one finishes its requests (no connection is refused or cut). Admin states
    (drained members) are saved first and read back by the new worker.
    """
    yield StringCommand("sh", "-c", shlex.quote(haproxy.save_state_command()))
    yield "systemctl reload haproxy"


@operation(is_idempotent=False)
def announced(settings: Settings, members: list[Target], changed: bool):
    """
    Print the endpoint, how to call it, and its members' states.

    + settings: validated settings
    + members: the members of the configuration
    + changed: whether this run (re)configures or starts it: wait for each member's first check
    """
    if not changed:
        # Printed on every run (a noop's text shows only with -v): the user's way in.
        host.log(_hint(host, settings, members, _states_now(host)), logger.info)
        return
    yield remote.callback(_announce_after_checks, settings, members)


def _announce_after_checks(state, host, settings: Settings, members: list[Target]) -> bool:  # noqa: ARG001
    deadline = time.monotonic() + 15  # a member answers (rise 2: 2 s) or is marked down
    states: dict[str, haproxy.Member] = {}
    while time.monotonic() < deadline:
        try:
            states = haproxy.members_of(host)
        except OperationError:
            states = {}
        if states and all(m.checked for m in states.values()):
            break
        gevent.sleep(1)
    host.log(_hint(host, settings, members, states), logger.info)
    return True


def _states_now(target_host) -> dict[str, haproxy.Member]:
    try:
        return haproxy.members_of(target_host)
    except OperationError:
        return {}


def _hint(target_host, settings: Settings, members: list[Target], states: dict[str, haproxy.Member]) -> str:
    url = f"http://{reached_at(target_host)}:{settings.endpoint_port}"
    mode = settings.api_key.get_secret_value()
    auth = (f'-H "Authorization: Bearer $(cat {settings.api_key_file})" ' if mode == "auto"
            else '-H "Authorization: Bearer $API_KEY" ' if mode != "none" else "")
    key = (f'open("{settings.api_key_file}").read().strip()' if mode == "auto"
           else 'os.environ["API_KEY"]' if mode != "none" else '"none"')
    listing = ", ".join(
        f"{m.name} {m.address}:{m.port} {states[m.name].state if m.name in states else '?'}" for m in members
    )
    return (
        f"fleet endpoint {url}/v1 serves `{settings.served_model_name}` over {len(members)} member(s): {listing}\n"
        f"    curl {auth}{url}/v1/models\n"
        f'    openai.OpenAI(base_url="{url}/v1", api_key={key})\n'
        f"    metrics: curl {auth}http://{reached_at(target_host)}:{settings.endpoint_metrics_port}/metrics"
    )


# --- the state ------------------------------------------------------------------------------


def served(settings: Settings) -> None:
    """The fleet endpoint on the host ``fleet_endpoint`` names; stopped on a host that
    served it before; nothing elsewhere."""
    if endpoint_name(host.state) != host.name:
        if host.get_fact(OurConfig) is not None:
            systemd.service(name="former fleet endpoint: haproxy stopped", service=UNIT, running=False, enabled=False)
        return
    members = _targets(settings)
    haproxy_installed(name="fleet endpoint: haproxy installed", settings=settings)
    config = config_written(name="fleet endpoint: haproxy configuration",
                            text=render(settings, members, credentials.api_key(settings)))
    started = systemd.service(name="fleet endpoint: haproxy enabled and running", service=UNIT, running=True,
                              enabled=True)
    # Membership and settings change by a reload, never a restart.
    reloaded(name="fleet endpoint: haproxy reloaded for its new configuration", _if=config.did_change)
    announced(name="fleet endpoint", settings=settings, members=members,
              changed=config.will_change or started.will_change)


def endpoint_name(state, settings: dict[str, Settings] | None = None) -> str | None:
    """The inventory name of the fleet endpoint's host, or None (fleet_endpoint=none).

    + settings: every host's settings (default: this run's, validated once)
    """
    return chosen_endpoint(list(state.inventory), settings if settings is not None else all_settings())[0]


def endpoint_host(state, settings: dict[str, Settings] | None = None):
    """The pyinfra Host that serves the fleet endpoint, or None."""
    name = endpoint_name(state, settings)
    return state.inventory.get_host(name) if name else None


