"""vLLM-shaped results: ``RequestOutput`` holding one ``CompletionOutput`` per sample."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One token's entry in a logprobs dict, as vLLM's: its logprob in the model's raw distribution,
    its rank there (1 = most likely) and its text (None when the model has no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token_id: Logprob} for the actual (sampled or prompt) token and the top-k tokens.
LogprobsDict = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # with SamplingParams.logprobs only, as vLLM reports it
    # With SamplingParams.logprobs=k: per generated token, the sampled token and the top-k.
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first token and finished, as vLLM's
    (``time.monotonic()`` seconds; None: not yet)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


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
    # With SamplingParams.prompt_logprobs=k: per prompt token, the token and the top-k; None at
    # position 0 (nothing predicts the first token), as in vLLM.
    prompt_logprobs: list[LogprobsDict | None] | None = None
    metrics: RequestMetrics | None = None
    # Speculative decoding: tokens proposed for this request so far, and those the model accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (None when nothing was proposed)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None
