"""The simulated engine's server in this process, on loopback: the one simulated vLLM
the bench and check tests run against (no model cache, no startup delay).

    with SimServer(method="dflash", k=12, env={"SIM_DECODE_TOK_S": "250"}) as srv:
        Client(srv.base_url, "qwen") ...

``env`` takes the same ``SIM_*`` overrides as the engine's environment; ``faults``
(``api.Faults``) lets a test meet a server that answers wrong, fails a route, or
streams without chunked encoding.
"""
from __future__ import annotations

import threading
from typing import Any

from . import perf
from .api import Engine, EngineHTTPServer, Faults


class _QuietServer(EngineHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-stream (a failed check, a timeout) is not news


class SimServer:
    def __init__(self, method: str | None = "dflash", k: int = 12, env: dict[str, str] | None = None,
                 levers: perf.Levers = perf.Levers(), faults: Faults | None = None, model: str = "qwen",  # noqa: B008
                 api_key: str | None = None, tool_call_parser: str | None = "qwen3_xml",
                 reasoning_parser: str | None = "qwen3", max_model_len: int = 262144, port: int = 0,
                 middleware: tuple[type, ...] = ()) -> None:
        self.engine = Engine(
            served_names=[model], model=model, max_model_len=max_model_len,
            perf=perf.perf_model(method, k, levers, {"SIM_READY_DELAY_S": "0", **(env or {})}),
            api_keys=[api_key] if api_key else [], enable_auto_tools=bool(tool_call_parser),
            tool_parser=tool_call_parser, reasoning_parser=reasoning_parser, faults=faults or Faults(),
            middleware=list(middleware),
        )
        self.httpd = _QuietServer(("127.0.0.1", port), self.engine)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "SimServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
