"""Replay of real agent turns from a Hermes-style ``state.db``.

The schema is Hermes agent's (NousResearch/hermes-agent, ``hermes_state``); only these
columns are read, and every one that later Hermes versions added is optional:

``sessions``  ``id`` TEXT, ``started_at`` REAL, ``system_prompt`` TEXT; newer versions move
              the prompt into ``system_prompts(hash, prompt)`` via ``system_prompt_hash``.
``messages``  ``id`` INTEGER (insertion order), ``session_id``, ``role`` (user, assistant,
              tool, ...), ``content``, ``tool_calls`` (JSON list, OpenAI shape),
              ``tool_call_id``, ``tool_name``; newer versions mark compacted-away rows
              with ``active = 0``.

For each of the most recent sessions with enough messages, the *last assistant turn* is
the one the server regenerates; everything before it is the context, rebuilt as OpenAI
chat messages: assistant tool calls become ``tool_calls``, tool results become ``tool``
messages paired to their call. Contexts are trimmed to a token budget without breaking
that pairing (a tool result never survives without its call; the user message that
started the current chain is kept). Only numbers leave this module's callers, never
conversation text.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Conservative: Qwen's tokenizer averages ~4 characters per token on English prose and
# fewer on code and JSON; 3 keeps a trimmed context inside the server's window. The real
# prompt size is reported from the server's usage afterwards.
CHARS_PER_TOKEN = 3.0
TRIM_MARK = "\n[... trimmed by the sparkfleet agent bench ...]"


@dataclass
class AgentTurn:
    session_id: str
    messages: list[dict]
    target_had_tool_calls: bool
    source_messages: int  # rows of the session before the target turn
    dropped_messages: int = 0  # dropped by trimming or as orphaned tool results
    truncated_messages: int = 0
    est_tokens: int = 0


@dataclass
class _Row:
    role: str
    content: str | None
    tool_calls: str | None
    tool_call_id: str | None
    tool_name: str | None = None


def open_readonly(path: str) -> sqlite3.Connection:
    """Open without ever writing: the copy on the host is a snapshot nobody else touches."""
    conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    conn.row_factory = sqlite3.Row
    return conn


def _columns(conn: sqlite3.Connection, table: str) -> set:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _tables(conn: sqlite3.Connection) -> set:
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def recent_sessions(conn: sqlite3.Connection, limit: int, min_messages: int) -> list[tuple[str, str | None]]:
    """(session id, system prompt) of up to ``limit`` most recent sessions with enough messages."""
    tables = _tables(conn)
    missing = {"sessions", "messages"} - tables
    if missing:
        raise ValueError(f"not a Hermes state.db: table(s) {', '.join(sorted(missing))} missing")
    scols, mcols = _columns(conn, "sessions"), _columns(conn, "messages")
    active = " AND m.active = 1" if "active" in mcols else ""
    join = ""
    prompt_parts = []
    if "system_prompt" in scols:
        prompt_parts.append("s.system_prompt")
    if "system_prompt_hash" in scols and "system_prompts" in tables:
        join = " LEFT JOIN system_prompts sp ON sp.hash = s.system_prompt_hash"
        prompt_parts.append("sp.prompt")
    prompt = f"COALESCE({', '.join(prompt_parts)}, NULL)" if prompt_parts else "NULL"
    order = "s.started_at DESC, s.rowid DESC" if "started_at" in scols else "s.rowid DESC"
    sql = (
        f"SELECT s.id AS id, {prompt} AS system_prompt, "
        f"(SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id{active}) AS n "
        f"FROM sessions s{join} ORDER BY {order}"
    )
    out: list[tuple[str, str | None]] = []
    for row in conn.execute(sql):
        if row["n"] >= min_messages:
            out.append((str(row["id"]), row["system_prompt"]))
            if len(out) >= limit:
                break
    return out


def session_rows(conn: sqlite3.Connection, session_id: str) -> list[_Row]:
    mcols = _columns(conn, "messages")
    pick = ["role", "content"] + [c for c in ("tool_calls", "tool_call_id", "tool_name") if c in mcols]
    where = "session_id = ?" + (" AND active = 1" if "active" in mcols else "")
    rows = conn.execute(f"SELECT {', '.join(pick)} FROM messages WHERE {where} ORDER BY id", (session_id,))
    return [
        _Row(
            role=r["role"], content=r["content"],
            tool_calls=r["tool_calls"] if "tool_calls" in pick else None,
            tool_call_id=r["tool_call_id"] if "tool_call_id" in pick else None,
            tool_name=r["tool_name"] if "tool_name" in pick else None,
        )
        for r in rows
    ]


def _normalize_tool_calls(raw: str | None, prefix: str, counter: list[int]) -> list[dict]:
    """Hermes stores OpenAI-shaped tool calls as JSON; accept the flat shape too."""
    if not raw:
        return []
    try:
        calls = json.loads(raw)
    except ValueError:
        return []
    if isinstance(calls, dict):
        calls = [calls]
    out = []
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        name = fn.get("name")
        if not name:
            continue
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        counter[0] += 1
        out.append({
            "id": str(call.get("id") or f"call_{prefix}_{counter[0]}"),
            "type": "function",
            "function": {"name": str(name), "arguments": args},
        })
    return out


def rebuild_messages(rows: Sequence[_Row], session_id: str = "s") -> tuple[list[dict], int]:
    """OpenAI chat messages for ``rows`` (the context); returns (messages, orphans dropped).

    A tool result is paired with the call it answers: by ``tool_call_id`` when stored,
    else with the next unanswered call of the preceding assistant message. A tool result
    that answers no call (its call was compacted away) is dropped: chat templates and
    vLLM reject it.
    """
    messages: list[dict] = []
    pending: list[str] = []
    orphans = 0
    counter = [0]
    for row in rows:
        content = row.content or ""
        if row.role == "user":
            messages.append({"role": "user", "content": content})
            pending = []
        elif row.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            calls = _normalize_tool_calls(row.tool_calls, session_id[:8], counter)
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
            pending = [c["id"] for c in calls]
        elif row.role == "tool":
            call_id = row.tool_call_id if row.tool_call_id in pending else None
            if call_id is None and not row.tool_call_id and pending:
                call_id = pending[0]
            if call_id is None:
                orphans += 1
                continue
            pending.remove(call_id)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        # other roles (session_meta, stored system rows) are not part of the model's context
    return messages, orphans


def estimate_tokens(messages: Sequence[dict]) -> int:
    return math.ceil(len(json.dumps(list(messages), ensure_ascii=False)) / CHARS_PER_TOKEN)


def _units(messages: list[dict]) -> list[list[dict]]:
    """Split into units that must stay together: an assistant message with its tool results."""
    units: list[list[dict]] = []
    for msg in messages:
        if msg["role"] == "tool" and units and units[-1][0]["role"] == "assistant":
            units[-1].append(msg)
        else:
            units.append([msg])
    return units


def trim_context(
    system_prompt: str | None, messages: list[dict], max_tokens: int
) -> tuple[list[dict], int, int]:
    """Fit system prompt + messages into ``max_tokens`` (estimated).

    Oldest units go first, except the user message that started the current chain (the
    last user message), kept so the turn still answers someone, and the newest unit, the
    one the regenerated turn follows. When that is not enough, the largest contents
    (usually tool outputs) are cut.
    Returns (messages, dropped count, truncated count).
    """
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    units = _units(messages)
    pin = max((i for i, u in enumerate(units) if u[0]["role"] == "user"), default=None)
    dropped = 0

    def flat() -> list[dict]:
        return system + [m for u in units for m in u]

    while estimate_tokens(flat()) > max_tokens:
        # Older history first, then the chain's older exchanges; the newest unit stays.
        victims = [i for i in range(len(units) - 1) if i != pin]
        if not victims:
            break
        victim = victims[0]
        dropped += len(units[victim])
        del units[victim]
        if pin is not None and victim < pin:
            pin -= 1

    out = flat()
    cut: set = set()
    while estimate_tokens(out) > max_tokens:
        # Cut the longest content by what is over budget; every pass shortens one message,
        # so this ends (at worst with every content reduced to the trim mark).
        candidates = [i for i, m in enumerate(out) if len(m.get("content") or "") > len(TRIM_MARK)]
        if not candidates:
            break  # the structure alone is over budget: best effort
        idx = max(candidates, key=lambda i: len(out[i]["content"]))
        content = out[idx]["content"]
        excess = math.ceil((estimate_tokens(out) - max_tokens) * CHARS_PER_TOKEN) + len(TRIM_MARK)
        out[idx] = dict(out[idx], content=content[: max(0, len(content) - excess)] + TRIM_MARK)
        cut.add(idx)
    return out, dropped, len(cut)


def load_turns(
    path: str, sessions: int, max_context_tokens: int, min_messages: int = 6, scan: int = 4
) -> tuple[list[AgentTurn], list[str]]:
    """Up to ``sessions`` replayable turns from the most recent sessions, and skip reasons."""
    conn = open_readonly(path)
    try:
        turns: list[AgentTurn] = []
        skipped: list[str] = []
        for sid, system_prompt in recent_sessions(conn, sessions * scan, min_messages):
            if len(turns) >= sessions:
                break
            rows = session_rows(conn, sid)
            last = max((i for i, r in enumerate(rows) if r.role == "assistant"), default=None)
            if last is None or last == 0:
                skipped.append(f"{sid[:12]}: no assistant turn with context before it")
                continue
            context, orphans = rebuild_messages(rows[:last], sid)
            if not any(m["role"] == "user" for m in context):
                skipped.append(f"{sid[:12]}: no user message before the last assistant turn")
                continue
            messages, dropped, truncated = trim_context(system_prompt, context, max_context_tokens)
            turns.append(AgentTurn(
                session_id=sid,
                messages=messages,
                target_had_tool_calls=bool(_normalize_tool_calls(rows[last].tool_calls, "t", [0])),
                source_messages=last,
                dropped_messages=dropped + orphans,
                truncated_messages=truncated,
                est_tokens=estimate_tokens(messages),
            ))
        return turns, skipped
    finally:
        conn.close()
