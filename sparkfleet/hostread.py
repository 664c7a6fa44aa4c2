"""One read of a host, on the host: the program that reads every file, unit, tree and fact
the deploy declared (:mod:`sparkfleet.snapshot`), and the pyinfra fact that runs it.

The program is python3 (DGX OS has it) given the wanted items as JSON in argv; it prints
one JSON object. pyinfra's docker facts it answers from dockerd's Engine API in its own
process (what the docker CLI would print, without starting it), and a fact that is a
python3 program in its own interpreter; every other fact's shell command runs in one shell
for all of them.
"""

from __future__ import annotations

import json
import shlex
from urllib.parse import quote

from pyinfra.api import FactBase, StringCommand
from pyinfra.facts.docker import DockerContainer, DockerImage, DockerSystemInfo

_MISSING = "##PYINFRA_NOCMD##"  # pyinfra's marker for a missing required command
#: Listen: a socket unit's addresses ("[::]:8009 (Stream)"; a service has none).
UNIT_PROPERTIES = ("ActiveState", "SubState", "UnitFileState", "ExecMainStartTimestampMonotonic", "NRestarts",
                   "Listen")

#: Where the program asks dockerd (Docker's default socket, as on DGX OS).
DOCKER_SOCKET = "/var/run/docker.sock"
#: pyinfra's docker facts that the program asks the Docker Engine API for, in its own
#: process: the docker CLI prints the API's JSON, and each start of it costs a host ~30 ms
#: of CPU (7 of them were half a converged run's read). Per fact: its API path, and whether
#: the CLI prints a list (an inspect: [] when there is no such object; None: the answer's
#: body as it is, for a fact of ours).
_ENGINE = {DockerImage: lambda object_id: (f"/images/{quote(object_id, safe='/:@')}/json", True),
           DockerContainer: lambda object_id: (f"/containers/{quote(object_id, safe='/:@')}/json", True),
           DockerSystemInfo: lambda: ("/info", False)}


def engine_request(cls, args: dict) -> tuple[str, bool | None] | None:
    """(API path, printed as a list) for a fact the program asks dockerd for, or None: one of
    pyinfra's above, or one of ours that names it (``engine_path``, a fact without arguments)."""
    made = _ENGINE.get(cls)
    return made(**args) if made else getattr(cls, "engine_path", None)


#: Python source of the host programs (this reader, status', the facts that ask a server):
#: one HTTP/1.0 request (one answer, then the server closes) to a unix socket's path
#: (dockerd's) or a (host, port), over TLS when given the CA file to trust; ``http``
#: returns (status, headers lowercased, body), ``http_get`` (status, body). Asked in the
#: program's own process: a curl or docker CLI start costs a host more than the request.
HTTP_CLIENT = r"""
def http(where, path, headers=(), timeout=30, method="GET", cafile=None):
    import socket
    unix = isinstance(where, str)
    sock = socket.socket(socket.AF_UNIX) if unix else socket.create_connection(tuple(where), timeout=timeout)
    name = "docker" if unix else ("[%s]:%s" if ":" in where[0] else "%s:%s") % tuple(where)
    if cafile:
        import ssl
        sock = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=where[0])
    with sock:
        if unix:
            sock.settimeout(timeout)
            sock.connect(where)
        asked = "%s %s HTTP/1.0\r\nHost: %s\r\n%s\r\n" % (method, path, name, "".join(h + "\r\n" for h in headers))
        sock.sendall(asked.encode())
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    said = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), said, body
def http_get(where, path, headers=(), timeout=30):
    status, _, body = http(where, path, headers, timeout)
    return status, body
"""

