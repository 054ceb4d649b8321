"""The door between the engine and the runner: the executor protocol and the messages it carries.

The engine (``jaxrunner.engine``, host only) plans a step and describes it as a ``StepInput``: per
scheduled chunk a ``SequenceInput`` (request id, token ids, pages, context length, the settings of
the token it samples as a ``SamplingRow`` computed on the engine side, bans and masks included).
The runner (``jaxrunner.runner.executor.Executor``) lays it out at a bucket's shape, dispatches
one device call and hands back a ``SampledRows`` of host arrays. No ``Request`` object crosses, and
neither side imports the other: both import this module, which imports neither JAX nor them.

Token-id conventions shared by both sides: ``NO_TOKEN`` pads token-id arrays, ``NO_LOGPROBS``
asks for no logprobs, ``NO_FEED`` marks a token known on the host. Structured output crosses as a
token bitmask per sampled row: bit ``t % 32`` of int32 word ``t // 32`` allows token ``t``
(llguidance's layout); ``FREE_ROW`` words allow every token.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

NO_TOKEN = -1     # padding in token-id arrays (history, banned tokens, prompt targets, proposals)
NO_LOGPROBS = -1  # num_logprobs of a row that asks for none (0 asks for the sampled token's only)
NO_FEED = -1      # feed row of a token known on the host
FREE_ROW = -1     # a token-bitmask word allowing all 32 of its tokens


def bitmask_words(vocab_size: int) -> int:
    """Words of one row of token bitmask over ``vocab_size`` logits."""
    return (vocab_size + 31) // 32


@dataclasses.dataclass(frozen=True)
class SamplingLimits:
    """The widths of the sampler's per-row arrays: a request asking for more is refused when added."""

    max_logprobs: int           # logprobs and prompt_logprobs per token
    max_logit_bias: int         # logit_bias entries per request
    max_allowed_token_ids: int  # allowed_token_ids per request
    max_banned_tokens: int      # banned per row and step: bad words, and stop ids + EOS under min_tokens


