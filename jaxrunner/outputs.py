"""vLLM-shaped results: ``RequestOutput`` holding one ``CompletionOutput`` per sample."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # With SamplingParams.logprobs=k: per generated token, {token_id: logprob} for the sampled token
    # and the top-k tokens.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Text added since the previous output of this request (what a stream prints).
    delta_text: str = ""
