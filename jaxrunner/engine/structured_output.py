"""Structured output on the host: constraints compiled by llguidance, one token bitmask per row.

A request with ``SamplingParams.structured_outputs`` gets a grammar matcher (``Request.grammar``)
when it is added. Before each step that samples its next token, the engine fills the request's
row of allowed tokens (``Request.next_token_bitmask``: ``ceil(vocab / 32)`` int32 words, bit
``t % 32`` of word ``t // 32`` set when token ``t`` may come next), and the jitted sampler masks
the logits with it. Every row of every step carries such a mask (all bits set: no constraint), so
constrained and free requests share one executable and warm-up compiles it with random masks.
The output processor feeds each sampled token back to the matcher, and a request whose grammar
can go no further stops there.

The matcher follows the host's tokens, so a constrained request's next mask needs its last token
on the host: while one is queued, steps run synchronously (``Request.needs_host_history``). With
speculative decoding each proposal's verifying row gets the mask at its own place (the matcher
walks the proposal and rolls back), so a proposal the grammar refuses is rejected there.

Grammars as vLLM's llguidance backend builds them: JSON schemas and ``json_object`` with flexible
whitespace unless ``disable_any_whitespace``; ``choice`` as an alternation of literals; ``grammar``
as Lark or GBNF (llguidance tells them apart).
"""
from __future__ import annotations

import json
import threading

import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np

from jaxrunner.executor_protocol import bitmask_words
from jaxrunner.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """Compiles one engine's constraints against its tokenizer (thread-safe: requests are validated
    on the server's threads). The llguidance tokenizer is built on first use (about a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._build_tokenizer()
            return self._ll_tokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None or not hasattr(self._tokenizer, "backend_tokenizer"):
            raise ValueError("structured_outputs: needs the model's fast (Rust) tokenizer, and this model has none")
        backend = self._tokenizer.backend_tokenizer
        n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self._eos_token_ids or None)

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of ``params``; a ``ValueError`` naming the field when it does not compile."""
        kind = params.kind
        field = f"structured_outputs.{kind}"
        try:
            text = _grammar_text(params)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{field}: {err}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer)
        if error:
            raise ValueError(f"{field}: does not compile: {error.strip()}")
        return text

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``grammar`` (one per request)."""
        return llguidance.LLMatcher(self.ll_tokenizer, grammar)

    def fill_bitmasks_along(self, matcher: llguidance.LLMatcher, proposal) -> list[np.ndarray]:
        """The masks after 0, 1, ... len(proposal) of the proposed tokens (len + 1 rows), the matcher
        left where it was. Past the first token the grammar refuses, the rows repeat the last mask:
        verification stops at that token (its mask excludes it), so they are never used."""
        valid = matcher.validate_tokens(list(proposal))
        masks = [self.fill_bitmask(matcher)]
        for token in proposal[:valid]:
            matcher.consume_token(token)
            masks.append(self.fill_bitmask(matcher))
        if valid:
            matcher.rollback(valid)
        return masks + [masks[-1]] * (len(proposal) - valid)

    def fill_bitmask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The tokens ``matcher`` allows next, as one bitmask row over the model's vocabulary."""
        full = llguidance_numpy.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        llguidance_numpy.fill_next_token_bitmask(matcher, full, 0)
        return full[0, :bitmask_words(self.vocab_size)].copy()


def _grammar_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        defaults = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = params.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    return llguidance.grammar_from("grammar", params.grammar)


def _no_additional_properties(schema):
    """``schema`` with ``additionalProperties: false`` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _no_additional_properties(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
