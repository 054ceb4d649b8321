"""A Llama-style decoder written in Flax NNX, served through the protocol of ``models/flax_nnx.py``.

An example to copy from as much as a model: plain ``nnx.Param`` weights ([in, out] kernels),
separate q/k/v projections, and attention left to the ``attend`` the engine hands each layer.

    model = NnxLlama.from_state_dict(state_dict, config)     # or NnxLlama(config, nnx.Rngs(0))
    llm = LLM.from_nnx(model, tokenizer=...)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.layers import apply_rope, rms_norm, rope_tables


def _param(array, dtype) -> nnx.Param:
    return nnx.Param(jnp.asarray(array, dtype))


def _assign(variable: nnx.Variable, array, dtype) -> None:
    value = jnp.asarray(array, dtype)
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # flax before set_value
        variable.value = value


_ModuleList = getattr(nnx, "List", list)  # flax's container for a list of submodules, where it has one


class NnxLlamaLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        d, i = config.hidden_size, config.intermediate_size
        init = jax.nn.initializers.normal(0.02)
        self.config = config
        self.attn_norm = _param(jnp.ones(d), dtype)
        self.wq = _param(init(rngs.params(), (d, config.q_size)), dtype)
        self.wk = _param(init(rngs.params(), (d, config.kv_size)), dtype)
        self.wv = _param(init(rngs.params(), (d, config.kv_size)), dtype)
        self.wo = _param(init(rngs.params(), (config.q_size, d)), dtype)
        self.mlp_norm = _param(jnp.ones(d), dtype)
        self.w_gate = _param(init(rngs.params(), (d, i)), dtype)
        self.w_up = _param(init(rngs.params(), (d, i)), dtype)
        self.w_down = _param(init(rngs.params(), (i, d)), dtype)

    def __call__(self, x, positions, attend):
        cfg = self.config
        tokens = x.shape[0]
        h = rms_norm(x, self.attn_norm[...], cfg.rms_norm_eps)
        q = (h @ self.wq[...]).reshape(tokens, cfg.num_heads, cfg.head_dim).astype(jnp.float32)
        k = (h @ self.wk[...]).reshape(tokens, cfg.num_kv_heads, cfg.head_dim).astype(jnp.float32)
        v = (h @ self.wv[...]).reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope_tables(cfg, positions)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        x = x + out.reshape(tokens, cfg.q_size).astype(x.dtype) @ self.wo[...]
        h = rms_norm(x, self.mlp_norm[...], cfg.rms_norm_eps)
        return x + (jax.nn.silu(h @ self.w_gate[...]) * (h @ self.w_up[...])) @ self.w_down[...]


class NnxLlama(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.embedding = _param(jax.nn.initializers.normal(0.02)(rngs.params(), (config.vocab_size,
                                                                                 config.hidden_size)), dtype)
        self.layers = _ModuleList([NnxLlamaLayer(config, rngs, dtype) for _ in range(config.num_layers)])
        self.final_norm = _param(jnp.ones(config.hidden_size), dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(jnp.zeros((config.hidden_size, config.vocab_size)), dtype)

    def embed(self, token_ids):
        return jnp.take(self.embedding[...], token_ids, axis=0)

    def norm(self, x):
        return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

    def logits(self, x):
        head = self.embedding[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return jnp.matmul(x, head, preferred_element_type=jnp.float32)

    @classmethod
    def from_state_dict(cls, state, config: ModelConfig, dtype=jnp.float32) -> "NnxLlama":
        """Weights from an HF-named state dict (torch layout, as ``open_hf_state_dict`` reads it)."""
        model = cls(config, nnx.Rngs(0), dtype)
        t = lambda name: np.asarray(state[name]).T
        _assign(model.embedding, state["model.embed_tokens.weight"], dtype)
        _assign(model.final_norm, state["model.norm.weight"], dtype)
        if not config.tie_word_embeddings:
            _assign(model.lm_head, t("lm_head.weight"), dtype)
        names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
                 "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
                 "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
        for i, layer in enumerate(model.layers):
            for attr, hf in names.items():
                weight = np.asarray(state[f"model.layers.{i}.{hf}.weight"])
                _assign(getattr(layer, attr), weight if weight.ndim == 1 else weight.T, dtype)
        return model