#: Runs on the host with the wanted paths and units as JSON in argv; prints one JSON object.
_READER = HTTP_CLIENT + r"""
import hashlib, json, os, subprocess, sys
want = json.loads(sys.argv[1])
def owner(st):
    import grp, pwd
    try:
        return pwd.getpwuid(st.st_uid).pw_name + ":" + grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        return "%d:%d" % (st.st_uid, st.st_gid)
def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
out = {"files": {}, "texts": {}, "trees": {}, "units": {}, "programs": {}, "sizes": {}, "facts": {},
       "cpus": os.cpu_count()}
# The facts' shell commands in one sh, each in a subshell and followed by a mark line with
# its exit status (a last line without its newline gets the mark appended).
mark = "##sparkfleet-" + os.urandom(8).hex()
def shell(facts):
    script = "".join("(\n%s\n)\nprintf '%s %d %%d\\n' $?\n" % (command, mark, i) for i, (_, command) in enumerate(facts))
    ran = subprocess.run(["sh", "-c", script], capture_output=True, text=True) if facts else None
    lines = []
    for line in ran.stdout.splitlines() if ran else []:
        at = line.find(mark + " ")
        if at < 0:
            lines.append(line)
            continue
        lines += [line[:at]] if at else []
        i, rc = map(int, line[at + len(mark) + 1:].split())
        out["facts"][facts[i][0]] = lines if rc == 0 else None
        lines = []
# The shell's facts before dockerd's: a container whose process the shell saw (a port's
# holder) was started before it, so it is still there when dockerd is asked after.
shell([(key, command) for key, command in want["facts"].items() if key not in want["engine"]
       and key not in want["python"]])
def python(program, args):
    # A fact that is `python3 -c PROGRAM ARGS`, in this interpreter: its stdout, None if it failed.
    import contextlib, io
    printed, argv, rc = io.StringIO(), sys.argv, 0
    sys.argv = ["-c", *args]
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(program, "<fact>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except Exception:
        rc = 1
    finally:
        sys.argv = argv
    return printed.getvalue().splitlines() if rc == 0 else None
for key, (program, *args) in want["python"].items():
    out["facts"][key] = python(program, args)
unanswered = []
for key, asked in want["engine"].items():
    try:
        status, body = http_get(want["docker_socket"], asked[0])
        if status == 200 and asked[1] is None:
            out["facts"][key] = body.decode(errors="replace").splitlines()
            continue
        if status == 200 or (status == 404 and asked[1]):
            doc = json.loads(body) if status == 200 else None
            out["facts"][key] = json.dumps(([doc] if doc else []) if asked[1] else doc).splitlines()
            continue
    except (OSError, ValueError, IndexError):
        pass  # no daemon here: the command's own answer
    unanswered.append((key, want["facts"][key]))
shell(unanswered)
for p in want["sizes"]:
    du = subprocess.run(["du", "-sb", p], capture_output=True, text=True).stdout.split()
    out["sizes"][p] = int(du[0]) if du and du[0].isdigit() else 0
import shutil
for name in want["programs"]:
    out["programs"][name] = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin")
for p in want["files"]:
    try:
        st = os.stat(p)
        out["files"][p] = [st.st_mode & 0o7777, owner(st), "directory" if os.path.isdir(p) else sha(p)]
    except OSError:
        out["files"][p] = None
for p in want["texts"]:
    try:
        with open(p, errors="replace") as f:
            out["texts"][p] = f.read(65536)
    except OSError:
        out["texts"][p] = None
for root in want["trees"]:
    lines = []
    if os.path.isdir(root):
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for name in dirs + [f for f in files if not f.endswith(".pyc")]:
                p = os.path.join(d, name)
                st = os.lstat(p)
                rel = os.path.relpath(p, root)
                kind = "d" if os.path.isdir(p) else "f"
                lines.append("%s %s %o %s %s" % (rel, kind, st.st_mode & 0o7777, owner(st), "-" if kind == "d" else sha(p)))
        lines.sort(key=lambda line: line.split(" ", 1)[0].encode())
        out["trees"][root] = hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()
    else:
        out["trees"][root] = ""
if want["units"]:
    props = ",".join(["Id"] + want["props"])
    shown = subprocess.run(["systemctl", "show", "-p", props, "--"] + want["units"],
                           capture_output=True, text=True).stdout
    for block in shown.strip().split("\n\n"):
        values = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if values.get("Id") in want["units"]:
            out["units"][values["Id"]] = values
print(json.dumps(out))
"""


class HostState(FactBase["dict"]):
    """The files (mode, owner, sha256; None when missing), small text files, directory
    trees (manifest hash, as :func:`sparkfleet.snapshot.manifest_hash` makes it), systemd
    units (their :data:`UNIT_PROPERTIES`), programs, sizes and facts' answers that ``want``
    (JSON) names, in one command."""

    @staticmethod
    def default():
        return {"files": {}, "texts": {}, "trees": {}, "units": {}, "programs": {}, "sizes": {}, "facts": {},
                "cpus": None}

    def command(self, want: str) -> StringCommand:
        return StringCommand(*map(shlex.quote, self.argv(want)))

    @staticmethod
    def argv(want: str) -> list[str]:
        """The command as argv, for a command that runs it inside its own (the sudo check)."""
        return ["python3", "-c", _READER, want]

    def process(self, output):
        try:  # a host that answers otherwise (pyinfra's @fake connector): every key asked alone
            return json.loads("\n".join(output))
        except ValueError:
            return self.default()
