"""`sparkfleet status <inventory>`: the fleet at a glance.

One table, per host: profile, image digest, model revision, the serving unit's state and
uptime, READY (the API lists the served model with the fleet key), endpoint membership,
and from the engine's ``/metrics`` the requests running and waiting, KV-cache use and the
mean acceptance length since the engine started; then what needs a look (a reboot since
the last deploy with the boot before's last kernel and GPU errors, the watchdog's events,
stack drift, the alerts that fire) and the fleet endpoint's state.
``--json`` prints the same as one JSON document.

It reads over SSH through pyinfra's API with the inventory's own connection data and
group data (sudo users included: every read goes through facts or the hosts' connector
arguments), in parallel, and changes nothing. Exit status 1 when a host cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import gevent
from prometheus_client.parser import text_string_to_metric_families

from sparkfleet import endpoint, haproxy, monitor, oplock, remote, stack
from sparkfleet.config import ConfigError, Settings
from sparkfleet.facts import BootReport, rebooted
from sparkfleet.fleet import reached_at, validate_fleet
from sparkfleet.hostpaths import (
    AGENT_ANSWER,
    AUTH_HEADER,
    CONTAINER,
    LAST_GOOD_DIR,
    LINK_CHECK,
    OPERATOR_LOCK,
    SERVE_ENV,
    STARTED_FILE,
    UNIT,
    WATCHDOG_LOG,
    digest_of,
)
from sparkfleet.hostread import DOCKER_SOCKET, HTTP_CLIENT
from sparkfleet.pairs import fleet_pairs

METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache",
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}


class InventoryError(Exception):
    """The inventory cannot be read: the message names the file and the fix."""


def _testbed_fix(path: Path) -> str:
    """How to get a missing testbed file back: the testbed writes hosts.json and, for
    instance N, the inventory beside it (``.testbed/instance-N/``)."""
    instance = next((part.removeprefix("instance-") for part in path.parts if part.startswith("instance-")), "")
    env = f"SPARKFLEET_TESTBED_INSTANCE={instance} " if instance.isdigit() else ""
    return f"boot the simulated fleet with `{env}sparkfleet testbed up`, which writes it"


def inventory_problem(inventory_path: str) -> str | None:
    """Why ``inventory_path`` names no inventory file, or None. pyinfra takes a name that is
    no file for a host name, and a path then fails its DNS lookup with a UnicodeError."""
    path = Path(inventory_path)
    if path.is_file() or not (inventory_path.endswith(".py") or os.sep in inventory_path):
        return None  # a file, or a host list such as spark-01,spark-02
    fix = (_testbed_fix(path) if ".testbed" in path.parts
           else "give the path of an inventory file, e.g. inventory/sparks.py")
    return f"inventory {inventory_path} does not exist: {fix}"


def _read_inventory(inventory_path: str, data: dict[str, Any]):
    from pyinfra_cli.exceptions import UnexpectedExternalError
    from pyinfra_cli.inventory import make_inventory

    try:
        return make_inventory(inventory_path, override_data=data, cwd=os.getcwd())
    except UnexpectedExternalError as exc:  # the inventory file raised: say what it was missing
        error = exc.exception
        missing = Path(error.filename) if isinstance(error, FileNotFoundError) and error.filename else None
        if missing is None:
            raise InventoryError(f"inventory {inventory_path} failed: {type(error).__name__}: {error}") from None
        fix = (_testbed_fix(missing) if missing.name == "hosts.json"
               else f"create it, or fix {inventory_path}")
        raise InventoryError(f"inventory {inventory_path} reads {missing}, which does not exist: {fix}") from None


def connect(inventory_path: str, data: dict[str, Any] | None = None):
    """A connected pyinfra State for ``inventory_path`` (group_data/ of the current
    directory, as `pyinfra` itself reads it) and every host's validated settings."""
    from pyinfra.api import Config, State
    from pyinfra.api.connect import connect_all
    from pyinfra.api.exceptions import PyinfraError
    from pyinfra.context import ctx_state

    problem = inventory_problem(inventory_path)
    if problem:
        raise InventoryError(problem)
    state = State()
    ctx_state.set(state)  # the inventory file is executed in a state's context, as by pyinfra
    inventory = _read_inventory(inventory_path, data or {})
    state.init(inventory, Config())
    settings = validate_fleet(state.inventory)
    try:
        connect_all(state)
    except PyinfraError:
        if state.active_hosts:
            raise
        # pyinfra gives up when no host answers; the table says so, host by host.
    return state, settings


