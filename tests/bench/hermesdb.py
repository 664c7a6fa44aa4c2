"""Synthetic Hermes ``state.db`` files for the agent-bench tests.

The tables follow Hermes agent's ``hermes_state`` schema (only the columns the replay
reads, plus a few it must ignore). ``modern=True`` adds what later Hermes versions moved
around: the system prompt in ``system_prompts`` by hash, and ``messages.active``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path

SECRET = "TOP-SECRET-CONVERSATION-TEXT"


def create(path: Path, modern: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE sessions (
            id TEXT PRIMARY KEY, source TEXT NOT NULL, model TEXT, system_prompt TEXT,
            parent_session_id TEXT, started_at REAL NOT NULL, ended_at REAL,
            message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
            role TEXT NOT NULL, content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT,
            timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT, reasoning TEXT
        );
        """
    )
    if modern:
        conn.executescript(
            """
            CREATE TABLE system_prompts (hash TEXT PRIMARY KEY, prompt TEXT NOT NULL);
            ALTER TABLE sessions ADD COLUMN system_prompt_hash TEXT;
            ALTER TABLE messages ADD COLUMN active INTEGER NOT NULL DEFAULT 1;
            """
        )
    return conn


def call(call_id: str | None, name: str, args: dict) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    if call_id:
        out["id"] = call_id
    return out


Row = tuple  # (role, content, tool_calls list|None, tool_call_id|None[, active])


def add_session(conn: sqlite3.Connection, sid: str, started_at: float, rows: Sequence[Row],
                system_prompt: str | None = "You are Hermes.", modern: bool = False) -> None:
    if modern:
        conn.execute("INSERT OR IGNORE INTO system_prompts VALUES (?, ?)", ("h-" + sid, system_prompt))
        conn.execute(
            "INSERT INTO sessions (id, source, started_at, message_count, system_prompt_hash) VALUES (?,?,?,?,?)",
            (sid, "cli", started_at, len(rows), "h-" + sid),
        )
    else:
        conn.execute(
            "INSERT INTO sessions (id, source, started_at, message_count, system_prompt) VALUES (?,?,?,?,?)",
            (sid, "cli", started_at, len(rows), system_prompt),
        )
    for i, row in enumerate(rows):
        role, content, calls, call_id = row[:4]
        cols = ["session_id", "role", "content", "tool_calls", "tool_call_id", "tool_name", "timestamp"]
        vals: list = [sid, role, content, json.dumps(calls) if calls is not None else None, call_id,
                      None, started_at + i]
        if modern:
            cols.append("active")
            vals.append(row[4] if len(row) > 4 else 1)
        conn.execute(f"INSERT INTO messages ({', '.join(cols)}) VALUES ({', '.join('?' * len(vals))})", vals)
    conn.commit()


def agent_session(tag: str) -> list[Row]:
    """A typical tool-calling session: user, tool call, result, answer, ..., last turn a tool call."""
    return [
        ("session_meta", '{"cwd": "/x"}', None, None),
        ("user", f"{SECRET} {tag}: list the files", None, None),
        ("assistant", "", [call(f"c1-{tag}", "terminal", {"cmd": "ls"})], None),
        ("tool", "a.py\nb.py", None, f"c1-{tag}"),
        ("assistant", "There are two files.", None, None),
        ("user", "now read a.py", None, None),
        ("assistant", "", [call(f"c2-{tag}", "read_file", {"path": "a.py"})], None),
        ("tool", "print('hi')", None, f"c2-{tag}"),
        ("assistant", "", [call(f"c3-{tag}", "terminal", {"cmd": "python a.py"})], None),
    ]
