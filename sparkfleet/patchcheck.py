"""Runtime patches and the serving command checked against the image before the service (re)starts.

The serve wrapper edits the image's vLLM at every start (``runtime/patches``). A real
image's vLLM is upstream plus overlays and in-image edits, so a patch's anchor can be
missing there; at start that would make the wrapper exit and systemd restart it in a
loop. So before the unit is installed or restarted, the deploy runs the wrapper's check
mode (``python3 /host/serve.py --check``: the same patch programs, nothing written, no
GPU) inside the pinned image with the runtime copy at ``/host``, exactly as the unit
will. A patch that cannot apply fails this host's deploy, naming the patch, the file and
the fix; the running service is left as it is. The same run asks the image's vLLM
whether it accepts the command the wrapper will exec (runtime/vllm_cli.py): a flag it
does not know, a stray argument in ``extra_serve_args``, a parser name it has not
registered fail every host here, naming the setting and the fix, instead of putting
every host's new server in a crash loop.

The verdict is cached on the host per image (its content digest), patch plan, serving
argv and runtime programs, in ``/var/lib/sparkfleet/patch-verdicts/``: a converged run
reads it and runs no container.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

from pyinfra import host, logger
from pyinfra.api import FactBase, operation
from pyinfra.facts.docker import DockerImage

from runtime import serve_args
from sparkfleet import remote, snapshot
from sparkfleet.config import Settings
from sparkfleet.hostpaths import RUNTIME_DIR
from sparkfleet.mirror import local_image
from sparkfleet.pairs import PairMember

VERDICT_DIR = "/var/lib/sparkfleet/patch-verdicts"
CONTAINER = "sparkfleet-patch-check"
RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
# What decides a verdict besides the image and the command: the wrapper, the patch
# programs, the argument check and the middleware it imports.
_CHECKED_FILES = ("serve.py", "serve_args.py", "vllm_cli.py", "key_guard.py", "patches/*.py")
# What each serve.env variable's refusal asks the operator to do.
_FIXES = {
    "SF_TOOL_CALL_PARSER": "set tool_call_parser to a parser this vLLM knows (--data tool_call_parser=NAME; "
                           "empty turns tool calls off)",
    "SF_REASONING_PARSER": "set reasoning_parser to a parser this vLLM knows (--data reasoning_parser=NAME; "
                           "empty turns it off)",
    "SF_EXTRA_ARGS": "remove or correct that argument in extra_serve_args (`vllm serve --help=all` in the "
                     "image lists its flags)",
}


def plan_key(patches: str, argv: list[str]) -> str:
    """Names the verdict of ``patches`` (SF_PATCHES) and the serving ``argv`` as the
    controller's runtime/ checks them."""
    digest = hashlib.sha256(patches.encode() + b"\0" + json.dumps(argv).encode() + b"\0")
    for pattern in _CHECKED_FILES:
        for path in sorted(RUNTIME.glob(pattern)):
            digest.update(path.relative_to(RUNTIME).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _verdict_path(key: str) -> str:
    # The image's id is its config digest: the same image under any name or registry.
    return f'{VERDICT_DIR}/"${{id#sha256:}}"-{key}.json'


def _image_id(reference: str) -> str:
    return f"id=$(docker image inspect --format '{{{{.Id}}}}' {shlex.quote(reference)} 2>/dev/null)"


class CachedVerdicts(FactBase["dict[str, dict]"]):
    """The cached patch verdicts for plan ``key``, by the id of the image each was made in
    (hex, without ``sha256:``): which image ``reference`` names here is the docker fact's
    answer, read through the Engine API with the rest of the snapshot, not a docker CLI."""

    @staticmethod
    def default():
        return {}

    def command(self, key: str) -> str:
        suffix = f"-{key}.json"
        return (f'for f in {VERDICT_DIR}/*{suffix}; do [ -s "$f" ] || continue; n=${{f##*/}}; '
                f'echo "## ${{n%{suffix}}}"; cat "$f"; echo; done; true')

    def process(self, output):
        found, image, lines = {}, None, []
        for line in [*output, "## "]:
            if line.startswith("## "):
                try:
                    doc = json.loads("\n".join(lines)) if image else None
                except ValueError:
                    doc = None
                if isinstance(doc, dict) and "patches" in doc:
                    found[image] = doc
                image, lines = line[3:].strip(), []
            else:
                lines.append(line)
        return found


def summary(verdict: dict) -> str:
    words = {"would-apply": "applies", "already-present": "already present", "not-needed": "not needed"}
    return ", ".join(f"{p['name']} {words.get(p['verdict'], 'CANNOT APPLY')}" for p in verdict["patches"])


def args_problem(verdict: dict, reference: str) -> str | None:
    """What the image's vLLM refuses in the serving command: the setting and the fix."""
    found = verdict.get("args") or {}
    if found.get("ok", False):
        return None
    version = (verdict.get("vllm") or {}).get("version") or "unknown"
    said = f"vLLM {version} in {reference} refuses the serving command: {found.get('detail') or 'no answer'}"
    var = serve_args.VARS.get(found.get("var") or "")
    if var is None or not var.setting:  # no word of the command to trace it to: no key to name
        return (f"{said}. Fix: correct the setting the message names (extra_serve_args is passed verbatim), "
                "or pin an image whose vLLM accepts it (--data image=name@sha256:...)")
    fix = _FIXES.get(var.name) or (
        f"pin an image whose vLLM accepts it (--data image=name@sha256:...) or change {var.setting}")
    return f"{said} — key: {var.setting} ({var.name}). Fix: {fix}"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".") if p.isdigit())