def opened(program: str, inventory_path: str, data: dict[str, Any] | None = None):
    """:func:`connect` for a command: a bad inventory or data exits 2 with the reason; the
    command's own lines say which host is unreachable, not pyinfra's log."""
    import logging

    logging.getLogger("pyinfra").setLevel(logging.ERROR)
    try:
        return connect(inventory_path, data)
    except InventoryError as exc:
        print(f"{program}: {exc}", file=sys.stderr)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
    raise SystemExit(2)


# --- one host -------------------------------------------------------------------------------


def _alerts_at(s: Settings) -> tuple[str, int]:
    """Where the monitor host itself reaches Prometheus' web (it listens on
    ``monitor_bind_address``: loopback unless the operator opened it)."""
    bound = s.monitor_bind_address
    return ("127.0.0.1" if bound in ("0.0.0.0", "::") else bound), s.monitor_port


def alerts_url(s: Settings) -> str:
    """Prometheus' alerts API as the monitor host itself reaches it."""
    address, port = _alerts_at(s)
    return f"http://{f'[{address}]' if ':' in address else address}:{port}/api/v1/alerts"


def parse_alerts(text: str) -> list[dict[str, Any]] | None:
    """The alerts that fire, from Prometheus' ``/api/v1/alerts`` answer (None: no answer)."""
    try:
        answer = json.loads(text)
        alerts = answer["data"]["alerts"] if answer.get("status") == "success" else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(alerts, list):
        return None
    firing = []
    for alert in alerts:
        if not isinstance(alert, dict) or alert.get("state") != "firing":
            continue
        labels, notes = alert.get("labels") or {}, alert.get("annotations") or {}
        firing.append({"name": labels.get("alertname", "?"), "host": labels.get("host") or labels.get("server"),
                       "severity": labels.get("severity"), "since": alert.get("activeAt"),
                       "summary": notes.get("summary", "")})
    return sorted(firing, key=lambda a: (a["name"], a["host"] or ""))


