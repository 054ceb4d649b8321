"""The executor: one mesh row's model runner behind the engine's protocol (``jaxrunner/executor_protocol.py``).

It turns a scheduler's plan into one bucket-shaped batch and one device call, and hands back the
sampled rows as host arrays; the engine sees nothing else of the devices. Everything it needs is
decided at start-up (``runner/startup.py``): the KV pool, the buckets, the executables.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrunner.config import EngineConfig
from jaxrunner.executor_protocol import SampledRows, SamplingLimits, StepInput
from jaxrunner.runner import weights
from jaxrunner.runner.batch import pack_step
from jaxrunner.runner.buckets import MAX_SPEC_SEQS
from jaxrunner.runner.draft_proposer import start_draft_proposer
from jaxrunner.runner.sampler import MAX_LOGPROBS
from jaxrunner.runner.startup import start_runner
from jaxrunner.runner.step_batch import MAX_ALLOWED_TOKEN_IDS, MAX_BANNED_TOKENS, MAX_LOGIT_BIAS

LIMITS = SamplingLimits(max_logprobs=MAX_LOGPROBS, max_logit_bias=MAX_LOGIT_BIAS,
                        max_allowed_token_ids=MAX_ALLOWED_TOKEN_IDS, max_banned_tokens=MAX_BANNED_TOKENS)


@dataclasses.dataclass
class StepHandle:
    device_outputs: dict  # the runner's sampled arrays, possibly still being computed
    num_seq_rows: int     # the bucket's sequences: draft rows' outputs follow theirs


class Executor:
    """Starts a runner for ``model`` (already on this row's mesh) and serves steps on it; with a
    ``draft`` model (speculative_method="draft_model", on the same mesh) also the draft's runner,
    whose proposer the engine's scheduler asks (``draft_proposer``)."""

    limits = LIMITS
    max_num_spec_seqs = MAX_SPEC_SEQS

    def __init__(self, config: EngineConfig, model, draft=None):
        self.model = model
        self.runner, self.bucket_plan, self.max_model_len, self.startup_report = start_runner(config, model)
        self.max_prefill_seqs = config.max_num_prefill_seqs
        self.eos_token_ids = _eos_token_ids(model)
        self.draft_proposer = None
        if draft is not None:
            self.draft_proposer, self.startup_report["draft_model"] = start_draft_proposer(
                config, draft, self.max_model_len, self.num_pages)

    # ------------------------------------------------------------------ facts the engine plans with
    @property
    def tokenizer(self):
        return self.model.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.model = dataclasses.replace(self.model, tokenizer=tokenizer)
        self.eos_token_ids = _eos_token_ids(self.model)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def page_size(self) -> int:
        return self.runner.cache_spec.page_size

    @property
    def num_pages(self) -> int:
        return self.runner.cache_spec.num_pages

    @property
    def synchronous(self) -> bool:
        # several processes run one deterministic schedule each; keep them in lockstep
        return jax.process_count() > 1

    # ------------------------------------------------------------------ steps
    def execute(self, step: StepInput) -> StepHandle:
        bucket = self.bucket_plan.select(step.num_tokens, len(step.sequences), step.widest)
        batch = pack_step(step, bucket, self.page_size, self.vocab_size, self.max_prefill_seqs)
        return StepHandle(self.runner.dispatch(bucket, batch), bucket.num_seqs)

    def fetch(self, handle: StepHandle, prompt_logprobs: bool) -> SampledRows:
        return SampledRows(**self.runner.fetch(handle.device_outputs, prompt_logprobs))

    # ------------------------------------------------------------------ weights
    @property
    def params(self):
        return self.runner.params

    def check_weights(self, params) -> None:
        weights.check_like(params, self.runner.params)

    def update_weights(self, params) -> None:
        self.check_weights(params)
        placed = weights.place_like(params, jax.tree.map(lambda leaf: leaf.sharding, self.runner.params))
        self.runner.params = placed
        self.model = dataclasses.replace(self.model, params=placed)


def _eos_token_ids(model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))
