"""What crossed the WAN and the LAN: printed once the download steps ended on every host.

Measured, not assumed: bytes a host received are its HF cache's growth (weights) and the
mirror registry's access log for its address (image); bytes from upstream are the
mirror's own view: what the copy tool read (image) and the growth of the HF mirror's
cache (weights, which olah stores as fetched). A host that received more weights than
the HF mirror holds took them past it (hf_xet goes to the Xet CAS, past HF_ENDPOINT):
that is printed as such, never as "from the mirror". Nothing is printed when nothing
was fetched.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass, field

from pyinfra import host, logger
from pyinfra.api.state import BaseStateCallback

from sparkfleet import remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.fleet import host_mirror
from sparkfleet.hostpaths import REGISTRY_UNIT, mirror_hf_cache
from sparkfleet.mirrors import Mirror
from sparkfleet.perrun import once

MIB = 1024**2
#: The steps the report times, in the order it prints them.
STEPS = ("mirror", "image", "weights")


@dataclass
class _HostRecord:
    mirror: Mirror | None = None
    image_op: object = None
    weights_op: object = None
    repo_dirs: list[str] = field(default_factory=list)
    repo_bytes_before: int = 0
    address: str = ""


class MirrorReport(BaseStateCallback):
    """Prints, once the download steps ended on every host, what each host received and
    from where, what the fleet took from upstream, and how long the steps took."""

    def __init__(self) -> None:
        self.hosts: dict[str, _HostRecord] = {}
        self.mirrors: dict[str, Mirror | None] = {}
        self.tracked: set[str] = set()
        self.steps: dict[str, str] = {}  # op hash -> step (mirror, image, weights)
        self.step_start: dict[str, float] = {}
        self.step_seconds: dict[str, float] = {}
        self.ended: set[str] = set()
        self.started: float | None = None
        self.finished: float | None = None
        self.wall_start: float | None = None
        self.copy: dict | None = None
        self.hf_cache_before: int | None = None
        self.mirror_dir: str | None = None
        self.root: str | None = None  # the fleet's mirror (relays copy from it, not from upstream)

    def track(self, step: str, *ops) -> None:
        for op in ops:
            if op is not None:
                self.tracked.add(op._hash)
                self.steps[op._hash] = step

    def operation_start(self, state, op_hash):  # pyinfra callback
        if op_hash not in self.tracked:
            return
        self.step_start[op_hash] = time.monotonic()
        if self.started is None:
            self.started = time.monotonic()
            self.wall_start = time.time()

    def operation_end(self, state, op_hash):
        if op_hash not in self.tracked:
            return
        step = self.steps[op_hash]
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + time.monotonic() - self.step_start.get(
            op_hash, time.monotonic()
        )
        self.ended.add(op_hash)
        if self.ended >= self.tracked:
            self.finished = time.monotonic()
            try:
                self.print(state)
            except Exception as exc:  # noqa: BLE001 - a report must never fail a deploy
                logger.warning(f"mirror report: {exc}")

    # --- measuring ---------------------------------------------------------------------

    def _fetched(self, record: _HostRecord, which: str) -> bool:
        op = getattr(record, which)
        return bool(op is not None and op.did_change())

    def print(self, state) -> None:
        names = [n for n, r in self.hosts.items()
                 if self._fetched(r, "image_op") or self._fetched(r, "weights_op")]
        if not names:
            return
        inventory = {h.name: h for h in state.inventory}
        mirrors = {r.mirror.host for r in self.hosts.values() if r.mirror}
        # By mirror and client: two pairs' links may use the same addresses.
        registry_bytes: dict[tuple[str, str], int] = {}
        for mirror in mirrors:
            if mirror in inventory:
                for client, sent in _registry_bytes_by_client(inventory[mirror], self.wall_start).items():
                    registry_bytes[(mirror, client)] = sent
        lines: list[str] = []
        totals = {"image_mirror": 0, "weights_mirror": 0, "weights_direct": 0, "direct_image_hosts": 0,
                  "weights_past": 0}
        # What the HF mirror holds now: no host can have received more through it.
        holds = {m: _dir_bytes(inventory[m], [mirror_hf_cache(self.mirror_dir)])
                 for m in mirrors if m in inventory and self.mirror_dir}
        for name in names:
            record = self.hosts[name]
            parts = []
            weights = 0
            if self._fetched(record, "weights_op") and name in inventory:
                weights = max(0, _dir_bytes(inventory[name], record.repo_dirs) - record.repo_bytes_before)
            if record.mirror:
                client = _client_address(inventory[name], record.mirror.address) if name in inventory else ""
                image = registry_bytes.get((record.mirror.host, client), 0)
                held = holds.get(record.mirror.host)
                past = max(0, weights - held - MIB) if held is not None else 0
                totals["image_mirror"] += image
                totals["weights_mirror"] += weights - past
                totals["weights_past"] += past
                if self._fetched(record, "image_op"):
                    parts.append(f"image {_mib(image)} from the mirror")
                if self._fetched(record, "weights_op"):
                    parts.append(f"weights {_mib(weights - past)} from the mirror")
                if past:
                    parts.append(f"weights {_mib(past)} NOT through the mirror (more than it holds: Xet?)")
            else:
                totals["weights_direct"] += weights
                if self._fetched(record, "image_op"):
                    totals["direct_image_hosts"] += 1
                    parts.append("image pulled from upstream")
                if self._fetched(record, "weights_op"):
                    parts.append(f"weights {_mib(weights)} from upstream")
            lines.append(f"    [{name}] " + ", ".join(parts))
        upstream: list[str] = []
        if mirrors:
            mirror = self.root or sorted(mirrors)[0]
            if self.copy is not None:
                upstream.append(f"image {_mib(self.copy.get('upstream_bytes', 0))} (copied once into the mirror registry)")
            if self.hf_cache_before is not None and mirror in inventory and self.mirror_dir:
                grown = _dir_bytes(inventory[mirror], [mirror_hf_cache(self.mirror_dir)]) - self.hf_cache_before
                upstream.append(f"weights {_mib(max(0, grown))} (into the HF mirror's cache)")
        if totals["weights_past"]:
            upstream.append(f"weights {_mib(totals['weights_past'])} past the mirror (hf_xet? see HF_HUB_DISABLE_XET)")
        if totals["weights_direct"]:
            upstream.append(f"weights {_mib(totals['weights_direct'])} downloaded directly")
        if totals["direct_image_hosts"]:
            upstream.append(f"image pulled directly by {totals['direct_image_hosts']} host(s)")
        took = (self.finished or time.monotonic()) - (self.started or time.monotonic())
        where = ", ".join(sorted(f"{m} ({self.hosts[m].address or m})" for m in mirrors if m in self.hosts)) or "none"
        logger.info(
            "\n--> Downloads (mirror: " + where + ")\n" + "\n".join(lines) + "\n"
            f"    fleet: from upstream: {', '.join(upstream) or 'nothing'}"
            + (f"; from the mirror: image {_mib(totals['image_mirror'])}, weights {_mib(totals['weights_mirror'])}"
               if mirrors else "") + "\n"
            f"    download steps took {took:.1f} s: "
            + ", ".join(f"{step} {self.step_seconds[step]:.1f} s" for step in STEPS if step in self.step_seconds)
            + "\n"
        )


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= 0.1 * MIB or n == 0 else f"{n} B"


def _dir_bytes(target_host, paths: list[str]) -> int:
    if not paths:
        return 0
    quoted = " ".join(shlex.quote(p) for p in paths)
    done = remote.run(target_host, f"du -sbc {quoted} 2>/dev/null | tail -n 1 | cut -f1")
    line = done.stdout[-1].strip() if done.ok and done.stdout else ""
    return int(line) if line.isdigit() else 0


def _client_address(target_host, mirror_address: str) -> str:
    """The address ``target_host`` reaches the mirror from (what the registry logs)."""
    q = shlex.quote(mirror_address)
    done = remote.run(
        target_host,
        f"a=$(getent ahostsv4 {q} | awk 'NR==1{{print $1}}'); "
        "ip -o route get \"${a:-" + q + "}\" 2>/dev/null | sed -n 's/.* src \\([^ ]*\\).*/\\1/p'",
    )
    return done.stdout[0].strip() if done.ok and done.stdout else ""


_ACCESS = re.compile(r'^(\S+) - \S+ \[[^\]]*\] "GET /v2/\S+/blobs/sha256:[0-9a-f]+ [^"]*" 2\d\d (\d+)')


def _registry_bytes_by_client(mirror_host, since: float | None) -> dict[str, int]:
    """Blob bytes the mirror registry sent per client address since ``since`` (its access log)."""
    if since is None:
        return {}
    done = remote.run(mirror_host, f"journalctl -u {REGISTRY_UNIT} --since @{int(since) - 1} -o cat --no-pager 2>/dev/null")
    sent: dict[str, int] = {}
    for line in done.stdout if done.ok else []:
        m = _ACCESS.match(line)
        if m:
            sent[m.group(1)] = sent.get(m.group(1), 0) + int(m.group(2))
    return sent


def report_of(state) -> MirrorReport:
    """The run's report (one per pyinfra state, in the fleet's per-run store), registered
    with it on first use."""
    def registered() -> MirrorReport:
        report = MirrorReport()
        state.add_callback_handler(report)
        return report

    return once("mirror report", registered, state)


def track(settings: Settings, mirror_ops: list, image_op, weights_op, repo_dirs: list[str]) -> None:
    """Register this host's download operations with the run's report."""
    mirror = host_mirror()
    rep = report_of(host.state)
    rep.track("mirror", *mirror_ops)
    rep.track("image", image_op)
    rep.track("weights", weights_op)
    record = _HostRecord(mirror=mirror, image_op=image_op, weights_op=weights_op, repo_dirs=repo_dirs,
                         address=mirror.address if mirror and mirror.is_self else "")
    if repo_dirs and weights_op is not None and weights_op.will_change:
        record.repo_bytes_before = sum(snapshot.size(p) for p in repo_dirs)
    rep.hosts[host.name] = record
    rep.mirrors[host.name] = mirror
    if mirror and mirror.is_self and not mirror.upstream:  # the fleet's mirror: what crossed the WAN
        rep.root = host.name
        rep.mirror_dir = settings.mirror_dir
        rep.hf_cache_before = snapshot.size(mirror_hf_cache(settings.mirror_dir))