#: Runs on the host (as root: dockerd's socket, the 0600 key) with its paths and settings
#: as JSON in argv; prints every section of the host's row, "== name" then its lines. One
#: python3 asks dockerd and the engine itself and reads the files: the shell pipeline it
#: replaces started ~30 programs (docker, curl, sed...), ~110 ms of a host's CPU per status.
_PROGRAM = HTTP_CLIENT + r"""
import glob, json, os, re, subprocess, sys
a = json.loads(sys.argv[1])
def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None
def say(section, lines=()):
    print("== " + section)
    for line in lines:
        print(line)
def ours(lines):
    return [line for line in lines if re.match("(SF|HF)_", line)]
def body(where, path, headers=()):
    try:
        status, text = http_get(where, path, headers, timeout=5)
        return text.decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return ""
# What runs is what the container was started with (its environment and the image reference
# it was started by, pinned by digest as the deploy runs it; its id, for any other), not
# serve.env, which a stopped rollout or a change to come may have rewritten since.
env, image = [], ""
try:
    status, text = http_get(a["docker_socket"], "/containers/%s/json" % a["container"])
    doc = json.loads(text) if status == 200 else {}
    config = doc.get("Config") or {}
    if any(e.startswith("SF_PORT=") for e in config.get("Env") or []):
        env, image = config["Env"], "%s %s" % (config.get("Image") or "", doc.get("Image") or "")
except (OSError, ValueError, IndexError, AttributeError):
    pass
disk = (read(a["serve_env"]) or "").splitlines()
env = env or disk
# The API at the port the engine runs on, with the key of its start: the last good copy when
# it started on the last good settings.
auth = a["auth"]
started = (read(a["started"]) or "").rstrip("\n")
good = os.path.join(a["last_good"], "api-auth.header")
if started and started == (read(os.path.join(a["last_good"], "serving.rev")) or "").rstrip("\n") \
        and os.path.isfile(good):
    auth = good
headers = [line for line in (read(auth) or "").splitlines() if line.strip()]
setting = dict(line.split("=", 1) for line in env if "=" in line)
bind = setting.get("SF_HOST", "")
addr = "127.0.0.1" if bind in ("", "0.0.0.0") or bind.startswith("127.") else "::1" if bind in ("::", "::1") else bind
api = (addr, int(setting["SF_PORT"])) if setting.get("SF_PORT", "").isdigit() else None
try:
    shown = subprocess.run(["systemctl", "show", a["unit"], "-p", "ActiveState", "-p", "SubState", "-p",
                            "ActiveEnterTimestampMonotonic", "-p", "NRestarts"], capture_output=True, text=True)
    say("unit", shown.stdout.splitlines())
except OSError:
    say("unit")
say("uptime", [(read("/proc/uptime") or "0").split()[0]])
say("env", ours(env))
say("on disk", [] if ours(env) == ours(disk) else
    [line for line in disk if line.startswith("SF_PROFILE=")] or ["changed"])
say("image", [image])
first = image.split(" ")[0]
if image.strip() and "@sha256:" not in first and ":sha256-" not in first:
    try:
        status, text = http_get(a["docker_socket"], "/images/%s/json" % image.split(" ")[-1])
        print("\n".join(json.loads(text).get("RepoDigests") or []) if status == 200 else "")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
say("models", [body(api, "/v1/models", headers) if api else ""])
say("metrics", [line for line in (body(api, "/metrics", headers) if api else "").splitlines()
                if re.match(a["metrics"], line)])
say("lock", [read(a["lock"]) or ""])
say("link", [read(a["link"]) or ""])
try:
    with open(a["watchdog_log"], "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
        last = f.read().decode(errors="replace").splitlines()[-1:]
except OSError:
    last = []
say("watchdog", last + [read(a["agent"]) or ""])
sys.stdout.flush()
subprocess.run(["sh", "-c", a["shell"]])
refs = sorted(glob.glob(os.path.join(glob.escape(a["hf_home"]), "hub", "models--*", "refs", "*")))
say("refs", ["%s %s" % (f, (read(f) or "").rstrip("\n")) for f in refs if os.path.isfile(f)])
if a["alerts"]:
    say("alerts", [body((a["alerts"][0], a["alerts"][1]), a["alerts"][2])])
"""


def _host_command(s: Settings, alerts: bool = False) -> str:
    """One command that prints every section of a host's row (``alerts``: the fleet monitor's
    host, which also prints the alerts Prometheus has): :data:`_PROGRAM` with its arguments.
    The stack's and the boot's sections are their facts' own shell commands."""
    args = {
        "docker_socket": DOCKER_SOCKET, "container": CONTAINER, "unit": UNIT, "serve_env": SERVE_ENV,
        "auth": AUTH_HEADER, "started": STARTED_FILE, "last_good": LAST_GOOD_DIR, "lock": OPERATOR_LOCK,
        "link": LINK_CHECK, "watchdog_log": WATCHDOG_LOG, "agent": AGENT_ANSWER, "hf_home": s.hf_home,
        "metrics": "(" + "|".join(re.escape(name) for name in METRICS) + ")",
        "shell": f"echo '== stack'; {stack.status_command(s)}; echo '== boot'; {BootReport().command()}",
        "alerts": [*_alerts_at(s), "/api/v1/alerts"] if alerts else None,
    }
    return f"python3 -c {shlex.quote(_PROGRAM)} {shlex.quote(json.dumps(args))}"


