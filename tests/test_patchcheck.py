"""What the deploy says when the image's vLLM refuses the serving command: the data key
that brought the refused word and its fix (runtime/vllm_cli.py's verdict, read by
sparkfleet/patchcheck.py), against the simulated engine's command line (no image)."""

from __future__ import annotations

import json

import pytest
from support.runtime_env import RUNTIME_DIR

from runtime import serve_args, vllm_cli
from sparkfleet.config import project_defaults, validate_host_data
from sparkfleet.pairs import Pair, PairMember
from sparkfleet.patchcheck import args_problem, pair_problem


@pytest.fixture
def verdict_for(monkeypatch):
    monkeypatch.setenv(vllm_cli.CLI_MODULE_ENV, "sparkfleet.testbed.engine.flags")
    monkeypatch.syspath_prepend(str(RUNTIME_DIR))  # --middleware key_guard, as serve.py finds it

    def verdict(**data) -> dict:
        env = validate_host_data("spark-1", {**project_defaults(), **data}).serve_env()
        return {"vllm": {"version": "0.23.0"}, "args": vllm_cli.check(serve_args.argv_parts(env))}

    return verdict


@pytest.mark.parametrize(("extra", "said"), [
    (["--max_loras", "two"], "argument --max-loras: invalid int value"),  # vLLM reads _ as -
    (["--no_such_flag"], "unrecognized arguments: --no-such-flag"),
    (["--max-lor", "2"], "ambiguous option: --max-lor"),
    (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),  # vLLM's own check
    (["--tool-call-parser", "bogus"], "invalid tool call parser: bogus"),  # it overrides tool_call_parser
])
def test_a_flag_refused_in_extra_serve_args_names_that_key_and_its_fix(verdict_for, extra, said):
    message = args_problem(verdict_for(extra_serve_args=extra), "img@sha256:1")
    assert said in message, message
    assert "key: extra_serve_args (SF_EXTRA_ARGS)" in message, message
    assert "Fix: remove or correct that argument in extra_serve_args" in message, message
    assert "the serving settings" not in message


def test_a_parser_setting_is_still_named_as_itself(verdict_for):
    message = args_problem(verdict_for(tool_call_parser="bogus"), "img@sha256:1")
    assert "key: tool_call_parser (SF_TOOL_CALL_PARSER)" in message and "--data tool_call_parser=" in message


def test_a_refusal_no_word_of_the_command_explains_names_no_key():
    message = args_problem({"vllm": {"version": "0.23.0"},
                            "args": {"ok": False, "var": None, "detail": "cannot import the image's vLLM"}}, "img")
    assert "key:" not in message and "the serving settings" not in message and "Fix: " in message


def test_a_pair_with_cuda_graphs_below_the_graph_floor_is_refused_naming_versions_and_fix():
    s = validate_host_data("spark-1", project_defaults())
    member = PairMember(Pair("pair_a", ("spark-1", "spark-2"), 0, ("192.168.100.1", "192.168.100.2"), 24, 29500),
                        "enp1s0f1np1", "rocep1s0f1", enforce_eager=False)
    old = {"vllm": {"version": "0.23.0"}, "nccl": "2.27.7"}
    said = pair_problem(old, "img:0.23", s, member, ["vllm", "serve", "m"])
    assert "vLLM 0.23.0 with NCCL 2.27.7, below the cross-node CUDA graph floor (vLLM 0.27.1" in said
    assert "NCCL 2.30.4" in said and "--data pair_enforce_eager=True" in said and "#46253" in said
    assert pair_problem(old, "img", s, member, ["vllm", "serve", "m", "--enforce-eager"]) is None
    assert pair_problem(old, "img", s, None, ["vllm", "serve", "m"]) is None  # serves alone
    new = {"vllm": {"version": "0.27.1"}, "nccl": "2.30.4"}
    assert pair_problem(new, "img", s, member, ["vllm", "serve", "m"]) is None
    assert "NCCL 2.29.1" in pair_problem({**new, "nccl": "2.29.1"}, "img", s, member, ["vllm", "serve", "m"])


def test_cached_verdicts_are_read_by_the_image_they_were_made_in(tmp_path, monkeypatch):
    """All verdicts of one plan key, by image id, in one command: which image the host's
    reference names now is the docker fact's answer (a re-pointed tag finds none)."""
    import subprocess

    from sparkfleet import patchcheck

    ok = {"ok": True, "patches": [{"name": "p", "verdict": "would-apply"}]}
    (tmp_path / f"{'a' * 64}-k1.json").write_text(json.dumps(ok, indent=1))
    (tmp_path / f"{'b' * 64}-k1.json").write_text(json.dumps({"ok": False, "patches": []}))
    (tmp_path / f"{'a' * 64}-k2.json").write_text(json.dumps(ok))  # another plan
    (tmp_path / f"{'c' * 64}-k1.json").write_text("{half a verd")  # not a verdict: not cached
    monkeypatch.setattr(patchcheck, "VERDICT_DIR", str(tmp_path))
    command = patchcheck.CachedVerdicts().command(key="k1")
    lines = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()
    assert patchcheck.CachedVerdicts().process(lines) == {"a" * 64: ok, "b" * 64: {"ok": False, "patches": []}}
    monkeypatch.setattr(patchcheck, "VERDICT_DIR", str(tmp_path / "none"))
    command = patchcheck.CachedVerdicts().command(key="k1")
    assert subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout == ""
