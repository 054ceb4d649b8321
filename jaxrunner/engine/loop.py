"""EngineLoop: one thread owns an engine; any number of callers submit to it and get their own outputs.

Callers (``LLM`` from any thread, ``AsyncLLM`` from an event loop, the HTTP server) validate their
requests on their own thread, then ``submit`` each with a *sink*: a callable that receives every
``RequestOutput`` of that request, or the exception that ended it. The loop thread is the only caller
of the engine's ``add_request``/``step``/``abort_request``: it drains new submissions and aborts,
runs one ``engine.step()`` (async scheduling keeps one step in flight, as before), and hands each
output to its request's sink. Outputs of a request nobody submitted here are never produced: the loop
refuses to take an engine that holds requests added directly (``engine.add_request``), and while it
owns the engine, direct calls from other threads raise (``LLMEngine.check_caller``).

The thread sleeps on a condition when it has nothing to do and exits after ``idle_exit_s`` of idleness,
handing the engine back, so an ``LLM`` that is not generating holds no thread; the next submission
starts a new one.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from typing import Callable

from jaxrunner.engine.request import check_request_id_free
from jaxrunner.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("jaxrunner")

Sink = Callable[[object], None]  # receives RequestOutput, or the exception that ended the request


class EngineLoopClosed(RuntimeError):
    """What the requests in flight get when their engine loop is closed (a server shutting down)."""


class EngineLoopDied(RuntimeError):
    """The loop thread failed outside a step (a step's own failure fails only its requests): every
    request in flight gets this, and so does every later submission. The engine's state is unknown,
    so nothing is retried; a server reports unhealthy and exits."""


@dataclasses.dataclass
class _Submission:
    request_id: str
    request: object  # the engine's ValidRequest
    sink: Sink


@dataclasses.dataclass
class LoopStats:
    """A snapshot the loop thread publishes after each step (read by metrics and admission control)."""

    running: int = 0
    waiting: int = 0
    pages_in_use: int = 0
    pages_total: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0


class EngineLoop:
    def __init__(self, engine, idle_exit_s: float = 2.0):
        self.engine = engine
        self.idle_exit_s = idle_exit_s
        self._cond = threading.Condition()
        self._submissions: collections.deque[_Submission] = collections.deque()
        # aborted ids, each with the sink that hears its final output (None: nobody is listening)
        self._aborts: collections.deque[tuple[str, Sink | None]] = collections.deque()
        self._calls: collections.deque[tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._sinks: dict[str, Sink] = {}      # requests submitted and not finished or aborted
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._closing = False
        self.failure: BaseException | None = None  # set when the loop thread died (EngineLoopDied)
        self.stats = LoopStats()

    # ------------------------------------------------------------------ callers' side (any thread)
    def validate(self, prompt, sampling_params=None, lora_request=None):
        """The engine's checks and tokenization, on the caller's thread; raises ``ValueError``."""
        return self.engine.validate_request(prompt, sampling_params, lora_request)

    def new_request_id(self) -> str:
        """An id no request of this loop has (for callers that need ids before they submit)."""
        with self._cond:
            return f"req-{next(self._ids)}"

    def submit(self, request, sink: Sink, request_id: str | None = None) -> str:
        """Queue a validated request (``validate``'s result); its outputs go to ``sink``. Returns its id."""
        with self._cond:
            self._check_alive()
            request_id = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            check_request_id_free(request_id, self._sinks)
            self._sinks[request_id] = sink
            self._submissions.append(_Submission(request_id, request, sink))
            self._ensure_thread()
            self._cond.notify()
        return request_id

    @contextlib.contextmanager
    def together(self):
        """Submissions made inside arrive at the loop as one: no step starts between them. Several
        processes serving one model (``jax.distributed``) must schedule the same batches, so a
        call's requests must not be split by when the loop thread happens to wake."""
        with self._cond:  # re-entrant: submit takes it again
            yield

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed by the loop's next iteration, and its sink gets a final
        output with ``finish_reason="abort"`` (the text so far), so a consumer waiting on it ends, as
        in vLLM. A caller that aborts its own request may ignore that output. Unknown ids are ignored."""
        with self._cond:
            sink = self._sinks.pop(request_id, None)
            if sink is None:
                return
            self._aborts.append((request_id, sink))
            self._cond.notify()

    def run_on_engine(self, fn: Callable):
        """``fn(engine)`` between two steps, and its result (or its exception). On the loop thread when
        the loop owns the engine; else right here, holding the lock the loop takes the engine under,
        so no step can start meanwhile."""
        with self._cond:
            self._check_alive()
            if self.engine.owner_thread is None:
                return fn(self.engine)
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._calls.append((fn, future))
            self._ensure_thread()
            self._cond.notify()
        return future.result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort every request (their callers get a ``RuntimeError``) and wait for the thread to end,
        so a process can exit without a step in flight. Later submissions start the loop again."""
        with self._cond:
            sinks, self._sinks = self._sinks, {}
            self._aborts.extend((request_id, None) for request_id in sinks)
            self._closing = True
            thread = self._thread
            self._cond.notify()
        for sink in sinks.values():
            _call(sink, EngineLoopClosed("the engine loop was closed (server shutting down)"))
        if thread is not None:
            thread.join(timeout_s)
        with self._cond:
            self._closing = False

    def sequence_slots(self) -> int:
        """How many requests the engine runs at once (``max_num_seqs`` of every replica); more wait."""
        return sum(replica.scheduler.config.max_num_seqs for replica in getattr(self.engine, "replicas", [self.engine]))

    def num_requests(self) -> int:
        """Requests submitted here and not yet finished or aborted."""
        with self._cond:
            return len(self._sinks)

    # ------------------------------------------------------------------ the loop thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            _close_at_exit(self)
            self._thread = threading.Thread(target=self._run, name="jaxrunner-engine-loop", daemon=True)
            self._thread.start()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineLoopDied(f"the engine loop died: {type(self.failure).__name__}: {self.failure}")

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - every caller must hear of it, whatever it is
            self._die(err)

    def _die(self, err: BaseException) -> None:
        logger.critical("the engine loop died; failing every request", exc_info=err)
        with self._cond:
            self.failure = err
            sinks, self._sinks = self._sinks, {}
            calls = list(self._calls)
            self._submissions.clear()
            self._aborts.clear()
            self._calls.clear()
            self._thread = None
        died = EngineLoopDied(f"the engine loop died: {type(err).__name__}: {err}")
        for sink in sinks.values():
            _call(sink, died)
        for _, future in calls:
            future.set_exception(died)

    def _serve(self) -> None:
        while True:
            work = self._wait_for_work()
            if work is None:
                return
            submissions, aborts, calls = work
            with self._cond:
                took = self._take_engine()
            if not took:
                refusal = ("the engine holds requests added with engine.add_request; step them to completion "
                           "(engine.step()) or abort them before generating through LLM/AsyncLLM")
                for submission in submissions:
                    self._fail(submission.request_id, RuntimeError(refusal))
                for _, future in calls:
                    future.set_exception(RuntimeError(refusal))
                for request_id, sink in aborts:  # never added: nothing to stop
                    if sink is not None:
                        _call(sink, _aborted_before_added(request_id))
                continue
            for submission in submissions:
                self._add(submission)
            for request_id, sink in aborts:
                self._abort(request_id, sink)
            self._run_calls(calls)
            if self.engine.has_unfinished_requests():
                self._step()
            self._publish_stats()
            with self._cond:
                self._release_if_done()

    def _wait_for_work(self):
        """Sleep until there is something to do; hand the engine back and return None after
        ``idle_exit_s`` with nothing to do (the thread then ends)."""
        with self._cond:
            deadline = None
            while not (self._submissions or self._aborts or self._calls or self._engine_busy()):
                if deadline is None:
                    deadline = time.monotonic() + self.idle_exit_s
                remaining = 0 if self._closing else deadline - time.monotonic()
                if remaining <= 0:
                    self._thread = None
                    return None
                self._cond.wait(remaining)
            submissions, aborts, calls = list(self._submissions), list(self._aborts), list(self._calls)
            self._submissions.clear()
            self._aborts.clear()
            self._calls.clear()
            return submissions, aborts, calls

    def _release_if_done(self) -> None:
        """With none of the loop's requests left, direct engine use is allowed again. Called under the
        lock before a request's last output is handed over, so its caller sees the engine free."""
        if not (self._sinks or self._submissions or self._aborts):
            self.engine.owner_thread = None

    def _engine_busy(self) -> bool:
        return self.engine.owner_thread is threading.current_thread() and self.engine.has_unfinished_requests()

    def _take_engine(self) -> bool:
        """Own the engine, unless it holds requests added directly (``engine.add_request``): the loop
        would step them with no one to receive their outputs, so it refuses rather than consume them."""
        me = threading.current_thread()
        if self.engine.owner_thread is not me:
            if self.engine.num_unfinished_requests():
                return False
            self.engine.owner_thread = me
        return True

    def _run_calls(self, calls) -> None:
        for fn, future in calls:
            try:
                future.set_result(fn(self.engine))
            except Exception as err:  # the caller gets it; the loop goes on
                future.set_exception(err)

    def _abort(self, request_id: str, sink: Sink | None) -> None:
        final = self.engine.abort_request(request_id)
        if sink is not None:
            _call(sink, final if final is not None else _aborted_before_added(request_id))

    def _add(self, submission: _Submission) -> None:
        with self._cond:
            if self._sinks.get(submission.request_id) is not submission.sink:
                return  # aborted before it was added: _abort answers it
        try:
            self.engine.add_request(submission.request_id, submission.request)
        except Exception as err:  # refused by the engine: its caller hears why, the loop goes on
            self._fail(submission.request_id, err)
            return
        self._prompt_tokens += len(submission.request.prompt_token_ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # one failed step fails its requests, never the loop
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(err)
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        with self._cond:
            sink = self._sinks.pop(output.request_id, None) if output.finished else self._sinks.get(output.request_id)
            self._release_if_done()
        if sink is not None:
            _call(sink, output)

    def _fail(self, request_id: str, err: BaseException) -> None:
        with self._cond:
            sink = self._sinks.pop(request_id, None)
            self._release_if_done()
        if sink is not None:
            _call(sink, err)

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already in trouble; the caller hears about err
                logger.exception("abort of %s after a failed step", request_id)
            _call(sink, err)

    def _publish_stats(self) -> None:
        replicas = getattr(self.engine, "replicas", [self.engine])
        schedulers = [r.scheduler for r in replicas]
        self.stats = LoopStats(
            running=sum(len(s.running) for s in schedulers),
            waiting=sum(len(s.waiting) for s in schedulers) + len(self._submissions),
            pages_in_use=sum(s.allocator.num_used_pages for s in schedulers),
            pages_total=sum(s.allocator.num_usable_pages for s in schedulers),  # page 0 is scratch
            prefix_cache_hit_tokens=sum(s.prefix_cache_hit_tokens for s in schedulers),
            prefix_cache_queried_tokens=sum(s.prefix_cache_queried_tokens for s in schedulers),
            num_preemptions=sum(s.num_preemptions for s in schedulers),
            prompt_tokens=self._prompt_tokens)


_LIVE_LOOPS: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()
_exit_handler_registered = False


def _close_at_exit(loop: EngineLoop) -> None:
    """Close ``loop`` when the interpreter exits, before daemon threads are frozen: a loop thread
    still inside XLA's C++ at that moment (a script that exits right after its last call) is unwound
    by force and the process aborts ("FATAL: exception not rethrown") after its work is done.
    Registered on first use, after JAX's own exit handlers, so it runs before them."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(close_live_loops)
        _exit_handler_registered = True
    _LIVE_LOOPS.add(loop)


def close_live_loops() -> None:
    """Close every engine loop that started a thread and is still alive (at exit, and by test runners)."""
    for loop in list(_LIVE_LOOPS):
        try:
            loop.close(timeout_s=10.0)
        except Exception:  # exiting anyway: never turn a clean exit into an error
            logger.debug("closing an engine loop at exit failed", exc_info=True)


def _aborted_before_added(request_id: str) -> RequestOutput:
    """The final output of a request aborted before the engine held it: nothing generated."""
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], finished=True)


def _call(sink: Sink, item) -> None:
    try:
        sink(item)
    except Exception:  # a caller that went away (closed event loop) must not stop the loop
        logger.debug("an output sink failed", exc_info=True)
