"""Incremental detokenization, stop strings and stream hold-back for one request (host side, no JAX).

Decoding the whole output every step is quadratic. Where the tokenizer is backed by the
``tokenizers`` library, its ``DecodeStream`` decodes one token at a time (it keeps the few tokens
it needs for word boundaries and multi-byte characters itself); otherwise a short window is
decoded twice per token, as vLLM's older detokenizer did. Both start from the last prompt tokens so
that the first output token decodes with the spacing it has after the prompt.

Streaming is exact: text that could still turn out to be the start of a stop string is held back
from the stream until it cannot, so a stop string that spans tokens is never emitted in part
(unless ``include_stop_str_in_output``, where the stop string is part of the output anyway).
"""
from __future__ import annotations

import inspect

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the output, for word boundaries


class _WindowDecoder:
    """Decode ``prefix_offset … end`` twice per token: with and without the newest tokens."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        # an incomplete UTF-8 sequence decodes to U+FFFD: wait for the token that completes it
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return full_text[len(prefix_text):]


class _StreamDecoder:
    """``tokenizers.decoders.DecodeStream``: one decode per token, in Rust."""

    def __init__(self, backend, stream_type, context: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._stream = stream_type(ids=list(context), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def _decode_stream_type():
    """``DecodeStream`` if this ``tokenizers`` has it and it takes context ids, else None."""
    try:  # lazy: the engine loads no tokenizer library; an older tokenizers lacks DecodeStream
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    try:
        takes_ids = "ids" in inspect.signature(DecodeStream).parameters
    except (TypeError, ValueError):  # a builtin without a readable signature: try it
        try:
            DecodeStream(ids=[], skip_special_tokens=False)
            takes_ids = True
        except TypeError:
            takes_ids = False
    return DecodeStream if takes_ids else None


def make_decoder(tokenizer, context: list[int], skip_special_tokens: bool):
    """The faster decoder this tokenizer allows (``DecodeStream`` for ``tokenizers``-backed ones)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    stream_type = _decode_stream_type() if backend is not None else None
    if stream_type is not None:
        return _StreamDecoder(backend, stream_type, context, skip_special_tokens)
    return _WindowDecoder(tokenizer, context, skip_special_tokens)


def held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of some stop string (but not a
    whole one: a whole one would already have stopped the request)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class IncrementalDetokenizer:
    """The text of one request's output, its stop strings, and how much of it a stream may show.

    ``text`` is everything decoded so far (cut at a stop string once one is found); ``take_delta``
    hands out the part of it that can no longer change, once.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self._emitted = 0  # characters of ``text`` already handed out by take_delta
        self._decoder = None if tokenizer is None else make_decoder(
            tokenizer, list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens)

    def append(self, token_id: int) -> int:
        """Decode one generated token; returns how many characters ``text`` grew by."""
        if self._decoder is None:
            return 0
        delta = self._decoder.step(token_id)
        self.text += delta
        return len(delta)

    def find_stop(self, delta_len: int) -> str | None:
        """The stop string that the last ``delta_len`` characters completed, with ``text`` cut
        before it (or after it, with ``include_stop_str_in_output``). Of several, the one the text
        reached first: the earliest to end, then the earliest to start."""
        if not self.stop or delta_len == 0:
            return None
        found = None  # (end, start, stop)
        for stop in self.stop:
            # Only the tail can hold a new match: the delta plus a stop string's length before it.
            at = self.text.find(stop, max(0, len(self.text) - delta_len - len(stop) + 1))
            if at != -1:
                found = min(found or (at + len(stop), at, stop), (at + len(stop), at, stop))
        if found is None:
            return None
        end, start, stop = found
        self.text = self.text[:end if self.include_stop_str_in_output else start]
        return stop

    @property
    def output_text(self) -> str:
        """The text handed out so far: what an output may show without ever taking it back."""
        return self.text[:self._emitted]

    def take_delta(self, finished: bool) -> str:
        """The text that became final since the last call. Until the request finishes, an end of
        the text that may still grow into a stop string is held back."""
        end = len(self.text)
        if not finished and not self.include_stop_str_in_output:
            end -= held_back_length(self.text, self.stop)
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta
