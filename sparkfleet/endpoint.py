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

The configuration says what each member runs (its address, port, served name and API
key): one backend per key (clients are routed by theirs; more than one only while a key
change rolls through the fleet), each member checked with its own key. A rolling change
moves a member's entry in its turn (:func:`follows`); the runtime API client the rollout
drains and readies members with is sparkfleet/haproxy.py.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
import gevent.lock
import jinja2
from pyinfra import host, logger
from pyinfra.api import FactBase, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import Sha256File
from pyinfra.operations import systemd

from sparkfleet import apt, credentials, haproxy, remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.fleet import all_pairs, all_settings, chosen_endpoint, reached_at, source_toward, ssh_address
from sparkfleet.perrun import once

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


# Every host is asked (a former endpoint stops its HAProxy): with its first read.
snapshot.expect_first(facts=[(OurConfig, {})])


# --- the configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One member as HAProxy reaches it, with what it serves."""

    name: str  # inventory name
    server: str  # name in HAProxy
    address: str
    port: int
    model: str = ""  # the served model name
    key: str | None = field(default=None, repr=False)  # the API key it runs (a secret: never shown)


def key_id(key: str | None) -> str:
    """A key's short name in the configuration (its backend and ACL)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8] if key else ""


def backend_of(key: str | None) -> str:
    return f"{haproxy.BACKEND}_{key_id(key)}" if key else haproxy.BACKEND


def render(settings: Settings, members: list[Target], key: str | None, models: frozenset[str] = frozenset()) -> str:
    """The HAProxy configuration (templates/haproxy.cfg.j2): one backend per API key the
    members run, the fleet's own (``key``) first, each checked with its key for the
    fleet's served model name (and ``models``: the names members still run while a new
    name rolls; a member that serves another name is out of rotation)."""
    template = jinja2.Template(TEMPLATE.read_text(), keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    keys = list(dict.fromkeys([key, *(m.key for m in members)]))
    names = sorted({settings.served_model_name, *models})
    groups = []
    for k in keys:
        own = [m for m in members if m.key == k]
        groups.append({
            "key": k, "id": key_id(k), "backend": backend_of(k),
            "model_regex": "|".join(re.escape(name) for name in names),
            "members": [{"server": m.server, "address": f"[{m.address}]" if ":" in m.address else m.address,
                         "port": m.port, "model": m.model or settings.served_model_name} for m in own],
        })
    return template.render(
        admin_socket=haproxy.ADMIN_SOCKET, state_file=haproxy.STATE_FILE, timeout_s=settings.endpoint_timeout_s,
        port=settings.endpoint_port, metrics_port=settings.endpoint_metrics_port, key=key,
        agent_port=settings.watchdog_agent_port,
        keyed=any(k for k in keys), any_key=" || ".join(f"key_{g['id']}" for g in groups if g["key"]),
        groups=groups,
    )


def running_members(text: str, names: dict[str, str]) -> dict[str, Target]:
    """The members a configuration of ours holds, by server name, with the key each is
    checked with: what they ran when it was written.

    + names: server name -> inventory name
    """
    found: dict[str, Target] = {}
    key = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("backend "):
            key = None
        if said := re.search(r'hdr Authorization "Bearer ([^"]*)"', line):
            key = said.group(1)
        if server := re.match(r"server (\S+) (\[[^\]]+\]|[^\s:\[]+):(\d+)(?:\s+#\s*serves (\S+))?", line):
            name, address, port, model = server.groups()
            address = address.strip("[]")
            found[name] = Target(names.get(name, name), name, address, int(port), model or "", key)
    return found


def _targets(settings: Settings) -> list[Target]:
    """Every serving host of the inventory (of a pair, its head), at the address it has on
    its route to this host, as the deploy declares it.

    A host that cannot be asked (unreachable now) keeps the address it has in the current
    configuration: an unreachable host does not change the membership.
    """
    state = host.state
    every = all_settings()
    pairs = all_pairs()
    own = ssh_address(host)
    current = snapshot.fact(OurConfig) or {}
    targets = []
    for member in state.inventory:
        ms = every.get(member.name)
        if ms is None or not ms.serving:
            continue
        if member.name in pairs and not pairs[member.name].is_head:  # its pair is one member: the head
            continue
        server = haproxy.server_name(member.name)
        address = None
        bound = ipaddress.ip_address(ms.bind_address)
        if not (bound.is_unspecified or bound.is_loopback):  # the engine listens there only
            address = ms.bind_address
        elif member is host:
            address = own
        elif own and member in state.activated_hosts and member not in state.failed_hosts:
            try:
                address = source_toward(member, own) or None
            except Exception:  # noqa: BLE001 - an unreachable member keeps its address
                address = None
        if not address and server in current:
            address = current[server].rsplit(":", 1)[0].strip("[]")
        address = address or reached_at(member)
        if ms.served_model_name != settings.served_model_name:
            logger.warning(f"{member.name}: serves `{ms.served_model_name}`, the fleet endpoint checks for "
                           f"`{settings.served_model_name}`: it stays out of rotation")
        targets.append(Target(member.name, server, address, ms.port, ms.served_model_name, credentials.api_key(ms)))
    return targets


def declared(state) -> dict[str, Target]:
    """This run's declared members, by inventory name (planned on the endpoint host)."""
    return once("endpoint members", dict, state)


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
def config_written(settings: Settings, members: list[Target], key: str | None):
    """
    HAProxy's configuration for what the members run, reloaded when it changed.

    + settings: validated settings
    + members: the members as this run declares them
    + key: the fleet's API key (the configuration holds it: compared by hash, never shown)

    Written when the deploy executes, from what each member runs by then: a member this
    run failed keeps its entry as it is (its old key and port), one that never had an
    entry is left out.
    """
    if host.get_fact(Sha256File, path=CONFIG) == hashlib.sha256(render(settings, members, key).encode()).hexdigest():
        return
    yield remote.callback(_configured, settings, members, key)