def _sections(lines: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("== "):
            current = line[3:].strip()
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def parse_host(lines: list[str], s: Settings) -> dict[str, Any]:
    """What one host's status command printed, as a row."""
    sec = _sections(lines)
    unit = dict(line.split("=", 1) for line in sec.get("unit", []) if "=" in line)
    env = dict(line.split("=", 1) for line in sec.get("env", []) if "=" in line and not line.startswith("#"))
    row: dict[str, Any] = {"unit": unit.get("ActiveState") or "unknown", "restarts": int(unit.get("NRestarts") or 0)}
    try:
        now = float((sec.get("uptime") or ["0"])[0])
        entered = int(unit.get("ActiveEnterTimestampMonotonic") or 0) / 1e6
        row["uptime_s"] = round(now - entered) if row["unit"] == "active" and entered else None
    except ValueError:
        row["uptime_s"] = None
    row["profile"] = env.get("SF_PROFILE")
    # Settings on disk the engine does not run yet (a rollout that stopped, a change to come).
    on_disk = dict(line.split("=", 1) for line in sec.get("on disk", []) if "=" in line)
    pending = on_disk.get("SF_PROFILE") or ("changed" if sec.get("on disk") else None)
    row["pending"] = "other settings" if pending in ("changed", row["profile"]) else pending
    # The reference the container was started by (pinned: the digest is in it), else the
    # image's digests as Docker lists them.
    image = [line.split()[0] for line in sec.get("image", []) if line.split()]
    row["image_digest"] = next((d for d in map(digest_of, image) if d), None)
    model, revision = env.get("SF_MODEL"), env.get("SF_REVISION") or None
    row["model"], row["revision"] = model, revision
    commit = revision if revision and re.fullmatch(r"[0-9a-f]{40}", revision) else None
    if model and revision and not commit:
        ref = f"/models--{model.replace('/', '--')}/refs/{revision}"
        commit = next((line.split()[-1] for line in sec.get("refs", []) if line.split()[0].endswith(ref)), None)
    row["commit"] = commit
    try:
        served = [m["id"] for m in json.loads("\n".join(sec.get("models", [])).strip() or "{}").get("data", [])]
    except (ValueError, AttributeError, TypeError, KeyError):
        served = []
    row["ready"] = (env.get("SF_SERVED_MODEL_NAME") or s.served_model_name) in served
    values: dict[str, float] = {}
    try:  # Prometheus' own parser, as the checks read /metrics; summed over label sets
        for family in text_string_to_metric_families("\n".join(sec.get("metrics", [])) + "\n"):
            for sample in family.samples:
                if sample.name in METRICS:
                    values[METRICS[sample.name]] = values.get(METRICS[sample.name], 0.0) + sample.value
    except ValueError:
        pass
    try:
        held = json.loads("\n".join(sec.get("lock", [])).strip() or "null")
    except ValueError:
        held = {"run": "?"}
    row["operator_lock"] = held or None
    try:  # a pair member's last link measurement (sparkfleet/link.py)
        link = json.loads("\n".join(sec.get("link", [])).strip() or "null")
    except ValueError:
        link = None
    row["link"] = link if isinstance(link, dict) else None  # a deploy in progress (sparkfleet/oplock.py), or one that died
    # The watchdog's last event (a wedge, memory pressure, back) and whether it keeps the
    # member out of the endpoint now (its agent-check answer).
    watch = [line.strip() for line in sec.get("watchdog", []) if line.strip()]
    row["agent"] = next((line for line in watch if line == "up" or line.startswith("down")), None)
    row["watchdog"] = next((line for line in watch if line != row["agent"]), None)
    row["running"] = int(values["running"]) if "running" in values else None
    row["waiting"] = int(values["waiting"]) if "waiting" in values else None
    row["kv_cache"] = values.get("kv_cache")
    drafts = values.get("drafts", 0.0)
    # Mean acceptance length = 1 + accepted / drafts (the token the target adds each step).
    row["acceptance_length"] = round(1 + values.get("accepted", 0.0) / drafts, 2) if drafts else None
    row.update(stack.status_of(sec.get("stack", []), s))
    boot = BootReport().process(sec.get("boot", []))
    # A boot the last deploy did not see: a reboot or a hard reset, with the last kernel and
    # GPU errors of the boot before (None: the same boot, or no deploy has seen one yet).
    row["rebooted"] = boot if rebooted(boot) else None
    if "alerts" in sec:
        row["alerts"] = parse_alerts("\n".join(sec["alerts"]).strip())
    return row


def _read_host(target, s: Settings, alerts: bool = False) -> dict[str, Any]:
    done = remote.run(target, _host_command(s, alerts), timeout=60)
    ok, lines = done.ok, done.stdout
    if not ok and not lines:
        return {"reachable": False}
    return {"reachable": True, **parse_host(lines, s)}


# --- the fleet --------------------------------------------------------------------------------


def collect(state, settings: dict[str, Settings]) -> dict[str, Any]:
    """Every host's row and the endpoint's state, read in parallel."""
    hosts = list(state.inventory)
    live = [h for h in hosts if h in state.active_hosts]
    watcher = monitor.monitor_name(state, settings)
    jobs = {h.name: gevent.spawn(_read_host, h, settings[h.name], h.name == watcher) for h in live}
    ep_name = endpoint.endpoint_name(state, settings)
    ep_host = state.inventory.get_host(ep_name) if ep_name else None
    ep: dict[str, Any] | None = None
    members: dict[str, haproxy.Member] = {}
    if ep_host is not None:
        ep = {"host": ep_name, "url": None, "reachable": ep_host in state.active_hosts}
        es = settings[ep_name]
        ep["url"] = f"http://{reached_at(ep_host)}:{es.endpoint_port}/v1"
        ep["metrics"] = f"http://{reached_at(ep_host)}:{es.endpoint_metrics_port}/metrics"
        if ep["reachable"]:
            try:
                stat = haproxy.show_stat(ep_host)
                members = haproxy.members_of(ep_host, stat)
                front = next((r for r in stat if r.get("pxname") == "fleet" and r.get("svname") == "FRONTEND"), {})
                ep.update(
                    state="running",
                    requests=int(front.get("req_tot") or 0),
                    in_flight=int(front.get("scur") or 0),
                    refused_401=int(front.get("hrsp_4xx") or 0),
                    errors_5xx=int(front.get("hrsp_5xx") or 0),
                    errors=sum(m.errors for m in members.values()),
                )
            except Exception as exc:  # noqa: BLE001 - a stopped endpoint is a state to show
                ep.update(state=f"not answering ({str(exc).splitlines()[0]})")
        ep["members"] = {
            name: {"state": m.state, "in_flight": m.sessions, "requests": m.requests, "errors": m.errors,
                   "check": m.check, "address": m.address}
            for name, m in members.items()
        }
    gevent.joinall(list(jobs.values()))
    pairs = fleet_pairs(hosts, settings)[0]
    rows = []
    for h in hosts:
        job = jobs.get(h.name)
        row = job.value if job is not None and job.successful() else {"reachable": False}
        row = {"host": h.name, **row}
        pair = pairs.get(h.name)
        if pair is not None:
            row["pair"] = f"{pair.group} rank {pair.rank}"
        if ep is not None:
            member = members.get(haproxy.server_name(h.name))
            headless = pair is not None and not pair.is_head
            row["endpoint"] = (member.state if member else "-" if settings[h.name].serving and not headless
                               else f"via {pair.head}" if headless else "not a member")
        rows.append(row)
    by_name = {r["host"]: r for r in rows}
    for name, pair in pairs.items():  # a headless member serves no API: READY is its pair's, at the head
        if not pair.is_head and by_name[name].get("reachable"):
            by_name[name]["ready"] = bool(by_name[pair.head].get("ready"))
    mon = None
    if watcher is not None:
        ms = settings[watcher]
        mon = {"host": watcher, "prometheus": f"{ms.monitor_bind_address}:{ms.monitor_port}",
               "alerts": by_name[watcher].pop("alerts", None)}
    return {"hosts": rows, "endpoint": ep, "monitor": mon}


def _uptime(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def table(doc: dict[str, Any]) -> str:
    """The human-readable table."""
    head = ["host", "pair", "profile", "image", "revision", "unit", "uptime", "READY", "endpoint",
            "running", "waiting", "KV cache", "accept len"]
    lines = []
    for r in doc["hosts"]:
        if not r.get("reachable"):
            lines.append([r["host"], r.get("pair", "-"), "unreachable"] + ["-"] * (len(head) - 3))
            continue
        rev = r.get("revision") or "-"
        if r.get("commit") and r["commit"] != rev:
            rev = f"{rev}@{r['commit'][:10]}"
        elif r.get("commit"):
            rev = r["commit"][:12]
        lines.append([
            r["host"], r.get("pair", "-"),
            (r.get("profile") or "-") + (f" (on disk: {r['pending']})" if r.get("pending") else ""),
            (r["image_digest"] or "-")[:19] if r.get("image_digest") else "-",
            rev, r["unit"], _uptime(r.get("uptime_s")), "yes" if r.get("ready") else "no",
            r.get("endpoint", "-"),
            "-" if r.get("running") is None else str(r["running"]),
            "-" if r.get("waiting") is None else str(r["waiting"]),
            "-" if r.get("kv_cache") is None else f"{100 * r['kv_cache']:.0f}%",
            "-" if r.get("acceptance_length") is None else f"{r['acceptance_length']:.2f}",
        ])
    if not any("pair" in r for r in doc["hosts"]):  # no pairs in this fleet: no pair column
        head, lines = [head[0], *head[2:]], [[line[0], *line[2:]] for line in lines]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *lines]]
    for r in doc["hosts"]:
        link = r.get("link")
        if link and link.get("rank") == 0:  # one line per pair, from its head
            figure = (f"{'RoCE' if link.get('transport') == 'IB' else link.get('transport') or '?'} "
                      f"{link.get('busbw_gbs', 0):.1f} GB/s (floor {link.get('floor_gbs', 0):g})")
            out.append(f"\n{link.get('pair', r['host'])}: link {figure}, measured {link.get('checked_at', '?')}"
                       + ("" if link.get("ok") else f" — FAILED: {link.get('problem')}"))
    locks = {}
    for r in doc["hosts"]:
        if r.get("operator_lock"):
            locks.setdefault(json.dumps(r["operator_lock"], sort_keys=True), []).append(r["host"])
    for record, names in locks.items():
        holder = oplock.Holder.of(json.loads(record))
        out.append(f"\ndeploy lock on {', '.join(names)}: held by {holder.describe(time.time())} — a deploy runs; "
                   f"if it no longer does: {oplock.unlock_command()}")
    for r in doc["hosts"]:
        if r.get("watchdog") or (r.get("agent") or "up") != "up":
            agent = r.get("agent") or "up"
            held = f" — out of rotation: {agent.partition('#')[2] or 'down'}" if agent != "up" else ""
            out.append(f"\nwatchdog on {r['host']}: {r.get('watchdog') or '-'}{held}")
    for r in doc["hosts"]:
        boot = r.get("rebooted")
        if boot:
            out.append(f"\n{r['host']}: {rebooted(boot)}")
            out.extend(f"    {line}" for line in boot["errors"])
    stacks: dict[str, list[str]] = {}  # one line per stack, not per host: 32 Sparks mostly share one
    for r in doc["hosts"]:
        if r.get("reachable") and (r.get("stack") or r.get("stack_drift")):
            versions = ", ".join(f"{p} {v['version']}" for p, v in r["stack"].items())
            if r.get("kernel"):
                pinned = " (GRUB pinned to it: an upgrade was undone)" if r.get("kernel_pinned") else ""
                versions += f"; kernel {r['kernel']} runs{pinned}"
            said = (versions or "-") + (f" — DRIFT: {'; '.join(r['stack_drift'])}" if r.get("stack_drift") else ", held")
            stacks.setdefault(said, []).append(r["host"])
    reachable = [r["host"] for r in doc["hosts"] if r.get("reachable")]
    for said, names in stacks.items():
        who = f"every host ({len(names)})" if len(names) > 1 and names == reachable else ", ".join(names)
        out.append(f"\nstack on {who}: {said}")
    mon = doc.get("monitor")
    if mon is not None:
        alerts = mon.get("alerts")
        said = ("not answering" if alerts is None else
                f"{len(alerts)} alert{'s' if len(alerts) != 1 else ''} firing" if alerts else "no alert firing")
        out.append(f"\nfleet monitor on {mon['host']} (Prometheus {mon['prometheus']}): {said}")
        for a in alerts or []:
            out.append(f"    {a['name']} {a['host'] or '-'} ({a['severity'] or '-'}, since {a['since'] or '?'}): "
                       f"{a['summary']}")
    ep = doc.get("endpoint")
    if ep is None:
        out.append("\nfleet endpoint: none (fleet_endpoint=none, or no inventory group `endpoint`)")
    else:
        up = sum(1 for m in ep.get("members", {}).values() if m["state"] == "UP")
        out.append(f"\nfleet endpoint {ep['url']} on {ep['host']}: {ep.get('state', 'unreachable')}, "
                   f"{up}/{len(ep.get('members', {}))} members in rotation")
        if "requests" in ep:
            out.append(f"    requests {ep['requests']}, in flight {ep['in_flight']}, refused (401/4xx) "
                       f"{ep['refused_401']}, 5xx {ep['errors_5xx']}, member errors {ep['errors']}; "
                       f"metrics {ep['metrics']}")
        out.extend(_members(ep.get("members", {})))
    return "\n".join(out)


