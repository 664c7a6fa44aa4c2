"""One read of a host's state: the reader that runs on the host, run here on real files,
agrees with what the controller expects (no fleet)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkfleet import hostread, perrun, snapshot

ROOT = Path(__file__).resolve().parents[1]


def read(**want) -> dict:
    wanted = snapshot._Wanted(*(set(want.get(k, ())) for k in snapshot._KINDS if k != "facts"),
                              facts=dict(want.get("facts", {})))
    command = hostread.HostState().command(want=wanted.json())
    done = subprocess.run(["sh", "-c", str(command.get_raw_value())], capture_output=True, text=True, check=True,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    return hostread.HostState().process(done.stdout.splitlines())


@pytest.mark.skipif(os.geteuid() != 0, reason="the copy is owned by root, as on a host")
def test_a_copied_tree_reads_back_as_the_manifest_the_controller_expects(tmp_path):
    dest = tmp_path / "runtime"
    dest.mkdir(mode=0o755)
    with tarfile.open(fileobj=io.BytesIO(snapshot.tarball(ROOT / "runtime")), mode="r:gz") as tar:
        tar.extractall(dest)
    (dest / "patches" / "__pycache__").mkdir()  # what python leaves beside the copy is not compared
    (dest / "patches" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    expected = snapshot.manifest_hash(ROOT / "runtime")
    assert read(trees=[str(dest)])["trees"][str(dest)] == expected
    (dest / "serve.py").write_text("edited on the host\n")
    assert read(trees=[str(dest)])["trees"][str(dest)] != expected
    assert read(trees=[str(tmp_path / "missing")])["trees"][str(tmp_path / "missing")] == ""


def test_files_read_with_mode_owner_and_hash_and_missing_ones_as_none(tmp_path):
    kept = tmp_path / "serve.env"
    kept.write_text("A=1\n")
    kept.chmod(0o640)
    got = read(files=[str(kept), str(tmp_path / "gone")], texts=[str(kept)], programs=["sh", "no-such-program"])
    mode, owner, digest = got["files"][str(kept)]
    assert mode == 0o640 and ":" in owner
    assert digest == hashlib.sha256(b"A=1\n").hexdigest()
    assert got["files"][str(tmp_path / "gone")] is None
    assert got["texts"][str(kept)] == "A=1\n"
    assert got["programs"]["sh"] and got["programs"]["no-such-program"] is None


def test_a_directory_reads_as_one_and_sizes_as_du_counts_them(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o750)
    (tmp_path / "cache" / "blob").write_bytes(b"x" * 5000)
    got = read(files=[str(tmp_path / "cache")], sizes=[str(tmp_path / "cache"), str(tmp_path / "none")])
    assert got["files"][str(tmp_path / "cache")][0] == 0o750
    assert got["files"][str(tmp_path / "cache")][2] == "directory"
    du = subprocess.run(["du", "-sb", str(tmp_path / "cache")], capture_output=True, text=True).stdout.split()[0]
    assert got["sizes"][str(tmp_path / "cache")] == int(du) >= 5000
    assert got["sizes"][str(tmp_path / "none")] == 0 and got["cpus"] >= 1


def test_the_tarball_is_the_same_bytes_for_the_same_tree(monkeypatch):
    first = snapshot.tarball(ROOT / "runtime")
    later = __import__("time").time() + 3600
    monkeypatch.setattr("time.time", lambda: later)  # an hour on: gzip's header has no clock in it
    assert snapshot.tarball(ROOT / "runtime") == first


def test_the_want_list_is_json_a_fake_host_answers_empty():
    # The @fake connector answers unknown commands with nothing: the snapshot is then empty.
    assert hostread.HostState().process([]) == hostread.HostState.default()
    assert json.loads(snapshot._Wanted(files={"/b", "/a"}).json())["files"] == ["/a", "/b"]


def test_pyinfra_facts_are_read_in_the_batch_as_pyinfra_reads_them():
    from pyinfra.facts.server import Arch

    from sparkfleet.facts import Memory
    from sparkfleet.ports import Listeners

    entries = dict(snapshot._fact_entry(cls, kwargs) for cls, kwargs in
                   ((Arch, {}), (Memory, {}), (Listeners, {"ports": [1], "_sudo": True})))
    got = read(facts=entries)["facts"]
    arch, memory, holders = (got[key] for key in entries)
    assert Arch().process(arch) == os.uname().machine
    assert Memory().process(memory)["MemTotal"] > 0
    assert "_sudo" not in "".join(entries)  # pyinfra's own arguments are not the fact's
    assert holders is not None  # ss or its missing-command marker: never a failed command


def test_facts_every_host_is_asked_come_with_its_first_read(monkeypatch):
    from sparkfleet import endpoint
    from sparkfleet.mirror import facts, tls  # noqa: F401 - declares as it loads

    class Run:  # a pyinfra State, as the per-run store keys it
        pass

    monkeypatch.setattr(perrun, "current_state", Run)
    first = snapshot._wanted("spark-1").facts
    for cls in (endpoint.OurConfig, facts.MirrorTrust):
        key, command = snapshot._fact_entry(cls, {})
        assert first[key] == command
    assert read(facts=first)["facts"][snapshot._fact_entry(facts.MirrorTrust, {})[0]] == []  # no certs.d here


def test_a_hosts_later_reads_come_with_its_first_read_of_the_next_run(monkeypatch):
    """The steps declare much after the preflight's read: the first converged run after
    them reads each host once, and every value is still read from the host."""
    from pyinfra.context import ctx_host
    from pyinfra.facts.server import Arch
    from support.fleetdata import fake_state

    on_host = {"files": {"/a": [0o644, "root:root", "x"], "/b": None}, "texts": {"/t": "v2"}}

    def run() -> list[dict]:
        asked = []
        with fake_state(["@fake/spark-1"]) as state:
            target = state.inventory.get_host("@fake/spark-1")

            def get_fact(cls, want):
                asked.append(json.loads(want))
                got = json.loads(want)
                return {k: {name: on_host.get(k, {}).get(name, ["amd64"] if k == "facts" else None)
                            for name in got[k]} for k in snapshot._KINDS} | {"cpus": 2}

            monkeypatch.setattr(target, "get_fact", get_fact)
            with ctx_host.use(target):
                snapshot.expect(files=["/a"])
                assert snapshot.file_state("/a") == (0o644, "root:root", "x")  # the preflight's read
                snapshot.expect(files=["/b"], texts=["/t"], facts=[(Arch, {})])  # a later step's
                assert snapshot.file_state("/b") is None and snapshot.text("/t") == on_host["texts"]["/t"]
                assert snapshot.fact(Arch) == "amd64"
        return asked

    first = run()
    assert len(first) == 2 and "/t" in first[1]["texts"] and "/t" not in first[0]["texts"]
    on_host["texts"]["/t"] = "v3"  # what is read is the host's answer now, never the hint's
    second = run()
    [read] = second
    assert {"/a", "/b"} <= set(read["files"]) and "/t" in read["texts"] and "pyinfra.facts.server.Arch:{}" in read["facts"]
    on_host["texts"]["/t"] = "v4"
    assert len(run()) == 1


def test_a_hint_loses_what_a_run_did_not_ask_after_the_hosts_last_operation(monkeypatch):
    """A later read keeps what it asked for the next run's first read; a run that neither
    declares nor asks something any more (docker info once the image is there) drops it
    from the hint after the host's last operation; a hint with nothing stale is left as it was."""
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state

    name = "@fake/hint-drop"

    def run(later: bool) -> list[dict]:
        asked = []
        with fake_state([name]) as state:
            target = state.inventory.get_host(name)

            def get_fact(cls, want):
                asked.append(json.loads(want))
                got = json.loads(want)
                return {k: {n: None for n in got[k]} for k in snapshot._KINDS} | {"cpus": 2}

            monkeypatch.setattr(target, "get_fact", get_fact)
            with ctx_host.use(target):
                snapshot.expect(files=["/a", "/declared"])  # /declared: read, never asked
                snapshot.file_state("/a")
                if later:
                    snapshot.expect(texts=["/info"])  # a later step's, this run only
                    snapshot.text("/info")
            target.op_hash_order = ["op-1", "op-last"]
            hint = snapshot._hint_path(target)
            before = hint.read_text()
            snapshot._KeepHint.operation_host_success(state, target, "op-1")  # not its last: as it was
            assert hint.read_text() == before
            snapshot._KeepHint.operation_host_success(state, target, "op-last")
        return asked

    hint = snapshot._hint_path(SimpleNamespace(name=name, data={}))
    hint.unlink(missing_ok=True)
    assert len(run(later=True)) == 2  # the hint is kept by the later read
    first = run(later=False)  # the hint brings /info along; nobody asks it: dropped after the last op
    assert len(first) == 1 and "/info" in first[0]["texts"]
    assert "/info" not in json.loads(hint.read_text())["texts"]
    assert {"/a", "/declared"} <= set(json.loads(hint.read_text())["files"])  # what the run declared stays
    kept = hint.stat().st_mtime_ns
    again = run(later=False)
    assert len(again) == 1 and "/info" not in again[0]["texts"]
    assert hint.stat().st_mtime_ns == kept  # nothing stale: not written again


