"""The checks: smoke, tools (a function-call round trip), decode bank, albond end-to-end,
agent turns.

Each ``run_<name>(ctx)`` returns a JSON-ready dict with a ``status`` ("ok"/"failed") and,
when failed, a ``reason``. A :class:`~.client.BenchError` (server unreachable, HTTP error,
stall) propagates: the runner fails that check with the error's message.

Speculative acceptance is measured over exactly the measured window of each workload:
``/metrics`` is scraped after the warm-up runs and after the last measured run.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import BenchError, Client
from .metrics import SpecCounters, acceptance, parse_spec_counters
from .progress import Progress
from .schema import ProgramSettings
from .statedb import load_turns
from .timing import TimingError, e2e_tok_s, record_rates, scaled, summarize
from .workloads import (
    ALBOND_PASSES,
    ALBOND_PROMPTS,
    SMOKE_EXPECT,
    SMOKE_MAX_TOKENS,
    SMOKE_PROMPT,
    decode_workloads,
)


@dataclass
class BenchContext:
    client: Client
    progress: Progress
    settings: ProgramSettings
    agent_min_messages: int = 6


# --- acceptance window ------------------------------------------------------------------


def scrape(ctx: BenchContext) -> SpecCounters | None:
    """The counters now, or None when /metrics cannot be read (acceptance is then unknown)."""
    try:
        return parse_spec_counters(ctx.client.metrics_text())
    except (BenchError, ValueError) as exc:
        ctx.progress.log(f"warning: /metrics unreadable, no acceptance for this window: {exc}")
        return None


def window_acceptance(before: SpecCounters | None, after: SpecCounters | None) -> dict | None:
    if before is None or after is None:
        return None
    return acceptance(after - before)


def _fmt_acc(acc: dict | None) -> str:
    return f"accept len {acc['mean_length']:.2f}" if acc else "no speculative drafts"


# --- smoke --------------------------------------------------------------------------------


def run_smoke(ctx: BenchContext) -> dict:
    """One-word capital of France, temperature 0, 8 tokens: passes when it says Paris."""
    data, wall = ctx.client.complete(SMOKE_PROMPT, SMOKE_MAX_TOKENS)
    choices = data.get("choices") or [{}]
    answer = choices[0].get("text") or ""
    passed = SMOKE_EXPECT in answer.lower()
    ctx.progress.log(f"smoke: {'PASS' if passed else 'FAIL'} answer={answer.strip()!r} ({wall:.2f} s)")
    out = {"status": "ok" if passed else "failed", "passed": passed, "answer": answer, "latency_s": wall}
    if not passed:
        out["reason"] = f"answer does not contain Paris: {answer.strip()!r}"
    return out


# --- tools: a function-call round trip ----------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TOOLS_QUESTION = "What is the weather in Paris right now? Use the get_weather tool."
TOOL_RESULT = {"city": "Paris", "temperature_c": 18, "conditions": "sunny"}
TOOLS_MAX_TOKENS = 1024  # room for Qwen3.5's thinking before the call
PARSER_FIX = "set data tool_call_parser (qwen3_xml for Qwen3.5) and redeploy"


def _failed(reason: str, **extra: Any) -> dict:
    return {"status": "failed", "passed": False, "reason": reason, **extra}


def tool_call_round_trip(client: Client, max_tokens: int = TOOLS_MAX_TOKENS) -> dict:
    """What an agent needs from the server: a declared function is called with valid JSON
    arguments, its result goes back, and the model answers.

    Returns ``{"status": "ok"|"failed", "passed", "reason"?, ...}``; raises BenchError only
    when the server cannot be reached. The rollout gate can call it with any ``Client``.
    """
    messages: list[dict] = [{"role": "user", "content": TOOLS_QUESTION}]
    try:
        data, t0, t1 = client.chat(messages, max_tokens, tools=[WEATHER_TOOL], tool_choice="auto")
    except BenchError as exc:
        if "tool-call-parser" not in str(exc):
            raise
        said = re.search(r'"message": "((?:[^"\\]|\\.)*)"', str(exc))
        detail = json.loads(f'"{said.group(1)}"') if said else str(exc)[-160:]
        return _failed(f"the server has no tool-call parser, so it cannot return tool calls "
                       f"(vLLM refused tool_choice=auto: {detail}); {PARSER_FIX}")
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    finish = choice.get("finish_reason")
    if not calls:
        content = message.get("content") or ""
        if "<tool_call>" in content or "<function=" in content:
            return _failed("the model wrote a tool call but the server did not parse it: the tool-call parser "
                           f"does not read the model's format; {PARSER_FIX}", finish_reason=finish)
        return _failed(f"no tool call in the answer (finish_reason {finish!r}, content {content[:80]!r})",
                       finish_reason=finish)
    function = calls[0].get("function") or {}
    raw_args = function.get("arguments")
    if function.get("name") != "get_weather":
        return _failed(f"the model called {function.get('name')!r}, not the declared get_weather")
    if not isinstance(raw_args, str):
        return _failed(f"arguments are not a JSON string: {raw_args!r}")
    try:
        args = json.loads(raw_args)
    except ValueError:
        return _failed(f"arguments are not valid JSON: {raw_args[:120]!r}")
    if not isinstance(args, dict) or not isinstance(args.get("city"), str) or not args["city"]:
        return _failed(f"arguments lack the required string 'city': {raw_args[:120]!r}")
    if finish != "tool_calls":
        return _failed(f"a tool call ended with finish_reason {finish!r}, not 'tool_calls'")
    call_id = calls[0].get("id") or "call-0"
    messages += [
        {"role": "assistant", "content": message.get("content"), "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": raw_args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(TOOL_RESULT)},
    ]
    data2, t2, t3 = client.chat(messages, max_tokens, tools=[WEATHER_TOOL], tool_choice="auto")
    choice2 = (data2.get("choices") or [{}])[0]
    answer = (choice2.get("message") or {}).get("content") or ""
    if (choice2.get("message") or {}).get("tool_calls"):
        return _failed("after the tool result the model called a tool again instead of answering")
    if not answer.strip():
        return _failed(f"no answer after the tool result (finish_reason {choice2.get('finish_reason')!r})")
    return {
        "status": "ok", "passed": True, "function": "get_weather", "arguments": args,
        "answer": answer[:200], "uses_result": any(str(v) in answer for v in TOOL_RESULT.values()),
        "latency_s": (t1 - t0) + (t3 - t2),
    }


def run_tools(ctx: BenchContext) -> dict:
    out = tool_call_round_trip(ctx.client)
    verdict = "PASS" if out["passed"] else f"FAIL: {out['reason']}"
    ctx.progress.log(f"tools: {verdict}" + (f" ({out['latency_s']:.2f} s)" if out["passed"] else ""))
    return out


# --- decode bank --------------------------------------------------------------------------


def _decode_one(ctx: BenchContext, prompt: str) -> dict:
    # ignore_eos + min_tokens = max_tokens: every run decodes the full budget, so the
    # rate is steady-state decode and not a short answer's ramp.
    rec = ctx.client.stream_completion(
        prompt, ctx.settings.max_tokens, ignore_eos=True, min_tokens=ctx.settings.max_tokens
    )
    return record_rates(rec)


def run_decode_workload(ctx: BenchContext, name: str, prompt: str) -> dict:
    tag = f"decode/{name}"
    for i in range(ctx.settings.warmup):
        with ctx.progress.heartbeat(f"{tag} warm-up {i + 1}/{ctx.settings.warmup}"):
            try:
                r = _decode_one(ctx, prompt)
                ctx.progress.log(f"{tag} warm-up {i + 1}/{ctx.settings.warmup}: {r['decode_tok_s']:.1f} tok/s (discarded)")
            except TimingError as exc:
                ctx.progress.log(f"{tag} warm-up {i + 1}/{ctx.settings.warmup}: {exc} (discarded)")
    before = scrape(ctx)
    runs: list[dict] = []
    errors: list[str] = []
    for i in range(ctx.settings.runs):
        with ctx.progress.heartbeat(f"{tag} run {i + 1}/{ctx.settings.runs}"):
            try:
                r = _decode_one(ctx, prompt)
            except TimingError as exc:
                errors.append(str(exc))
                ctx.progress.log(f"{tag} run {i + 1}/{ctx.settings.runs}: not timed: {exc}")
                continue
        runs.append(r)
        ctx.progress.log(
            f"{tag} run {i + 1}/{ctx.settings.runs}: {r['completion_tokens']} tok, "
            f"decode {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1000:.0f} ms"
        )
    after = scrape(ctx)
    out = {
        "status": "ok" if runs else "failed",
        "prompt_chars": len(prompt),
        "max_tokens": ctx.settings.max_tokens,
        "warmup_runs": ctx.settings.warmup,
        "runs": runs,
        "decode_tok_s": summarize(r["decode_tok_s"] for r in runs),
        "ttft_ms": scaled(summarize(r["ttft_s"] for r in runs), 1000.0),
        "e2e_tok_s": summarize(r["e2e_tok_s"] for r in runs),
        "acceptance": window_acceptance(before, after),
    }
    if errors:
        out["errors"] = errors
    if not runs:
        out["reason"] = f"no run could be timed: {errors[0] if errors else 'no runs'}"
    else:
        d = out["decode_tok_s"]
        ctx.progress.log(
            f"{tag}: median {d['median']:.1f} tok/s (min {d['min']:.1f}, max {d['max']:.1f}), "
            f"{_fmt_acc(out['acceptance'])}"
        )
    return out


def run_decode(ctx: BenchContext) -> dict:
    """The reference recipe's bank (prose, code, counting) plus the user's prompt, decode-only."""
    workloads = {}
    for name, prompt in decode_workloads(ctx.settings.prompt).items():
        workloads[name] = run_decode_workload(ctx, name, prompt)
    failed = [n for n, w in workloads.items() if w["status"] != "ok"]
    out: dict = {"status": "failed" if failed else "ok", "workloads": workloads}
    if failed:
        out["reason"] = "; ".join(f"{n}: {workloads[n].get('reason')}" for n in failed)
    return out


# --- albond end-to-end -----------------------------------------------------------------------


def run_e2e(ctx: BenchContext) -> dict:
    """albond's method: 5 prompts, non-streaming chat, temperature 0, pass 1 discarded,
    tok/s = completion_tokens / request wall time, cross-prompt mean of the last pass."""
    passes: list[dict[str, dict]] = []
    before: SpecCounters | None = None
    for p in range(1, ALBOND_PASSES + 1):
        warm = p < ALBOND_PASSES
        if not warm:
            before = scrape(ctx)
        results: dict[str, dict] = {}
        for prompt in ALBOND_PROMPTS:
            label = f"e2e pass {p}/{ALBOND_PASSES}{' (warm-up)' if warm else ''} [{prompt.name}]"
            with ctx.progress.heartbeat(label):
                data, t0, t1 = ctx.client.chat(
                    [{"role": "user", "content": prompt.prompt}], prompt.max_tokens
                )
            usage = data.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or 0)
            wall = t1 - t0
            if tokens <= 0:
                raise BenchError(f"e2e [{prompt.name}]: the answer has no usage.completion_tokens")
            tps = e2e_tok_s(tokens, wall)
            results[prompt.name] = {
                "completion_tokens": tokens, "max_tokens": prompt.max_tokens,
                "wall_s": wall, "tok_s": tps,
            }
            ctx.progress.log(f"{label}: {tokens} tok in {wall:.2f} s = {tps:.1f} tok/s")
        passes.append(results)
    after = scrape(ctx)
    measured = passes[-1]
    mean = math.fsum(r["tok_s"] for r in measured.values()) / len(measured)
    acc = window_acceptance(before, after)
    ctx.progress.log(f"e2e: cross-prompt mean {mean:.2f} tok/s (albond published 51.58), {_fmt_acc(acc)}")
    return {
        "status": "ok",
        "method": "albond: completion_tokens / wall, non-streaming chat, pass 1 discarded",
        "tok_s": mean,
        "prompts": measured,
        "warmup_pass": passes[0] if len(passes) > 1 else None,
        "acceptance": acc,
    }


# --- agent turns --------------------------------------------------------------------------------


def run_agent(ctx: BenchContext) -> dict:
    """Regenerate the last assistant turn of recent Hermes sessions, decode-only timing."""
    if not ctx.settings.state_db:
        return {"status": "failed", "reason": "no state.db given (data agent_state_db)"}
    try:
        turns, skipped = load_turns(
            ctx.settings.state_db, ctx.settings.agent_sessions, ctx.settings.agent_max_context_tokens, ctx.agent_min_messages
        )
    except Exception as exc:  # sqlite3.DatabaseError, a schema that is not Hermes'
        return {"status": "failed", "reason": f"cannot read state.db: {exc}"}
    if not turns:
        return {
            "status": "failed",
            "reason": f"no replayable turn in state.db (sessions with >= {ctx.agent_min_messages} messages)",
            "skipped": skipped,
        }
    ctx.progress.log(f"agent: {len(turns)} turns from {ctx.settings.state_db}, up to {ctx.settings.agent_max_tokens} tokens each")
    for i in range(ctx.settings.warmup):
        with ctx.progress.heartbeat(f"agent warm-up {i + 1}/{ctx.settings.warmup}"):
            ctx.client.stream_chat(turns[0].messages, ctx.settings.agent_max_tokens)
        ctx.progress.log(f"agent warm-up {i + 1}/{ctx.settings.warmup} done (discarded)")
    before = scrape(ctx)
    records: list[dict] = []
    for n, turn in enumerate(turns, 1):
        label = f"agent turn {n}/{len(turns)}"
        with ctx.progress.heartbeat(label):
            rec = ctx.client.stream_chat(turn.messages, ctx.settings.agent_max_tokens)
        entry = {
            "session": turn.session_id[:12],
            "context_messages": len(turn.messages),
            "context_est_tokens": turn.est_tokens,
            "dropped_messages": turn.dropped_messages,
            "truncated_messages": turn.truncated_messages,
            "target_had_tool_calls": turn.target_had_tool_calls,
        }
        try:
            entry.update(record_rates(rec))
            ctx.progress.log(
                f"{label}: {entry['completion_tokens']} tok, decode {entry['decode_tok_s']:.1f} tok/s, "
                f"TTFT {entry['ttft_s'] * 1000:.0f} ms, prompt {entry['prompt_tokens']} tok"
            )
        except TimingError as exc:
            entry.update({"skipped": str(exc), "completion_tokens": rec.completion_tokens})
            ctx.progress.log(f"{label}: not timed: {exc}")
        records.append(entry)
    after = scrape(ctx)
    timed = [r for r in records if "decode_tok_s" in r]
    acc = window_acceptance(before, after)
    out = {
        "status": "ok" if timed else "failed",
        "turns": records,
        "skipped_sessions": skipped,
        "decode_tok_s": summarize(r["decode_tok_s"] for r in timed),
        "ttft_ms": scaled(summarize(r["ttft_s"] for r in timed), 1000.0),
        "acceptance": acc,
        "tool_call_share": sum(1 for t in turns if t.target_had_tool_calls) / len(turns),
    }
    if timed:
        d = out["decode_tok_s"]
        ctx.progress.log(f"agent: median {d['median']:.1f} tok/s over {len(timed)} turns (published: ~81), {_fmt_acc(acc)}")
    else:
        out["reason"] = "no turn produced enough tokens to time"
    return out


CHECKS: dict[str, Callable[[BenchContext], dict]] = {
    "smoke": run_smoke,
    "tools": run_tools,
    "decode": run_decode,
    "e2e": run_e2e,
    "agent": run_agent,
}
