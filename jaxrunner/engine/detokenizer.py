"""Incremental detokenization and stop-string matching for one request (host side, no JAX).

Decoding the whole output every step is quadratic; like vLLM we decode only a short window
(``prefix_offset`` … end) and emit the text past ``read_offset`` once it no longer ends in an
incomplete UTF-8 sequence (U+FFFD), so multi-byte characters split across tokens come out whole.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.text = ""
        self._tokens: list[int] = list(prompt_token_ids[-6:])  # context so word boundaries decode right
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def append(self, token_id: int) -> str:
        """Add one generated token; returns the newly readable text (possibly empty)."""
        if self.tokenizer is None:
            return ""
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self.text += delta
        return delta

    def find_stop(self, delta_len: int) -> str | None:
        """The stop string that now appears in the text, trimming the text at its start."""
        if not self.stop or delta_len == 0:
            return None
        for stop in self.stop:
            # Only the tail can hold a new match: the delta plus a stop string's length before it.
            window_start = max(0, len(self.text) - delta_len - len(stop) + 1)
            at = self.text.find(stop, window_start)
            if at != -1:
                self.text = self.text[:at]
                return stop
        return None
