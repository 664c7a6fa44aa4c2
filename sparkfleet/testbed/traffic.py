"""Traffic through a simulated fleet's endpoint, for tests and benchmarks.

* :class:`Endpoint`: the fleet endpoint seen from the controller (HAProxy on ``router``):
  an ``openai`` client on it, its members' states and counters from its Prometheus
  exporter, all by testbed host name (the endpoint names members by inventory name);
* :class:`Load`: concurrent streaming chats through it until stopped, each a
  :class:`Request` (when, how many tokens, what went wrong);
* :class:`Watch`: every member's state, sampled every 0.25 s.

Traffic goes only to the testbed's addresses (no proxy from the environment); every loop
ends within ``MAX_RUN_S``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkfleet import haproxy

MAX_RUN_S = 1800
#: The endpoint's ports and backend as sparkfleet configures them (group_data/all.py).
PORT, METRICS_PORT = 8080, 8405
#: A member's backend is ``members``, or ``members_<key id>`` per API key the members run.
STATUS = re.compile(r'^haproxy_server_status\{proxy="(members[^"]*)",server="([^"]+)",state="([A-Z]+)"\} 1$', re.M)


def _httpx():
    import httpx2 as httpx  # what the openai client is built on

    return httpx


class Endpoint:
    def __init__(self, tb, router: str, key_file: Path):
        self.tb, self.router, self.key_file = tb, router, key_file
        self.address = tb.host(router).address
        self.url = f"http://{self.address}:{PORT}"
        self.metrics_url = f"http://{self.address}:{METRICS_PORT}/metrics"
        self._host = {tb.inventory_name(n): n for n in tb.names}
        self.http = _httpx().Client(trust_env=False, timeout=5)

    @property
    def key(self) -> str:
        """The fleet's API key (read when needed: the first deploy makes it)."""
        return self.key_file.read_text().strip()

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=120,
                             http_client=_httpx().Client(trust_env=False, timeout=120))

    def metrics(self) -> str:
        return self.http.get(self.metrics_url, headers=self.auth).text

    def states(self) -> dict[str, str]:
        """Each member's state (UP, DOWN, DRAIN, MAINT...) by testbed name."""
        return {self._host.get(server, server): state for _, server, state in STATUS.findall(self.metrics())}

    def backends(self) -> dict[str, str]:
        """Each member's backend (the key it runs) by testbed name."""
        return {self._host.get(server, server): proxy for proxy, server, _ in STATUS.findall(self.metrics())}

    def counters(self, name: str = "haproxy_server_sessions_total") -> dict[str, float]:
        """A per-member counter of the exporter, by testbed name."""
        found = re.findall(rf'^{re.escape(name)}\{{proxy="members[^"]*",server="([^"]+)"\}} (\S+)$', self.metrics(),
                           re.M)
        return {self._host.get(server, server): float(value) for server, value in found}

    def wait_state(self, member: str, want: set[str], timeout: float) -> float:
        """Seconds until ``member`` is in one of the states ``want``."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.states().get(member) in want:
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"{member} not {want} within {timeout} s: {self.states()}")

    def set_state(self, member: str, state: str) -> None:
        """Set a member's admin state (ready, drain, maint) on the router, as the deploy does."""
        server = haproxy.server_name(self.tb.inventory_name(member))
        backend = self.backends()[member]
        self.tb.exec(self.router, haproxy.runtime_shell(f"set server {backend}/{server} state {state}"), check=True)


@dataclass
class Request:
    start: float
    end: float
    error: str | None
    tokens: int = 0


class Load:
    """``workers`` concurrent streaming chats through the endpoint until stopped."""

    def __init__(self, ep: Endpoint, workers: int, max_tokens: int = 20, prompt: str = "Tell me about Paris."):
        self.ep, self.max_tokens, self.prompt = ep, max_tokens, prompt
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.deadline = time.monotonic() + MAX_RUN_S
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    @property
    def ok(self) -> int:
        return sum(1 for r in self.requests if not r.error)

    @property
    def failed(self) -> list[str]:
        return [r.error for r in self.requests if r.error]

    def _one(self, client: Any) -> Request:
        import openai

        start = time.monotonic()
        tokens, content = 0, 0
        try:
            stream = client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": self.prompt}], max_tokens=self.max_tokens,
                stream=True, stream_options={"include_usage": True})
            finished = False
            for chunk in stream:
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    delta = choice.delta
                    content += bool(delta and (delta.content or getattr(delta, "reasoning_content", None)))
                    finished = finished or choice.finish_reason is not None
            error = None if finished else f"stream cut after {content} chunks"
        except openai.APIStatusError as exc:
            error = f"HTTP {exc.status_code}"
        except openai.APIError as exc:
            cause = exc.__cause__
            error = type(exc).__name__ + (f" ({type(cause).__name__}: {str(cause)[:80]})" if cause else "")
        return Request(start, time.monotonic(), error, tokens)

    def _run(self):
        client = self.ep.client()
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            done = self._one(client)
            with self.lock:
                self.requests.append(done)
            if done.error:
                time.sleep(0.05)  # a failing endpoint is not hammered

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


class Watch:
    """Every member's state at the endpoint, every 0.25 s."""

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.samples: list[tuple[float, dict[str, str]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        deadline = time.monotonic() + MAX_RUN_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.samples.append((time.monotonic(), self.ep.states()))
            except _httpx().HTTPError:
                self.samples.append((time.monotonic(), {}))
            time.sleep(0.25)

    def out_of_rotation(self, start: float = 0.0, end: float = float("inf")) -> dict[str, float]:
        """Seconds each member was not UP between start and end."""
        out: dict[str, float] = {}
        window = [(t, s) for t, s in self.samples if start <= t <= end]
        for (t, s), (t_next, _) in zip(window, window[1:]):
            for name, state in s.items():
                out.setdefault(name, 0.0)
                if state != "UP":
                    out[name] += t_next - t
        return out

    def first_out(self, name: str, after: float) -> float | None:
        return next((t for t, s in self.samples if t >= after and s.get(name) not in (None, "UP")), None)

    def wait(self, predicate, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.samples and predicate(self.samples[-1][1]):
                return self.samples[-1][0]
            time.sleep(0.1)
        return None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)
