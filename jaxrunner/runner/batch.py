"""A ``StepInput`` from the engine → the step's ``StepBatch`` at a bucket's shape.

The engine describes each scheduled chunk as an ``executor_protocol.SequenceInput`` (its tokens,
pages, context length, prompt-logprob targets, sampling row and proposals); ``step_batch.lay_out``
places them. Warm-up's dummies go through the same layout, so what serving sends is what warm-up
compiled.

Async scheduling: a token sampled by the step still on the device is not known to the engine. Its
slot in ``token_ids`` holds 0 and its feed row names the row of the previous step's sampled tokens
that the jitted step reads instead (``NO_FEED`` everywhere else).

Speculative decoding: a sequence's proposed tokens follow its known ones; ``lay_out`` gives each a
draft row (the token row it reads, its sequence, the position it samples, the proposal it checks).
The sampled outputs hold the sequences' own rows first, then the draft rows in sequence order.
"""
from __future__ import annotations

from jaxrunner.executor_protocol import StepInput
from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.step_batch import StepBatch, lay_out


def pack_step(step: StepInput, bucket: Bucket, page_size: int, vocab_size: int,
              max_prefill_seqs: int | None = None, lora: bool = False) -> StepBatch:
    """Lay out the step's sequences (decodes and prefill chunks alike) back to back.

    ``max_prefill_seqs`` is the bound the executables were compiled with: a step that breaks it
    would silently drop attention blocks, so it is refused here. ``lora``: the runner has adapter
    slots (every row names one).
    """
    multi = step.num_multi_token_queries
    if max_prefill_seqs is not None and multi > max_prefill_seqs:
        raise RuntimeError(f"step has {multi} multi-token queries, the executables allow {max_prefill_seqs}")
    return lay_out(bucket, page_size, vocab_size, step.sequences, lora)
