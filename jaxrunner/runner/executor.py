"""The executor: one mesh row's model runner behind the engine's protocol (``jaxrunner/executor_protocol.py``).

It turns a scheduler's plan into one bucket-shaped batch and one device call, and hands back the
sampled rows as host arrays; the engine sees nothing else of the devices. Everything it needs is
decided at start-up (``runner/startup.py``): the KV pool, the buckets, the executables.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jaxrunner.config import EngineConfig
from jaxrunner.executor_protocol import NO_TOKEN, SampledRows, SamplingLimits, StepInput, accepted_tokens
from jaxrunner.models.loading import peft
from jaxrunner.models.params import param_shapes
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
    step: StepInput       # what was asked (fetch drafts for its sequences that ask)


class Executor:
    """Starts a runner for ``model`` (already on this row's mesh) and serves steps on it; with a
    ``draft`` model (speculative_method="draft_model", on the same mesh) also the draft's runner,
    which guesses after each step for the sequences that ask (``fetch``), as vLLM's model runner
    drafts after sampling: the engine's planning never runs a model."""

    limits = LIMITS
    max_num_spec_seqs = MAX_SPEC_SEQS

    def __init__(self, config: EngineConfig, model, draft=None):
        self.runner, self.bucket_plan, self.max_model_len, self.startup_report = start_runner(config, model)
        self.model = dataclasses.replace(model, params=self.runner.params)  # laid out where chosen: no plain copy
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
    def drafts(self) -> bool:
        return self.draft_proposer is not None

    @property
    def max_loras(self) -> int:
        return 0 if self.runner.lora_spec is None else self.runner.lora_spec.max_loras

    @property
    def synchronous(self) -> bool:
        # several processes run one deterministic schedule each; keep them in lockstep
        return jax.process_count() > 1

    # ------------------------------------------------------------------ steps
    def execute(self, step: StepInput) -> StepHandle:
        bucket = self.bucket_plan.select(step.num_tokens, len(step.sequences), step.widest)
        batch = pack_step(step, bucket, self.page_size, self.vocab_size, self.max_prefill_seqs,
                          lora=self.max_loras > 0)
        return StepHandle(self.runner.dispatch(bucket, batch), bucket.num_seqs, step)

    def fetch(self, handle: StepHandle, prompt_logprobs: bool) -> SampledRows:
        sampled = SampledRows(**self.runner.fetch(handle.device_outputs, prompt_logprobs))
        if self.draft_proposer is None or not any(seq.propose for seq in handle.step.sequences):
            return sampled
        return dataclasses.replace(sampled, proposals=self._draft(handle, sampled.tokens))

    def forget(self, request_id: str) -> None:
        if self.draft_proposer is not None:
            self.draft_proposer.forget(request_id)

    def _draft(self, handle: StepHandle, tokens) -> np.ndarray:
        """The draft model's guesses after ``handle``'s step, one row per sequence (NO_TOKEN where
        none was asked or guessed), in one batch for every sequence that asked."""
        sequences = handle.step.sequences
        queries, asked, draft_row = [], [], handle.num_seq_rows
        for index, seq in enumerate(sequences):
            rows = list(range(draft_row, draft_row + seq.num_drafts)) + [index]
            draft_row += seq.num_drafts
            if seq.propose:
                drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts:].tolist() if seq.num_drafts else []
                gained = accepted_tokens(drafts, tokens[rows])
                queries.append((seq.request_id, [*seq.history.tolist(), *gained], seq.propose))
                asked.append(index)
        guesses = self.draft_proposer.propose_many(queries)
        proposals = np.full((len(sequences), max(seq.propose for seq in sequences)), NO_TOKEN, np.int32)
        for index, guess in zip(asked, guesses):
            proposals[index, :len(guess)] = guess
        return proposals

    # ------------------------------------------------------------------ weights
    @property
    def params(self):
        return self.runner.plain_params()

    def check_weights(self, params) -> None:
        weights.check_like(params, self.runner.plain_params_like())

    def update_weights(self, params) -> None:
        self.check_weights(params)
        placed = weights.place_like(params, jax.tree.map(lambda leaf: leaf.sharding, self.runner.plain_params_like()))
        self.runner.replace_params(placed)
        self.model = dataclasses.replace(self.model, params=self.runner.params)


    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, source) -> peft.Adapter:
        if self.max_loras == 0:
            raise ValueError(f"lora_request {name!r}: this engine serves no adapters; start it with enable_lora=True")
        cfg, max_rank = self.model.config, self.runner.lora_spec.max_rank
        layer_shapes = param_shapes(cfg)["layers"]
        if isinstance(source, (str, os.PathLike)):
            return peft.adapter_from_peft(name, source, cfg, layer_shapes, max_rank)
        if isinstance(source, list):  # one slot's layout (models.lora.new_adapter)
            return peft.adapter_from_layers(name, source, cfg, layer_shapes, max_rank)
        tensors, rank, alpha, use_rslora = source
        return peft.adapter_from_tensors(name, tensors, cfg, layer_shapes, max_rank, rank=rank, alpha=alpha,
                                         use_rslora=use_rslora)

    def load_lora_slot(self, slot: int, adapter: peft.Adapter) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot {slot}: valid 1..{self.max_loras}")
        self.runner.write_lora_slot(slot, adapter.layers)


def _eos_token_ids(model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))
