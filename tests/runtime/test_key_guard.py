"""runtime/key_guard.py in front of the simulated engine, as vLLM mounts ``--middleware``.

vLLM's own key check guards /v1 (and /v2, /inference) only: without the guard /metrics
and /health answer anyone; with it every route needs the key, and OPTIONS still passes.
"""
from __future__ import annotations

import http.client

import pytest

from runtime.key_guard import KeyGuard
from sparkfleet.testbed.engine.local import SimServer
from sparkfleet.testbed.engine.serve import _imported_middleware

KEY = "k" * 32


def status(port: int, path: str, key: str | None = None, method: str = "GET") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_without_the_guard_only_v1_needs_the_key() -> None:
    with SimServer(api_key=KEY) as srv:
        assert status(srv.port, "/v1/models") == 401
        assert status(srv.port, "/metrics") == 200 and status(srv.port, "/health") == 200


def test_with_the_guard_every_route_needs_the_key(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    with SimServer(api_key=KEY, middleware=(KeyGuard,)) as srv:
        for path in ("/metrics", "/health", "/version", "/ping", "/v1/models", "/nope"):
            assert status(srv.port, path) == 401, path
            assert status(srv.port, path, "wrong-key") == 401, path
        assert status(srv.port, "/metrics", KEY) == 200
        assert status(srv.port, "/health", KEY) == 200
        assert status(srv.port, "/v1/models", KEY) == 200
        assert status(srv.port, "/nope", KEY) == 404  # passed on to the routes
        assert status(srv.port, "/metrics", method="OPTIONS") != 401  # CORS preflights pass


def test_the_guard_refuses_to_start_without_a_key(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        KeyGuard(lambda scope, receive, send: None)


def test_the_engine_imports_middleware_as_vllm_does() -> None:
    assert _imported_middleware("runtime.key_guard.KeyGuard") is KeyGuard
    with pytest.raises(Exception, match="No module named"):
        _imported_middleware("no_such_module.Guard")
