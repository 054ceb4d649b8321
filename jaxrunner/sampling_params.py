"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``.

Everything is checked once, here, so the scheduler, the engine and the on-device sampler can take
the values as given. Every rejection is a ``ValueError`` that names the field and the bad value,
because these errors travel straight back to the user (CLI, ``LLM.generate``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# Below this temperature sampling is argmax: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # return the top-k logprobs per sampled token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_floats()
        self._normalize_stops()

    @property
    def greedy(self) -> bool:
        """True when the sampler should take the argmax (temperature is, in effect, 0)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """True when sampling reads the request's past tokens (repetition/presence/frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    # -- validation ---------------------------------------------------------------------------

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        _require(self.n >= 1, "n", self.n, "must be at least 1")
        _require_int("top_k", self.top_k)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k,
                 "must be -1 (disabled) or at least 1")
        _require_int("max_tokens", self.max_tokens)
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be at least 1")
        _require_int("min_tokens", self.min_tokens)
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                 f"must be in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            _require(self.logprobs >= 0, "logprobs", self.logprobs, "must be >= 0")
        if self.seed is not None:
            _require_int("seed", self.seed)

    def _check_floats(self) -> None:
        _require_number("temperature", self.temperature)
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _require_number("top_p", self.top_p)
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require_number("min_p", self.min_p)
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _require_number("repetition_penalty", self.repetition_penalty)
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
                 "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            _require(-2 <= value <= 2, name, value, "must be in [-2, 2]")

    def _normalize_stops(self) -> None:
        """Accept a single stop string (as vLLM does) and copy lists so callers can't alias them."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = list(self.stop)
            for s in self.stop:
                _require(isinstance(s, str) and s != "", "stop", self.stop,
                         "must hold non-empty strings")
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
            for t in self.stop_token_ids:
                _require(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids,
                         "must hold non-negative ints")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}={value!r}: {why}")


def _require_int(field: str, value) -> None:
    _require(_is_int(value), field, value, "must be an int")


def _require_number(field: str, value) -> None:
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(is_real and not math.isnan(value), field, value, "must be a number")
