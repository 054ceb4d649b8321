"""Prometheus metrics of one server, under vLLM's names and labels, so a dashboard made for vLLM
(every series labelled ``model_name``) reads this server unchanged.

Two kinds: the engine loop's state, read at scrape time (requests running and waiting, KV cache
usage, prefix-cache queries and hits, preemptions), and per-request figures recorded as each request
ends (TTFT, inter-token latency, end-to-end, queue, prefill and decode time, token counts, finish
reasons, speculative-decoding tokens). ``jaxrunner:kv_cache_pages_used``/``_free`` add what vLLM has
no name for. Each server has its own registry, so several servers in one process (tests) do not
collide.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxrunner.engine.loop import EngineLoop
from jaxrunner.outputs import RequestOutput

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _LoopStateCollector:
    """The engine loop's published state, as gauges and counters, at every scrape."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        stats, label = self.metrics.loop_stats(), [self.metrics.model_name]

        def family(kind, name, doc, value):
            metric = kind(name, doc, labels=["model_name"])
            metric.add_metric(label, float(value))
            return metric

        total = stats.pages_total if stats is not None else 0
        used = stats.pages_in_use if stats is not None else 0
        value = (lambda name: 0 if stats is None else getattr(stats, name))  # noqa: E731
        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the engine's running set.",
                     value("running"))
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                     value("waiting"))
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (0 to 1).",
                     used / total if total else 0.0)
        yield family(GaugeMetricFamily, "jaxrunner:kv_cache_pages_used", "KV cache pages held by requests.", used)
        yield family(GaugeMetricFamily, "jaxrunner:kv_cache_pages_free",
                     "KV cache pages free (cached prefixes count as free).", total - used)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     value("prefix_cache_queried_tokens"))
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                     value("prefix_cache_hit_tokens"))
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Requests preempted (pages given up).",
                     value("num_preemptions"))


class ServerMetrics:
    def __init__(self, model_name: str = "model"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._loop: EngineLoop | None = None
        self.registry.register(_LoopStateCollector(self))

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive outputs.", _ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Decode time per output token of each request.",
                              _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last output.", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last.", _REQUEST_BUCKETS)
        self.prompt_lengths = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.output_lengths = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                        _TOKEN_BUCKETS)
        self.max_output_lengths = histogram("vllm:request_max_num_generation_tokens",
                                            "The most tokens each request could generate (max_tokens).", _TOKEN_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens the model accepted.")
        self.requests = Counter("vllm:request_success", "Requests finished, by reason (abort included).",
                                ["model_name", "finished_reason"], registry=self.registry)

    def attach(self, loop: EngineLoop) -> None:
        self._loop = loop

    def loop_stats(self):
        return None if self._loop is None else self._loop.stats

    def finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Records one request's latencies as its outputs arrive, and its figures when it ends."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, max_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.start = time.perf_counter()
        self.last: float | None = None
        self.generated = 0
        self.done = False

    def output(self, generated_tokens: int) -> None:
        self.generated = generated_tokens
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finished(self, output: RequestOutput) -> None:
        """The request's last output: its lengths, engine timings and finish reason."""
        if self.done:
            return
        completion = output.outputs[0]
        self._count(len(completion.token_ids), completion.finish_reason or "abort")
        timing = output.metrics
        if timing is not None and timing.finished_time is not None:
            self.metrics.e2e.observe(timing.finished_time - timing.arrival_time)
            if timing.first_scheduled_time is not None:
                self.metrics.queue.observe(timing.first_scheduled_time - timing.arrival_time)
                if timing.first_token_time is not None:
                    self.metrics.prefill.observe(timing.first_token_time - timing.first_scheduled_time)
            if timing.first_token_time is not None:
                decode = timing.finished_time - timing.first_token_time
                self.metrics.decode.observe(decode)
                if len(completion.token_ids) > 1:
                    self.metrics.tpot.observe(decode / (len(completion.token_ids) - 1))
        self.metrics.draft_tokens.inc(output.num_draft_tokens)
        self.metrics.accepted_tokens.inc(output.num_accepted_draft_tokens)

    def aborted(self) -> None:
        """Stopped before its last output (the client left, or the server is shutting down)."""
        self._count(self.generated, "abort")

    def _count(self, generated_tokens: int, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)
        self.metrics.prompt_lengths.observe(self.prompt_tokens)
        self.metrics.output_lengths.observe(generated_tokens)
        self.metrics.max_output_lengths.observe(self.max_tokens)
        self.metrics.finished(reason)
