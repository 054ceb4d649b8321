"""A decoder whose every MLP is a sparse mixture of experts (``models.moe``): what Mixtral and
Qwen3-MoE share — their config fields, layer, expert params, partition rules.

Attention is the Llama family's (fused, KV-grouped q/k/v; rotate-half RoPE; ``models.layers``), with
Qwen3's RMSNorm per head on q and k where the config says ``qk_norm``. Experts are split over the mesh's
``"model"`` axis (expert parallelism) while attention keeps its heads split (tensor parallelism);
the forward learns the mesh from the attention callable it is handed (``PagedAttention.mesh``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrunner.models import layers, moe
from jaxrunner.models.attention import AttentionMetadata, DenseAttention
from jaxrunner.models.config import ModelConfig, UnsupportedModelError
from jaxrunner.models.decoder import Decoder
from jaxrunner.models.params import decoder_shapes, take
from jaxrunner.parallel import sharding
from jaxrunner.parallel.mesh import MODEL_AXIS


@dataclasses.dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """``intermediate_size`` is each expert's width."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    normalize_top_k: bool = True
    qk_norm: bool = False

    @property
    def moe_spec(self) -> moe.MoESpec:
        return moe.MoESpec(self.num_experts, self.num_experts_per_tok, self.intermediate_size, self.normalize_top_k)


def check_experts(cfg: MoEConfig, source: str) -> None:
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise UnsupportedModelError(f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                                    f"[1, num_experts={cfg.num_experts}]")


# ----------------------------------------------------------------------------- forward
def token_mask(meta, num_rows: int):
    """[T] true for the rows that are tokens of the step's sequences; None (every row is) for the
    dense reference, whose ``meta`` is the tokens' segment ids."""
    return meta.token_mask(num_rows) if isinstance(meta, AttentionMetadata) else None


@dataclasses.dataclass(frozen=True)
class MoEDecoder(Decoder):
    """Llama's attention (with per-head q/k norms where ``qk_norm``) and a mixture-of-experts MLP."""

    def context(self, positions, meta, num_rows: int) -> dict:
        return {**super().context(positions, meta, num_rows), "valid": token_mask(meta, num_rows)}

    def qkv(self, layer, x):
        qkv = super().qkv(layer, x)
        if self.cfg.qk_norm:
            qkv = layers.norm_qk(qkv, layer["q_norm"], layer["k_norm"], self.cfg.rms_norm_eps)
        return qkv

    def finish(self, layer, x, attended, context: dict, attention, rows=None, probe=None):
        """``probe``: a list that receives the layer's expert counts [E] (the start-up report's)."""
        x = x + layers.linear(attended.astype(x.dtype), layer["wo"], self.matmuls)
        valid = context["valid"]
        if valid is not None and rows is not None:
            valid = jnp.take(valid, rows)
        h = self.norm(x, layer["mlp_norm"])
        if probe is not None:
            probe.append(moe.expert_counts(h, layer["router"], self.cfg.moe_spec, valid))
        return x + moe.moe_mlp(h, layer["router"], layer["experts_gate_up"], layer["experts_down"], self.cfg.moe_spec,
                               valid=valid, mesh=getattr(attention, "mesh", None))

    def expert_load(self, params, token_ids, positions, segment_ids, num_tokens):
        """Expert counts [layers, E] of the first ``num_tokens`` rows (the rest are padding), with
        attention inside each segment and no cache: how a batch's tokens spread over the experts
        (the start-up report's probe)."""
        loads = []
        meta = _live_rows_metadata(token_ids.shape[0], num_tokens)
        self.forward(params, token_ids, positions, [None] * self.cfg.num_layers, meta, _SegmentAttention(segment_ids),
                     probe=loads)
        return jnp.stack(loads)


def _live_rows_metadata(num_rows: int, num_tokens) -> AttentionMetadata:
    """The probe's metadata: one sequence of the first ``num_tokens`` rows (the rest padding), no
    pages (its attention keeps no cache; only ``token_mask`` reads this)."""
    zero = jnp.zeros((), jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    return AttentionMetadata(slot_mapping=jnp.zeros(num_rows, jnp.int32), page_indices=jnp.zeros((1, 1), jnp.int32),
                             cu_q_lens=jnp.stack([zero, num_tokens]), kv_lens=num_tokens[None],
                             num_seqs=jnp.ones((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class _SegmentAttention:
    """DenseAttention within fixed segments, whatever ``meta`` says (the probe's only marks live rows)."""

    segment_ids: jax.Array

    def __call__(self, q, k, v, layer_cache, meta, **kwargs):
        return DenseAttention()(q, k, v, layer_cache, self.segment_ids, **kwargs)


# ----------------------------------------------------------------------------- params
def expert_params(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> dict[str, np.ndarray]:
    """Torch-layout stacks ``gate``/``up`` [E, I, D], ``down`` [E, D, I] -> ``experts_gate_up``
    [E, D, 2I] (gate columns, then up) and ``experts_down`` [E, I, D]."""
    return {"experts_gate_up": np.concatenate([gate, up], axis=1).transpose(0, 2, 1),
            "experts_down": down.transpose(0, 2, 1)}


def stacked_experts(state, cfg: MoEConfig, prefix: str, names: tuple[str, str, str], source: str):
    """``experts.{e}.{gate,up,down}.weight`` for every expert, stacked (torch layout)."""
    d, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = ((inter, d), (inter, d), (d, inter))
    return [np.stack([take(state, f"{prefix}experts.{e}.{name}.weight", shape, source) for e in range(cfg.num_experts)])
            for name, shape in zip(names, shapes)]


def fused_experts(state, cfg: MoEConfig, prefix: str, source: str):
    """transformers 5's own layout: ``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I]."""
    d, inter, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    gate_up = take(state, prefix + "experts.gate_up_proj", (e, 2 * inter, d), source)
    down = take(state, prefix + "experts.down_proj", (e, d, inter), source)
    return gate_up[:, :inter], gate_up[:, inter:], down


def layer_shapes(cfg: MoEConfig) -> dict:
    d, inter, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    layer = {"attn_norm": (d,), "wqkv": (d, cfg.q_size + 2 * cfg.kv_size), "wo": (cfg.q_size, d),
             "mlp_norm": (d,), "router": (d, e), "experts_gate_up": (e, d, 2 * inter), "experts_down": (e, inter, d)}
    if cfg.qk_norm:
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return layer


def param_shapes(cfg: MoEConfig) -> dict:
    return decoder_shapes(cfg, layer_shapes(cfg))


# ----------------------------------------------------------------------------- parallelism
EXPERTS = P(MODEL_AXIS, None, None)  # [E, in, out] split by expert
QUANTIZED_LEAVES = ("wqkv", "wo")    # int8 experts: not yet (per-expert scales)
KV_GROUPED_LEAVES = ("wqkv",)


def partition_rules(cfg: MoEConfig, tp: int) -> dict:
    """Attention as the Llama family (heads split), experts whole on each shard (expert parallel)."""
    moe.check_expert_parallel(cfg.num_experts, tp)
    return {**sharding.vocab_rules(cfg, tp), "wqkv": sharding.COLUMN, "wo": sharding.ROW,
            "attn_norm": sharding.REPLICATED, "mlp_norm": sharding.REPLICATED, "final_norm": sharding.REPLICATED,
            "q_norm": sharding.REPLICATED, "k_norm": sharding.REPLICATED, "router": sharding.REPLICATED,
            "experts_gate_up": EXPERTS, "experts_down": EXPERTS}