def _members(members: dict[str, dict[str, Any]]) -> list[str]:
    """The endpoint's members: a line for each that needs a look (out of rotation, errors,
    a check that failed), one for all the others: 32 Sparks mostly say the same."""
    def quiet(m):
        return m["state"] == "UP" and not m["errors"] and m["check"] == "L7OK"

    out = [f"    {name} {m['address']}: {m['state']}, in flight {m['in_flight']}, requests {m['requests']}, "
           f"errors {m['errors']}, last check {m['check'] or '-'}" for name, m in members.items() if not quiet(m)]
    rest = [m for m in members.values() if quiet(m)]
    if rest:
        low, high = min(m["requests"] for m in rest), max(m["requests"] for m in rest)
        who = f"every member ({len(rest)})" if len(rest) == len(members) else f"the other {len(rest)}"
        out.append(f"    {who}: UP, last check L7OK, no errors, requests {low if low == high else f'{low}-{high}'} each")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkfleet status", description=__doc__.split("\n\n")[0])
    parser.add_argument("inventory", help="a pyinfra inventory, e.g. inventory/sparks.py")
    parser.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                        help="override data as with pyinfra --data (e.g. fleet_endpoint=spark-01)")
    parser.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    args = parser.parse_args(argv)
    from pyinfra_cli.util import parse_cli_arg

    data = {}
    for item in args.data:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--data {item!r}: use KEY=VALUE")
        data[key] = parse_cli_arg(value)
    state, settings = opened("sparkfleet status", args.inventory, data)
    doc = collect(state, settings)
    try:
        print(json.dumps(doc, indent=2) if args.json else table(doc), flush=True)
    except BrokenPipeError:  # `sparkfleet status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
    return 0 if all(r.get("reachable") for r in doc["hosts"]) else 1