# ----------------------------------------------------------------------------- engine -> runner
@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """The settings of one sequence's next token. The runner writes each field into the sampler's
    column of the same name (a token-id list into the row's first entries). Defaults are "off"."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seeds: int = 0                            # low half of the request's 64-bit seed
    seeds_high: int = 0                       # its high half
    prompt_lens: int = 0                      # history's first prompt_lens ids are the prompt
    history: Sequence[int] = ()               # prompt + output ids, for penalties (else empty)
    banned: Sequence[int] = ()                # ids that may not be sampled next
    allowed_token_ids: Sequence[int] = ()     # the only ids allowed (empty: all)
    logit_bias_ids: Sequence[int] = ()
    logit_bias_values: Sequence[float] = ()
    num_logprobs: int = NO_LOGPROBS
    token_bitmask: Sequence[int] = ()         # a whole row (structured output), or () for no constraint


@dataclasses.dataclass(frozen=True)
class SequenceInput:
    """One sequence's part of a step. Its query holds positions ``[kv_len - q, kv_len)``, q the
    number of its tokens."""

    token_ids: np.ndarray  # [q] int32: the tokens computed, its proposals last (0 where fed from the device)
    feed_rows: np.ndarray  # [q] int32: the previous step's sampled row whose id replaces the token, or NO_FEED
    kv_len: int            # the sequence's cached tokens once the step is done (context + query)
    pages: np.ndarray      # [>= ceil(kv_len / page_size)] int32: its pages; position p is in pages[p // page_size]
    prompt_targets: np.ndarray | None = None  # [q] int32: next prompt token per row (prompt logprobs), NO_TOKEN
    sampling: SamplingRow | None = None       # settings of the token it samples; None: no row sampled
    num_drafts: int = 0    # its last num_drafts tokens are proposals, each checked by a draft row
    draft_bitmasks: np.ndarray | None = None  # [num_drafts, words]: each draft row's allowed tokens (None: all)
    request_id: str = ""   # whose it is (named in the runner's errors; the draft model keys its cache by it)
    propose: int = 0       # a runner that drafts guesses up to this many tokens to follow this step's (see Executor)
    history: np.ndarray | None = None  # [n] int32: the request's tokens before this step's, when propose > 0
    lora_slot: int = 0     # the adapter slot its rows run with (Executor.load_lora_slot); 0: no adapter


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step: its sequences back to back. The sampled rows come back in this order, then one
    draft row per proposal, in sequence order."""

    sequences: tuple[SequenceInput, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    @property
    def num_multi_token_queries(self) -> int:
        """Sequences with more than one query token (prefill chunks and verified proposals): the
        attention executables are compiled for a bounded number of them."""
        return sum(len(seq.token_ids) > 1 for seq in self.sequences)

    @property
    def widest(self) -> int:
        """Pages of the sequence holding the most."""
        return max(len(seq.pages) for seq in self.sequences)


# ----------------------------------------------------------------------------- runner -> engine
@dataclasses.dataclass(frozen=True)
class SampledRows:
    """A step's sampled rows as host arrays: the sequences' rows first (``StepInput`` order), then
    the draft rows. ``k`` is the sampler's widest top-logprobs. The per-token prompt fields are
    ``None`` unless the step wanted prompt logprobs (row t: the prompt token after token row t)."""

    tokens: np.ndarray        # [rows] int32
    logprobs: np.ndarray      # [rows] float32: of the sampled token
    ranks: np.ndarray         # [rows] int32: its rank (1 is the most likely)
    top_ids: np.ndarray       # [rows, k] int32
    top_logprobs: np.ndarray  # [rows, k] float32
    prompt_logprobs: np.ndarray | None = None      # [T] float32
    prompt_ranks: np.ndarray | None = None         # [T] int32
    prompt_top_ids: np.ndarray | None = None       # [T, k] int32
    prompt_top_logprobs: np.ndarray | None = None  # [T, k] float32
    proposals: np.ndarray | None = None            # [sequences, k'] int32, NO_TOKEN-padded: the drafter's guesses


def accepted_tokens(draft_token_ids: Sequence[int], row_tokens: Sequence[int]) -> list[int]:
    """The tokens a sequence gains from a step that verified ``draft_token_ids``: ``row_tokens`` are
    its sampled rows, the rows checking each proposal first, its own row last. The walk keeps each
    sampled token and stops after the first that differs from the proposal its row checked (that
    token replaces the proposal), or after the last row. One rule for the engine, which appends
    them, and a drafting runner, which proposes after them."""
    tokens = []
    for index, token in enumerate(row_tokens):
        tokens.append(int(token))
        if index == len(draft_token_ids) or int(token) != draft_token_ids[index]:
            break
    return tokens


# ----------------------------------------------------------------------------- the protocol
class Proposer(Protocol):
    """Speculative decoding's guesser: n-gram lookup, which the engine runs on the host
    (``engine.spec_decode``), or a draft model, which the runner runs behind ``Executor.fetch``
    (``runner.draft_proposer``). Either guesses after a step, for the next one."""

    def propose_many(self, queries: Sequence[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each ``(request_id, token_ids, limit)``: at most ``limit`` tokens guessed to follow
        ``token_ids`` (the request's prompt and outputs); an empty list for no guess."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the proposer keeps for it."""


class StepHandle(Protocol):
    """A dispatched step, possibly still running on the devices."""

    num_seq_rows: int  # rows of the sampled outputs that belong to sequences; draft rows follow


class Executor(Protocol):
    """What the engine asks of the runner side (one mesh row)."""

    model: Any                       # the served model, opaque to the engine (front ends read its config)
    tokenizer: Any                   # a transformers-style tokenizer, or None
    vocab_size: int
    eos_token_ids: tuple[int, ...]   # the model's EOS ids and the tokenizer's
    max_model_len: int               # what the KV pool and the model's positions allow
    page_size: int
    num_pages: int
    max_num_spec_seqs: int           # sequences with proposals one step can verify
    drafts: bool                     # a draft model guesses after each step (SequenceInput.propose)
    limits: SamplingLimits
    synchronous: bool                # several processes drive one mesh: steps must not overlap
    startup_report: dict
    max_loras: int                   # adapter slots on the device (0: LoRA disabled)

    def execute(self, step: StepInput) -> StepHandle:
        """Lay out ``step`` and dispatch it without waiting."""

    def fetch(self, handle: StepHandle, prompt_logprobs: bool) -> SampledRows:
        """Wait for a step; its sampled rows on the host (the prompt fields only when asked). A runner
        that ``drafts`` then guesses, for each sequence with ``propose``, up to that many tokens to
        follow its ``history`` and the tokens the step gave it (``accepted_tokens``): ``proposals``."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the runner keeps for it (the draft model's cache)."""

    @property
    def params(self) -> Any:
        """The params pytree being served."""

    def check_weights(self, params: Any) -> None:
        """``ValueError`` naming the leaf if ``params`` cannot replace the served ones."""

    def update_weights(self, params: Any) -> None:
        """Serve ``params`` from the next step on (checked first with ``check_weights``)."""

    def load_adapter(self, name: str, source: Any) -> Any:
        """A LoRA adapter read and checked against the model, laid out for a slot (opaque to the
        engine): ``source`` a PEFT directory, ``(tensors, rank, alpha, use_rslora)`` of PEFT-named
        arrays, or a list of one slot's factors per layer (``models.lora.new_adapter``).
        ``ValueError`` naming what does not fit."""

    def load_lora_slot(self, slot: int, adapter: Any) -> None:
        """Put ``adapter`` (from ``load_adapter``) into ``slot`` (1..max_loras) for the steps
        dispatched from now on."""