def test_after_a_change_what_was_asked_already_is_read_again_only_when_asked_again(monkeypatch):
    """A change drops the host's snapshot; the next read takes what is asked now and what
    nobody asked yet, not the answers earlier operations have used (a first deploy read
    every fact ~30 times)."""
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state

    ours = {"/a", "/b", "/c"}
    reads = []
    with fake_state(["@fake/snapshot-drop"]) as state:
        target = state.inventory.get_host("@fake/snapshot-drop")

        def get_fact(cls, want):
            got = json.loads(want)
            reads.append(sorted(ours & set(got["files"])))
            return {k: {name: None for name in got[k]} for k in snapshot._KINDS} | {"cpus": 2}

        monkeypatch.setattr(target, "get_fact", get_fact)
        with ctx_host.use(target):
            snapshot.expect(files=sorted(ours))
            assert snapshot.file_state("/a") is None
            snapshot._drop(target.name)  # what _Forget does after a change
            snapshot.file_state("/b")  # /b, and /c that nobody asked yet
            snapshot.file_state("/a")  # asked again: read again
            snapshot.file_state("/c")  # read with /b
    assert reads == [["/a", "/b", "/c"], ["/b", "/c"], ["/a"]]


def test_the_first_read_after_a_change_takes_facts_and_units_only_as_asked(monkeypatch):
    """A first deploy changes a host at nearly every step: a read right after a change takes
    the pending files, not the pending facts, units and trees (each a program or a server),
    which the next change would drop unused; a second read before another change takes them all."""
    from pyinfra.context import ctx_host
    from pyinfra.facts.server import Arch, Hostname
    from support.fleetdata import fake_state

    arch, name = (snapshot._fact_entry(cls, {})[0] for cls in (Arch, Hostname))
    reads = []
    with fake_state(["@fake/snapshot-lean"]) as state:
        target = state.inventory.get_host("@fake/snapshot-lean")

        def get_fact(cls, want):
            got = json.loads(want)
            ours = {"/a", "/b", "u.service", "/t", arch, name}  # what other steps declare aside
            reads.append({k: sorted(ours & set(got[k])) for k in ("files", "units", "trees", "facts") if ours & set(got[k])})
            return {k: {n: (["x"] if k == "facts" else None) for n in got[k]} for k in snapshot._KINDS} | {"cpus": 2}

        monkeypatch.setattr(target, "get_fact", get_fact)
        with ctx_host.use(target):
            snapshot.expect(files=["/a", "/b"], units=["u.service"], trees=["/t"], facts=[(Arch, {}), (Hostname, {})])
            snapshot.file_state("/a")  # the first read: all of it
            snapshot._drop(target.name)
            snapshot.fact(Arch)  # right after a change: Arch, and the pending file
            snapshot._drop(target.name)
            snapshot.file_state("/b")  # the files alone
            snapshot.unit("u.service")  # a second read with no change between: every pending thing
            assert snapshot.fact(Hostname) == "x" and snapshot.tree_hash("/t") == ""  # read with the unit
    assert reads == [{"files": ["/a", "/b"], "units": ["u.service"], "trees": ["/t"], "facts": [arch, name]},
                     {"files": ["/b"], "facts": [arch]},
                     {"files": ["/b"]},
                     {"units": ["u.service"], "trees": ["/t"], "facts": [name]}]


