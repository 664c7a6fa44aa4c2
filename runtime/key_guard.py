"""ASGI middleware for vLLM's ``--middleware``: every route of the engine needs the API key.

vLLM's own key check (``--api-key`` / ``VLLM_API_KEY``, its AuthenticationMiddleware)
guards only paths under ``/v1``, ``/v2`` and ``/inference``; ``/metrics``, ``/health``,
``/version``, ``/tokenize``, ``/load`` and the rest answer anyone who reaches the port.
When a host serves with a key, serve.env names this class (``SF_MIDDLEWARE``) and the
wrapper puts this directory on vLLM's ``PYTHONPATH``, so vLLM mounts it in front of its
own routes: a request without ``Authorization: Bearer <key>`` gets 401 on any path.
CORS preflights (OPTIONS) pass, as they do vLLM's own check. stdlib only, so the same
file runs in any image (and in the simulated engine, which honours ``--middleware``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

_UNAUTHORIZED = b'{"error":"Unauthorized"}'


class KeyGuard:
    """401 for every HTTP or WebSocket request that lacks the bearer ``VLLM_API_KEY``."""

    def __init__(self, app: App) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            # Mounted without a key nothing could pass: refuse to start instead.
            raise RuntimeError("key_guard.KeyGuard needs VLLM_API_KEY (secrets.env is not mounted or empty)")
        self.app = app
        self._key = hashlib.sha256(key.encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.strip().encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(given, self._key)
        return False

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or self.authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: a 403
        else:
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