def _configured(state, host, settings: Settings, members: list[Target], key: str | None) -> bool:  # pyinfra's
    current = _current(host)
    running = running_members(current, {m.server: m.name for m in members})
    targets = []
    for member in members:
        if _ran(state, state.inventory.get_host(member.name)):
            targets.append(member)
        elif member.server in running:
            targets.append(running[member.server])
    apply(host, settings, targets, key, current)
    return True


def _ran(state, member_host) -> bool:
    """Whether ``member_host`` took part in this run and got through it so far."""
    return member_host in state.activated_hosts and member_host not in state.failed_hosts


def _current(ep) -> str:
    """The configuration on the endpoint host ('' before the first)."""
    done = remote.run(ep, f"cat {CONFIG} 2>/dev/null || true")
    return "\n".join(done.stdout) + "\n" if done.stdout else ""


def apply(ep, settings: Settings, members: list[Target], key: str | None, current: str | None = None,
          models: frozenset[str] = frozenset()) -> list[str]:
    """Make the endpoint host's configuration serve ``members``: written only once HAProxy
    accepts it, then a reload that keeps the admin states (drains) of the members that did
    not move. Returns the members that moved (address, port or key), [] when nothing changed."""
    current = _current(ep) if current is None else current
    text = render(settings, members, key, models)
    if text == current:
        return []
    before = running_members(current, {})
    after = running_members(text, {})
    moved = [t.name for s, t in after.items() if s in before and
             (before[s].address, before[s].port, before[s].key) != (t.address, t.port, t.key)]
    new = f"{CONFIG}.sparkfleet-new"
    remote.put(ep, text.encode(), new, mode="0640", owner="root:haproxy")
    # A configuration HAProxy refuses never replaces the running one.
    checked = remote.run(ep, f"haproxy -c -q -f {new} && mv -f {new} {CONFIG}")
    if not checked.ok:
        remote.run(ep, f"rm -f {new}")
        raise OperationError(f"haproxy refused the new configuration: {' '.join(checked.stdout + checked.stderr)}")
    # Seamless: the new worker takes the sockets, the old one finishes its requests.
    reload = remote.run(ep, f"if systemctl is-active -q {UNIT}; then {haproxy.save_state_command(tuple(moved))}; "
                            f"systemctl reload {UNIT}; fi")
    if not reload.ok:
        raise OperationError(f"systemctl reload {UNIT} failed: {' '.join(reload.stderr)}")
    return moved