def pair_problem(verdict: dict, reference: str, settings: Settings, member: PairMember | None,
                 argv: list[str]) -> str | None:
    """A pair member that would capture CUDA graphs across nodes on an image below the graph
    floor (vLLM #46253: capture aborts or hangs on GB10): the versions, the flag and the fix."""
    if member is None or "--enforce-eager" in argv:
        return None
    vllm = (verdict.get("vllm") or {}).get("version") or ""
    nccl = verdict.get("nccl") or ""
    floor = (settings.pair_graphs_min_vllm, settings.pair_graphs_min_nccl)
    if vllm and nccl and _version(vllm) >= _version(floor[0]) and _version(nccl) >= _version(floor[1]):
        return None
    return (f"{member.pair.group}: this member would serve without --enforce-eager (pair_enforce_eager=False), but "
            f"{reference} has vLLM {vllm or 'unknown'} with NCCL {nccl or 'unknown'}, below the cross-node CUDA "
            f"graph floor (vLLM {floor[0]} with its capture fix, NCCL {floor[1]}: pair_graphs_min_vllm, "
            "pair_graphs_min_nccl): graph capture across Sparks aborts or hangs (vLLM #46253). Fix: "
            "--data pair_enforce_eager=True (renders --enforce-eager), or pin an image at or above the floor")


def args_summary(verdict: dict) -> str:
    """What the check learnt of the serving command: accepted, or why it was not asked."""
    found = verdict.get("args") or {}
    if found.get("checked", True):
        return "vLLM accepts the command"
    return f"the serving command was {found.get('detail') or 'not checked'}"


def problems(verdict: dict, reference: str, patches: list[str]) -> list[str]:
    """One message per required patch that cannot apply (the patch, the file, the fix),
    and one when vLLM refuses the serving command."""
    version = (verdict.get("vllm") or {}).get("version") or "unknown"
    refused = args_problem(verdict, reference)
    out = [refused] if refused else []
    for patch in verdict["patches"]:
        if patch["verdict"] != "cannot-apply" or not patch["required"]:
            continue
        rest = ",".join(name for name in patches if name != patch["name"])
        where = patch["file"] or "the image's vLLM"
        detail = patch["detail"].removeprefix(f"{patch['file']} (vLLM {version}): ")
        out.append(
            f"runtime patch {patch['name']} cannot apply to {where} of vLLM {version} in "
            f"{reference}: {detail}. Fix: pin an image whose vLLM has "
            f"this anchor or already carries the fix (--data image=name@sha256:...), or drop the "
            f"patch as data (--data patches={rest})"
        )
    return out


def _fail(host, message: str) -> bool:
    # A False result fails this host only (the others go on), without a traceback.
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


