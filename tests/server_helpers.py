"""Real servers on 127.0.0.1 for the tests: a free port, a wait for /health, and a server on a thread
serving an LLM the test built (stopped when the block ends)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx

from jaxrunner.entrypoints.openai.api_server import ServerConfig, ServerState
from jaxrunner.entrypoints.openai.server_process import make_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(base: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base} did not become healthy")


@contextlib.contextmanager
def serving(llm, **config):
    """``llm`` behind a server on a thread; yields (base URL, ServerState). ``config``: ServerConfig
    fields (``model`` defaults to "tiny")."""
    state = ServerState(ServerConfig(**{"model": "tiny", **config, "port": free_port()}), llm)
    server = make_server(state)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{state.config.port}"
    try:
        wait_for_health(base, 60)
        yield base, state
    finally:
        server.should_exit = True
        thread.join(timeout=30)