def follows(state, member_host) -> None:
    """The endpoint's entry for ``member_host`` moves to what it runs now (its address,
    port, key and model), in its turn: after its gate, before it is put back in rotation.
    The other members keep theirs."""
    ep = endpoint_host(state)
    target = declared(state).get(member_host.name)
    if ep is None or target is None:
        return
    with once("endpoint writer", gevent.lock.Semaphore, state):  # one writer of the configuration at a time
        current = _current(ep)
        names = {t.server: t.name for t in declared(state).values()}
        running = running_members(current, names)
        if running.get(target.server) == target:
            return
        members = [target if server == target.server else t for server, t in running.items()]
        if target.server not in running:
            members.append(target)
        ep_settings = all_settings()[ep.name]
        # A new served name rolls too: the names the members still run stay accepted until the end.
        moved = apply(ep, ep_settings, members, credentials.api_key(ep_settings), current,
                      frozenset(m.model for m in members if m.model))
        if moved:
            member_host.log("the fleet endpoint now reaches it as it runs (address, port, key)", logger.info)


@operation(is_idempotent=False)
def announced(settings: Settings, members: list[Target], changed: bool):
    """
    Print the endpoint, how to call it, and its members' states; put back a member an
    earlier run drained and never put back (a turn cut off with its controller).

    + settings: validated settings
    + members: the members of the configuration
    + changed: whether this run (re)configures or starts it: wait for each member's checks
    """
    states = _states_now(host)
    drained = sorted(name for name, m in states.items() if m.state == "DRAIN")
    if not changed and not drained:
        # Printed on every run (a noop's text shows only with -v): the user's way in.
        host.log(_hint(host, settings, members, states), logger.info)
        return
    yield remote.callback(_settled, settings, members, drained)


def _settled(state, host, settings: Settings, members: list[Target], drained: list[str]) -> bool:
    by_server = {m.server: m for m in members}
    for server in drained:
        member = by_server.get(server)
        if member is None or not _ran(state, state.inventory.get_host(member.name)):
            continue  # not this run's to judge: left as it is
        haproxy.set_state(host, member.name, "ready")
        host.log(f"{member.name}: put back in rotation — an earlier run drained it and never ended its turn",
                 logger.warning)
    expected = [m for m in members if _ran(state, state.inventory.get_host(m.name))]
    deadline = time.monotonic() + 15  # a member answers (rise 2: 2 s) or is marked down (fall 2)
    states: dict[str, haproxy.Member] = {}
    while True:
        states = _states_now(host)
        late = [m for m in expected if not (m.server in states and states[m.server].in_rotation)]
        if not late or time.monotonic() > deadline:
            break
        gevent.sleep(1)
    host.log(_hint(host, settings, members, states), logger.info)
    if late:
        raise OperationError(
            "not in rotation: " + ", ".join(
                f"{m.name} ({states[m.server].state}, check {states[m.server].check or '?'})" if m.server in states
                else f"{m.name} (not a member)" for m in late)
            + " — the endpoint's checks of these hosts fail; `sparkfleet status` shows them")
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
        if snapshot.fact(OurConfig) is not None:
            systemd.service(name="former fleet endpoint: haproxy stopped", service=UNIT, running=False, enabled=False)
        return
    members = _targets(settings)
    haproxy_installed(name="fleet endpoint: haproxy installed", settings=settings)
    declared(host.state).update({m.name: m for m in members})  # for the rollout's turns (follows)
    # Membership and settings change by a reload, never a restart.
    config = config_written(name="fleet endpoint: haproxy configuration", settings=settings, members=members,
                            key=credentials.api_key(settings))
    started = systemd.service(name="fleet endpoint: haproxy enabled and running", service=UNIT, running=True,
                              enabled=True)
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