def _check(state, host, reference: str, patches: list[str], env: dict[str, str],  # state, host: pyinfra's
           key: str, pair_check=None) -> bool:
    q = shlex.quote
    path = _verdict_path(key)
    # serve.env as it will be (no secrets in it): the check sees what the start will.
    env_args = " ".join(f"-e {q(f'{name}={value}')}" for name, value in env.items())
    run = (
        f"docker rm -f {CONTAINER} >/dev/null 2>&1; "
        f"docker run --rm --pull never --name {CONTAINER} --network none "
        f"{env_args} -v {RUNTIME_DIR}:/host:ro "
        f"--entrypoint python3 {q(reference)} /host/serve.py --check"
    )
    # The check's exit status is 0 or 1 with a verdict on stdout; anything else (no image,
    # no python3, a crash) leaves no cache entry and fails with the check's own words.
    done = remote.run(
        host,
        f"{_image_id(reference)} || {{ echo 'image {reference} is not on this host'; exit 3; }}; "
        f"mkdir -p {VERDICT_DIR} && out={path} && "
        f'{{ [ -s "$out" ] || {{ {run} > "$out.tmp" 2> "$out.log"; rc=$?; '
        f'if [ $rc -le 1 ]; then mv "$out.tmp" "$out" && rm -f "$out.log"; else cat "$out.tmp" "$out.log"; exit $rc; fi; }}; }} && '
        f'cat "$out"',
        timeout=600,
    )
    ok, lines = done.ok, done.stdout
    try:
        verdict = json.loads("\n".join(lines))
    except ValueError:
        verdict = None
    if not ok or not isinstance(verdict, dict) or "patches" not in verdict:
        return _fail(host, f"the patch check could not run in {reference}:\n    " + "\n    ".join(lines[-15:]))
    found = problems(verdict, reference, patches)
    refused = pair_check(verdict) if pair_check else None
    found += [refused] if refused else []
    if found:
        return _fail(host, "\n".join(found) + "\nThe unit, serve.env and the running service were left as they are.")
    for patch in verdict["patches"]:
        if patch["verdict"] == "cannot-apply":  # a tolerated one: serving goes on without it
            host.log(f"runtime patch {patch['name']} cannot apply ({patch['detail']}); serving without it",
                     logger.warning)
    checked = (verdict.get("args") or {}).get("checked", True)  # False: no GPU here, the start parses it
    host.log(f"runtime patches and the serving command checked against {reference}: "
             f"{summary(verdict) or 'no patches'}; {args_summary(verdict)}", logger.info if checked else logger.warning)
    return True


def checked(name: str, settings: Settings, member: PairMember | None = None):
    """:func:`verified`, its cached verdict declared while the deploy plans: the host's
    snapshot reads it with the rest instead of in a command (and a sudo) of its own."""
    argv = serve_args.build_serve_argv(settings.serve_env(member))
    verdict_of = _verdict_of(settings, argv)
    snapshot.expect(facts=[(DockerImage, {"object_id": verdict_of["reference"]}),
                           (CachedVerdicts, {"key": verdict_of["key"]})])
    return verified(name=name, settings=settings, member=member)


def _verdict_of(settings: Settings, argv: list[str]) -> dict[str, str]:
    """The image and the plan key whose verdict this host's settings (``argv``: its serving
    command) need."""
    return {"reference": local_image(settings), "key": plan_key(",".join(settings.patch_plan), argv)}


@operation()
def verified(settings: Settings, member: PairMember | None = None):
    """
    Check the patch plan and the serving command against the pinned image before the
    unit is installed or restarted.

    + settings: validated settings (``image``, the patch plan, what serve.env renders)
    + member: the host's place in its pair, whose multi-node flags the command carries

    Fails this host, naming the patch, the file and the fix, when a required patch cannot
    apply to the image's vLLM, or naming the setting and the fix when the image's vLLM
    refuses the command; the verdict is cached per image, plan and command on the host.
    """
    patches = settings.patch_plan
    env = settings.serve_env(member)
    argv = serve_args.build_serve_argv(env)
    verdict_of = _verdict_of(settings, argv)
    reference, key = verdict_of["reference"], verdict_of["key"]
    images = snapshot.fact(DockerImage, object_id=reference, _ignore_errors=True) or []
    image_id = str(images[0].get("Id") or "").removeprefix("sha256:") if images else ""
    cached = snapshot.fact(CachedVerdicts, key=key).get(image_id) if image_id else None

    def pair_check(verdict: dict) -> str | None:
        return pair_problem(verdict, reference, settings, member, argv)

    if cached is not None and cached.get("ok") and not pair_check(cached):
        host.noop(f"runtime patches and the serving command checked against {reference}: "
                  f"{summary(cached) or 'no patches'}; {args_summary(cached)}")
        return
    yield remote.callback(_check, reference, patches, env, key, pair_check)
