"""The ``jaxrunner serve`` process: uvicorn over the app, the model loaded on a thread while /health
says 503, signals that drain in-flight requests and exit 0, and an exit status 1 when the engine
loop dies (for a supervisor to restart the process)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time

import uvicorn

from jaxrunner.entrypoints.openai.api_server import ServerConfig, ServerState, build_app


class _Server(uvicorn.Server):
    """uvicorn, except that a SIGINT/SIGTERM shutdown exits 0 instead of re-raising the signal, and
    that requests still running near the end of the drain window are ended by the server (streams get
    an error event and ``[DONE]``) rather than cut when uvicorn cancels their tasks."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets=None) -> None:
        window = self.config.timeout_graceful_shutdown
        ender = None
        if window is not None and self.state.async_llm is not None:
            lead = min(1.0, window / 4)  # time for the error events to reach the clients
            ender = asyncio.get_running_loop().call_later(max(0.0, window - lead), self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            if ender is not None:
                ender.cancel()

    def _end_requests(self) -> None:
        engine_loop = self.state.async_llm.engine_loop
        asyncio.get_running_loop().run_in_executor(None, engine_loop.close)  # it joins the engine thread

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(state: ServerState, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(build_app(state), host=state.config.host, port=state.config.port, log_level=log_level,
                            timeout_graceful_shutdown=state.config.shutdown_timeout_s, access_log=False)
    return _Server(config, state)


def run_server(config: ServerConfig, engine_options: dict) -> int:
    """Serve until SIGINT/SIGTERM. The HTTP port opens at once (``/health`` says 503); the model
    loads and warms up on a thread, then the URL is printed. Returns the exit status."""
    state = ServerState(config)
    server = make_server(state, config.uvicorn_log_level)
    failure: list[BaseException] = []
    if config.log_requests:
        _log_to_stderr(logging.getLogger("jaxrunner.server"))

    def load() -> None:
        from jaxrunner.llm import LLM  # lazy: JAX loads here, on the load thread, once the port is open

        try:
            state.set_llm(LLM(config.model, **engine_options))
        except Exception as err:  # the user's model or options: report and stop the server
            failure.append(err)
            server.should_exit = True
            return
        print(f"jaxrunner serve: {config.model_name} ready at http://{config.host}:{config.port}/v1",
              file=sys.stderr, flush=True)

    threading.Thread(target=load, name="jaxrunner-model-load", daemon=True).start()
    threading.Thread(target=_exit_when_the_engine_dies, args=(state, server), name="jaxrunner-engine-watch",
                     daemon=True).start()
    server.run()
    if state.async_llm is not None:  # uvicorn has drained or cancelled the requests; stop the loop too
        state.async_llm.engine_loop.close()
    if failure:
        raise failure[0]
    if state.engine_failure is not None:
        print(f"jaxrunner serve: the engine failed ({state.engine_failure!r}); exiting", file=sys.stderr, flush=True)
        return 1
    return 0


def _log_to_stderr(logger: logging.Logger) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _exit_when_the_engine_dies(state: ServerState, server: uvicorn.Server, poll_s: float = 0.2) -> None:
    """A dead engine loop cannot serve again: /health already says 503; stop the server so that the
    process exits non-zero and its supervisor restarts it, rather than leave it up and useless."""
    while not server.should_exit:
        if state.engine_failure is not None:
            server.should_exit = True
            return
        time.sleep(poll_s)
