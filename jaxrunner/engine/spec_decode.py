"""Speculative decoding, host side: the proposer protocol and the n-gram (prompt lookup) proposer.

A proposer guesses the next few tokens of a request cheaply; the model then checks all of them in
one step (a chunk of 1 + k query tokens, see ``Scheduler`` and ``runner.batch``), and the sampler
keeps the target distribution exactly (``runner.sampler``: greedy rows accept while the guess is
the argmax, sampled rows by rejection sampling). So a wrong guess costs only the extra query rows.

Planning a step marks the requests whose next decode should get guesses (``ScheduledChunk.propose``);
the guesses are made after the step: by the engine with ``NgramProposer`` here, or by the runner's
draft model behind ``Executor.fetch`` (``runner.draft_proposer``: it runs a model, for all of them in
one batch). Both implement ``executor_protocol.Proposer``.

``NgramProposer`` needs no model: the most recent ``n`` tokens (``n`` from ``max_n`` down to
``min_n``, as vLLM's ``ngram`` method) are looked up in the request's prompt + output, and the
tokens that followed their last earlier occurrence (with k successors, where one has them) are
proposed. Repetitive text (quoting the
prompt, editing code, lists) is where this pays.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# The lookup scans at most this many of the most recent tokens: its cost per step stays bounded
# however long the request grows.
MAX_LOOKBACK_TOKENS = 2048


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min={min_n}, prompt_lookup_max={max_n}: need 1 <= min <= max")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose_many(self, queries: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        return [self.propose(token_ids, limit) for _, token_ids, limit in queries]

    def forget(self, request_id: str) -> None:
        pass  # it keeps nothing

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` tokens guessed to follow ``token_ids``
        (empty when no n-gram of the allowed sizes occurred before)."""
        k = self.num_speculative_tokens if limit is None else min(limit, self.num_speculative_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-MAX_LOOKBACK_TOKENS:], np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start early enough to have a successor: any occurrence but the suffix itself
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                # the last occurrence, unless it is too recent to have k successors and an
                # earlier one has them (a short period: "4 4 4 4" proposes more than one 4)
                full = matches[matches + n + k <= len(tokens)]
                follow = (full[-1] if len(full) else matches[-1]) + n
                return tokens[follow:follow + k].tolist()
        return []
