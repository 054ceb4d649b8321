"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``.

Everything that needs no model is checked once, here, so the scheduler, the engine and the
on-device sampler can take the values as given. What needs the model (token ids against the
vocabulary, ``logprobs`` against the engine's ``max_logprobs``, the fixed widths of the sampler's
per-row arrays) is checked by ``LLMEngine.check_sampling_params`` before a request is queued.
Every rejection is a ``ValueError`` that names the field and the bad value, because these errors
travel straight back to the user (CLI, ``LLM.generate``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

# Below this temperature sampling is argmax: dividing logits by ~0 would overflow.
GREEDY_TEMPERATURE = 1e-5
# Above this temperature every token is about equally likely; larger values only risk overflow in
# the sampler's float32 arithmetic (logits / temperature), so they are refused.
MAX_TEMPERATURE = 1e4
# Seeds are 64-bit (both halves feed the sampler's key), as torch generators take them in vLLM.
SEED_RANGE = (0, 2**64)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM spells it: exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark,
    or llama.cpp's GBNF) or ``json_object`` (any JSON object). The engine compiles it with
    llguidance when the request is added; a schema or grammar that does not compile is refused then."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False         # JSON: no whitespace beyond one separator form
    disable_additional_properties: bool = False  # JSON: objects get only the properties the schema names
    whitespace_pattern: str | None = None        # JSON: the regex whitespace must match

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        _require(len(given) == 1, "structured_outputs", given or None,
                 f"must set exactly one of {', '.join(CONSTRAINT_KINDS)}", prefix="")
        if self.json is not None:
            _require(isinstance(self.json, (str, dict)), "structured_outputs.json", type(self.json).__name__,
                     "must be a JSON schema (a dict or its JSON text)", prefix="")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value != ""), f"structured_outputs.{name}",
                     value, "must be a non-empty string", prefix="")
        if self.choice is not None:
            _require(not isinstance(self.choice, (str, bytes, dict)) and len(self.choice) > 0
                     and all(isinstance(c, str) and c != "" for c in self.choice),
                     "structured_outputs.choice", self.choice, "must be a non-empty list of non-empty strings",
                     prefix="")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, bool), f"structured_outputs.{name}", value,
                     "must be True or False", prefix="")

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """vLLM's request field ``structured_outputs`` (a JSON object); unknown keys are refused."""
        if isinstance(value, cls):
            return value
        _require(isinstance(value, dict), "structured_outputs", value, "must be an object", prefix="")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _require(not unknown, "structured_outputs", unknown, f"unknown keys; valid: {sorted(known)}", prefix="")
        return cls(**value)


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's logprob plus the top-k, per sampled token
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (vLLM semantics)
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex ...)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: up to max_model_len)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_floats()
        self._check_bools()
        self._normalize_stops()
        self._normalize_token_options()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

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
        _require(self.top_k >= -1, "top_k", self.top_k, "must be 0 or -1 (disabled) or at least 1")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            _require(self.max_tokens >= 1, "max_tokens", self.max_tokens,
                     "must be at least 1 (or None: up to max_model_len)")
        _require_int("min_tokens", self.min_tokens)
        upper = "max_tokens" if self.max_tokens is None else f"max_tokens={self.max_tokens}"
        _require(self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                 "min_tokens", self.min_tokens, f"must be in [0, {upper}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                _require(value >= 0, name, value, "must be >= 0 (or None)")
        if self.truncate_prompt_tokens is not None:
            _require_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            _require(self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
                     self.truncate_prompt_tokens, "must be at least 1, or -1 (up to max_model_len), or None")
        if self.seed is not None:
            _require_int("seed", self.seed)
            low, high = SEED_RANGE
            _require(low <= self.seed < high, "seed", self.seed, "must be in [0, 2**64) (or None)")

    def _check_floats(self) -> None:
        _require_number("temperature", self.temperature)
        _require(0 <= self.temperature <= MAX_TEMPERATURE, "temperature", self.temperature,
                 f"must be in [0, {MAX_TEMPERATURE:g}]")
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

    def _check_bools(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "must be True or False")

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

    def _normalize_token_options(self) -> None:
        """logit_bias, allowed_token_ids, bad_words: checked and copied (ids against the vocabulary
        later, by the engine)."""
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                     "must be a dict {token_id: bias}")
            for token, bias in self.logit_bias.items():
                _require(_is_int(token) and token >= 0, "logit_bias", self.logit_bias,
                         "keys must be non-negative int token ids")
                _require(isinstance(bias, numbers.Real) and not isinstance(bias, bool) and math.isfinite(bias),
                         "logit_bias", self.logit_bias, "values must be finite numbers")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            _require(not isinstance(self.allowed_token_ids, (str, bytes, dict)), "allowed_token_ids",
                     self.allowed_token_ids, "must be a list of token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
            _require(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids,
                     "must hold at least one token id (or be None)")
            for t in self.allowed_token_ids:
                _require(_is_int(t) and t >= 0, "allowed_token_ids", self.allowed_token_ids,
                         "must hold non-negative ints")
        if self.bad_words is not None:
            _require(not isinstance(self.bad_words, (str, bytes, dict)), "bad_words", self.bad_words,
                     "must be a list of strings")
            self.bad_words = list(self.bad_words)
            for word in self.bad_words:
                _require(isinstance(word, str) and word.strip() != "", "bad_words", self.bad_words,
                         "must hold non-blank strings")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(ok: bool, field: str, value, why: str, prefix: str = "SamplingParams.") -> None:
    if not ok:
        raise ValueError(f"{prefix}{field}={value!r}: {why}")


def _require_int(field: str, value) -> None:
    _require(_is_int(value), field, value, "must be an int")


def _require_number(field: str, value) -> None:
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(is_real and not math.isnan(value), field, value, "must be a number")