def test_docker_facts_are_read_through_the_engine_api_as_the_cli_prints_them(tmp_path, monkeypatch):
    """pyinfra's docker facts, asked of a daemon's socket in the reader's own process, after
    the shell's facts (a port's holder seen in a container: that container is there when
    asked after): an inspect is a list ([] when there is none), the system info an object;
    without a daemon the fact's own command answers."""
    import http.server
    import socketserver
    import threading

    from pyinfra.facts.docker import DockerContainer, DockerImage, DockerSystemInfo

    from sparkfleet.facts import DockerAnswers

    image = {"Id": "sha256:" + "ab" * 32, "RepoDigests": ["r/x@sha256:" + "cd" * 32]}
    answers = {"/images/r/x:1@sha256:" + "cd" * 32 + "/json": image, "/info": {"DockerRootDir": "/var/lib/docker"},
               "/_ping": "OK"}
    asked = []
    order = tmp_path / "order"

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            with order.open("a") as f:
                f.write("engine\n")
            found = answers.get(self.path, {"message": "No such object"})
            body = (found if isinstance(found, str) else json.dumps(found)).encode()
            self.send_response(200 if self.path in answers else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        def get_request(self):
            request, _ = super().get_request()
            return request, ("local", 0)

    facts = [(DockerImage, {"object_id": "r/x:1@sha256:" + "cd" * 32}), (DockerImage, {"object_id": "r/none"}),
             (DockerContainer, {"object_id": "sparkfleet-serve"}), (DockerSystemInfo, {}), (DockerAnswers, {})]
    entries = dict(snapshot._fact_entry(cls, kwargs) for cls, kwargs in facts)
    monkeypatch.setattr(hostread, "DOCKER_SOCKET", str(tmp_path / "docker.sock"))
    with Server(hostread.DOCKER_SOCKET, Engine) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            got = read(facts={**entries, "shell": f"echo shell >> {order}"})["facts"]
        finally:
            server.shutdown()
    assert order.read_text().split() == ["shell"] + ["engine"] * 5
    found, none, container, info, server = (cls().process(got[key]) for (cls, _), key in zip(facts, entries))
    assert found == [image] and none == [] and container == []
    assert info == {"DockerRootDir": "/var/lib/docker"} and server is True
    assert len(asked) == 5 and "/containers/sparkfleet-serve/json" in asked and "/_ping" in asked

    # No daemon here: each fact's own command (docker missing: pyinfra's marker, its default).
    monkeypatch.setattr(hostread, "DOCKER_SOCKET", str(tmp_path / "gone.sock"))
    entries = dict(snapshot._fact_entry(cls, kwargs) for cls, kwargs in facts)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sh").symlink_to("/bin/sh")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # and python's: no docker CLI either
    got = read(facts=entries)["facts"]
    assert all(hostread._MISSING in got[key] for key in entries)


def test_the_facts_commands_answer_in_one_shell_as_each_would_alone():
    """Each command's lines and exit status, as its own ``sh -c`` gives them: a last line
    without its newline, no output, a failure (None, as pyinfra's failed fact), an exit."""
    commands = {"no newline": "printf 'x\\ny'", "fails": "echo out; exit 3", "nothing": "true",
                "last": "printf 'last'", "two": "echo one; echo; echo two", "stderr": "echo err >&2; echo kept",
                "cd": "cd /; pwd"}
    got = read(facts=commands)["facts"]
    for key, command in commands.items():
        alone = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        assert got[key] == (alone.stdout.splitlines() if alone.returncode == 0 else None), key
    assert got["no newline"] == ["x", "y"] and got["fails"] is None and got["nothing"] == []


def test_a_python3_fact_runs_in_the_readers_interpreter_and_answers_as_alone(tmp_path):
    """A fact that is ``python3 -c PROGRAM ARGS`` (no shell in it) costs no python3 start:
    the same lines as its own process gives, None when it fails, and a shell fact beside it."""
    from pyinfra.api import FactBase

    from sparkfleet.facts import CachedSnapshot, hostpaths

    class Program(FactBase):
        def command(self, code: str, arg: str = "x"):
            return f"python3 -c {shlex.quote(code)} {shlex.quote(arg)}"

    hf_home, repo, commit = str(tmp_path / "hf"), "acme/model", "a" * 40
    blob = Path(hostpaths.repo_cache_dir(hf_home, repo)) / "blobs" / "b1"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights")
    snap = Path(hostpaths.repo_cache_dir(hf_home, repo)) / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(blob)
    marker = Path(hostpaths.snapshot_marker(hf_home, repo, commit))
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(commit + "\n")
    (tmp_path / "hf" / "sparkfleet" / "verified").mkdir(parents=True)
    (tmp_path / "hf" / "sparkfleet" / "verified" / "b1").write_text("7")
    facts = [(CachedSnapshot, {"hf_home": hf_home, "repo_id": repo, "revision": commit}),
             (Program, {"code": "import __main__, sys; print('want' in dir(__main__), sys.argv[1:])", "arg": "a b"}),
             (Program, {"code": "import sys; print('partial'); sys.exit(3)"}),
             (Program, {"code": "raise ValueError"}),
             (Program, {"code": "import sys; print('done'); sys.exit()"})]
    entries = dict(snapshot._fact_entry(cls, kwargs) for cls, kwargs in facts)
    assert set(snapshot._PYTHON_PROGRAMS) >= set(entries)
    got = read(facts={**entries, "shell": "echo shell"})["facts"]
    cached, inside, fails, raises, done = (got[key] for key in entries)
    assert CachedSnapshot().process(cached) == commit
    assert inside == ["True ['a b']"]  # the reader's own __main__: no process of its own
    assert fails is None and raises is None and done == ["done"] and got["shell"] == ["shell"]
    alone = subprocess.run(["sh", "-c", entries[next(iter(entries))]], capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert alone.stdout.splitlines() == cached

    class Piped(FactBase):
        def command(self):
            return "python3 -c 'print(1)' || true"

    class Commented(FactBase):
        def command(self):
            return "python3 -c 'print(2)' # a comment of the shell's"

    for cls, answer in ((Piped, ["1"]), (Commented, ["2"])):  # anything of the shell's: the shell runs it
        key, command = snapshot._fact_entry(cls, {})
        assert key not in snapshot._PYTHON_PROGRAMS and read(facts={key: command})["facts"] == {key: answer}


def test_facts_that_ask_a_server_answer_in_the_readers_process_as_alone(tmp_path, monkeypatch):
    """The API's model list (with the key's header file), the mirror's answer (its registry over
    TLS with the CA the host trusts, its HF mirror at all) and a manifest's digest: python3
    programs the reader runs in its own process (no curl), answering as each does alone; a
    registry whose certificate the host does not trust, or a manifest it lacks, answers no."""
    import http.server
    import ssl
    import threading

    from sparkfleet import credentials, facts
    from sparkfleet.mirror import facts as mirror_facts
    from sparkfleet.mirrors import Mirror

    digest = "sha256:" + "ef" * 32
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, with_body: bool) -> None:
            asked.append((self.command, self.path, self.headers.get("Authorization"), self.headers.get("Accept")))
            body = {"/v1/models": b'{"data": [{"id": "served"}]}', "/v2/": b"{}", "/": b"hub"}.get(self.path)
            if self.path == "/v2/sparkfleet/serve/manifests/1":
                body = b"{}"
            self.send_response(200 if body is not None else 404)
            if body is not None and "manifests" in self.path:
                self.send_header("Docker-Content-Digest", digest)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            if with_body:
                self.wfile.write(body or b"")

        def do_GET(self):
            self.answer(True)

        def do_HEAD(self):
            self.answer(False)

        def log_message(self, *args):
            pass

    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    secure = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    mirror = Mirror("m", "127.0.0.1", plain.server_address[1], secure.server_address[1], False)
    cert, key = credentials.mirror_tls(str(tmp_path / "tls"), mirror)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    for server in (plain, secure):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    header = tmp_path / "api-auth.header"
    header.write_text("Authorization: Bearer k\n")
    monkeypatch.setattr(facts.hostpaths, "AUTH_HEADER", str(header))
    monkeypatch.setattr(mirror_facts.hostpaths, "REGISTRY_CERT", str(cert))
    registry = f"127.0.0.1:{secure.server_address[1]}"
    other, _ = credentials.mirror_tls(str(tmp_path / "other"), Mirror("o", "127.0.0.1", 1, 2, False))
    asking = [(facts.ServedModels, {"address": "127.0.0.1", "port": plain.server_address[1]}),
              (mirror_facts.MirrorAnswers, {"registry": registry, "hf_port": plain.server_address[1]}),
              (mirror_facts.RegistryManifest, {"url": f"https://{registry}", "path": "sparkfleet/serve",
                                               "reference": "1", "cacert": str(cert)}),
              (mirror_facts.RegistryManifest, {"url": f"https://{registry}", "path": "sparkfleet/serve",
                                               "reference": "2", "cacert": str(cert)}),
              (mirror_facts.RegistryManifest, {"url": f"https://{registry}", "path": "sparkfleet/serve",
                                               "reference": "1", "cacert": str(other)})]
    entries = dict(snapshot._fact_entry(cls, kwargs) for cls, kwargs in asking)
    try:
        assert set(snapshot._PYTHON_PROGRAMS) >= set(entries)
        got = read(facts=entries)["facts"]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        for key, command in entries.items():
            alone = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
            assert alone.returncode == 0 and alone.stdout.splitlines() == got[key], key
        monkeypatch.setattr(mirror_facts.hostpaths, "REGISTRY_CERT", str(other))
        monkeypatch.setattr(snapshot, "_COMMANDS", {})  # built again, from the patched path
        untrusted = read(facts=dict([snapshot._fact_entry(*asking[1])]))["facts"]
    finally:
        for server in (plain, secure):
            server.shutdown()
            server.server_close()
    answers = [cls().process(got[key]) for (cls, _), key in zip(asking, entries)]
    assert answers == [["served"], True, digest, None, None]
    assert mirror_facts.MirrorAnswers().process(next(iter(untrusted.values()))) is False
    assert ("GET", "/v1/models", "Bearer k", None) in asked
    assert ("HEAD", "/v2/sparkfleet/serve/manifests/1", None, facts.MANIFEST_ACCEPT) in asked


def test_the_sudo_check_carries_the_hosts_first_read(monkeypatch, tmp_path):
    """A converged run's host hashes its sudo password once: the check's own sudo runs the
    first read (what the steps declared as they loaded, and what the host's later reads
    asked last run), and the steps find it read. Nothing is read for a run whose steps
    declare nothing (the checks alone)."""
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state

    from sparkfleet import fleet, remote

    present = tmp_path / "present"
    present.write_text("x")
    name = "@fake/first-read"
    hint = snapshot._hint_path(SimpleNamespace(name=name, data={}))
    hint.parent.mkdir(parents=True, exist_ok=True)
    hint.write_text(json.dumps({"texts": [str(present)]}))  # a later read asked it last run
    checks: list[list[str] | None] = []

    def check_sudo(target, then=None):  # runs `then` as the check's sudo does, here
        checks.append(then)
        return subprocess.run(then, capture_output=True, text=True, check=True).stdout.splitlines() if then else None

    monkeypatch.setattr(remote, "check_sudo", check_sudo)
    monkeypatch.setattr(snapshot, "_FIRST", snapshot._Wanted(files={str(present)}))
    try:
        with fake_state([name]) as state:
            target = state.inventory.get_host(name)
            monkeypatch.setattr(target, "get_fact", lambda *a, **k: pytest.fail("a read of its own"))
            fleet.sudo_checked(target, state)
            with ctx_host.use(target):
                assert snapshot.file_state(str(present)) == (0o644, f"{present.owner()}:{present.group()}",
                                                              hashlib.sha256(b"x").hexdigest())
                assert snapshot.text(str(present)) == "x"
        [then] = checks
        assert then[:2] == ["python3", "-c"]

        monkeypatch.setattr(snapshot, "_FIRST", snapshot._Wanted())
        with fake_state([name]) as state:
            fleet.sudo_checked(state.inventory.get_host(name), state)
        assert checks[1] is None
    finally:
        hint.unlink(missing_ok=True)


def test_a_read_in_the_middle_of_planning_keeps_what_the_hint_named(monkeypatch):
    """A read after the first (a --dry run asks what a deploy does not) adds to the hint:
    what the hint named and the steps declare only later stays for the next run's first
    read (it was cut to what was declared so far, and the next converged run read each
    host three times)."""
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state

    name = "@fake/hint-middle"
    hint = snapshot._hint_path(SimpleNamespace(name=name, data={}))
    hint.parent.mkdir(parents=True, exist_ok=True)
    hint.write_text(json.dumps({"texts": ["/late"]}))  # a later step declares it, after the read below
    try:
        with fake_state([name]) as state:
            target = state.inventory.get_host(name)
            monkeypatch.setattr(target, "get_fact", lambda cls, want: {
                k: {n: None for n in json.loads(want)[k]} for k in snapshot._KINDS} | {"cpus": 2})
            with ctx_host.use(target):
                snapshot.expect(files=["/a"])
                snapshot.file_state("/a")  # the first read: /late with it
                snapshot.text("/dry-only")  # a second read, in the middle of planning
        kept = json.loads(hint.read_text())
        assert {"/late", "/dry-only"} <= set(kept["texts"]) and "/a" in kept["files"]
    finally:
        hint.unlink(missing_ok=True)


def test_a_fact_the_fleet_asks_of_a_host_comes_with_its_first_read_from_the_next_run(monkeypatch):
    """The fleet asks every host its routes while another host may be planning: asked
    alone the first time, kept in the host's hint after its last operation, and from the
    next run on answered by its first read (the sudo check's), with no command of its own."""
    from support.fleetdata import fake_state

    from sparkfleet.routes import RouteSources

    name = "@fake/fleet-asks"
    hint = snapshot._hint_path(SimpleNamespace(name=name, data={}))
    hint.unlink(missing_ok=True)
    key, _ = snapshot._fact_entry(RouteSources, {"addresses": ["10.0.0.1"]})
    alone: list[dict] = []

    def run(first_read: dict | None) -> dict:
        with fake_state([name]) as state:
            target = state.inventory.get_host(name)
            target.op_hash_order = ["op-last"]

            def get_fact(cls, **kwargs):
                alone.append(kwargs)
                return {"10.0.0.1": "10.0.0.9"}

            monkeypatch.setattr(target, "get_fact", get_fact)
            if first_read is not None:
                snapshot._took(target, snapshot._known(name, state), snapshot._Wanted(facts={key: ""}),
                               {"facts": first_read}, state)
            routes = snapshot.fact_of(target, RouteSources, state, addresses=["10.0.0.1"], _sudo=False)
            snapshot._KeepHint.operation_host_success(state, target, "op-last")
        return routes

    try:
        assert run(None) == {"10.0.0.1": "10.0.0.9"} and alone == [{"addresses": ["10.0.0.1"], "_sudo": False}]
        assert key in json.loads(hint.read_text())["facts"]  # the next run's first read asks it
        assert run({key: ["asked 10.0.0.1", "10.0.0.1 via 10.0.0.254 dev eth0 src 10.0.0.9 uid 0"]}) == {
            "10.0.0.1": "10.0.0.9"}
        assert len(alone) == 1
    finally:
        hint.unlink(missing_ok=True)


def test_two_fleets_hosts_of_one_name_keep_hints_of_their_own():
    """The test suite's fleets side by side, or two inventories of one checkout, name their
    hosts alike and reach them through an ssh_config (no ssh_hostname): each host's hint
    is its own, told apart by the address its connection reached."""

    def reached(address):
        transport = SimpleNamespace(getpeername=lambda: (address, 22))
        return SimpleNamespace(name="spark-1.local", data={},
                               connector=SimpleNamespace(client=SimpleNamespace(get_transport=lambda: transport)))

    one, other, again = reached("10.218.0.11"), reached("10.219.0.11"), reached("10.218.0.11")
    assert snapshot._hint_path(one) != snapshot._hint_path(other)
    assert snapshot._hint_path(one) == snapshot._hint_path(again)
    # Not connected (pyinfra's @fake connector, a host that did not answer): by name and ssh_hostname.
    unconnected = SimpleNamespace(name="spark-1.local", data={}, connector=SimpleNamespace(client=None))
    assert snapshot._hint_path(unconnected) == snapshot._hint_path(SimpleNamespace(name="spark-1.local", data={}))
