"""The engine's one door to the devices: the executor protocol (no JAX on this side).

The engine plans steps on the host and hands each plan to an executor; it never sees arrays,
meshes, buckets or executables. ``jaxrunner.runner.executor.Executor`` implements this protocol
for one row of the mesh (one device, or ``tensor_parallel_size`` devices); data parallelism is
one executor per row, each with its own scheduler in the engine. ``jaxrunner.runner.builder``
loads the model and starts the executors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class SamplingLimits:
    """The widths of the sampler's per-row arrays: a request asking for more is refused when added."""

    max_logprobs: int           # logprobs and prompt_logprobs per token
    max_logit_bias: int         # logit_bias entries per request
    max_allowed_token_ids: int  # allowed_token_ids per request
    max_banned_tokens: int      # banned per row and step: bad words, and stop ids + EOS under min_tokens


# Structured output crosses this door as a token bitmask per sampled row: bit t % 32 of int32 word
# t // 32 allows token t (llguidance's layout); FREE_ROW words allow every token.
FREE_ROW = -1


def bitmask_words(vocab_size: int) -> int:
    """Words of one row of token bitmask over ``vocab_size`` logits."""
    return (vocab_size + 31) // 32


class StepHandle(Protocol):
    """A dispatched step, possibly still running on the devices."""

    num_seq_rows: int  # rows of the sampled outputs that belong to sequences; draft rows follow


class Executor(Protocol):
    """What the engine asks of the runner side."""

    model: Any                       # the served model (opaque here: config, tokenizer, params)
    tokenizer: Any                   # a transformers-style tokenizer, or None
    vocab_size: int
    eos_token_ids: tuple[int, ...]   # the model's EOS ids and the tokenizer's
    max_model_len: int               # what the KV pool and the model's positions allow
    page_size: int
    num_pages: int
    max_num_spec_seqs: int           # sequences with proposals one step can verify
    draft_proposer: Any              # a spec_decode.Proposer running a draft model, or None
    limits: SamplingLimits
    synchronous: bool                # several processes drive one mesh: steps must not overlap
    startup_report: dict

    def execute(self, plan, feed_rows: dict | None) -> StepHandle:
        """Pack ``plan`` (a scheduler ``StepPlan``) and dispatch it without waiting. ``feed_rows``:
        requests whose last token is still on the device, and its row in the step in flight."""

    def fetch(self, handle: StepHandle, prompt_logprobs: bool) -> dict[str, Sequence]:
        """Wait for a step; its sampled rows as host arrays (tokens, logprobs, ranks, top ids ...)."""

    @property
    def params(self) -> Any:
        """The params pytree being served."""

    def check_weights(self, params) -> None:
        """``ValueError`` naming the leaf if ``params`` cannot replace the served ones."""

    def update_weights(self, params) -> None:
        """Serve ``params`` from the next step on (checked first with ``check_weights``)."""
