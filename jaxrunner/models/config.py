"""ModelConfig: the static facts of a Llama-family decoder, read from an HF ``config.json`` dict."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

# model_type -> what differs from plain Llama. Mistral is Llama with an optional sliding window;
# Qwen2 adds biases on the q/k/v projections.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option jaxrunner does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    sliding_window: int | None = None
    # rope_scaling as a sorted tuple of (key, value) pairs so the config stays hashable (jit static).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * d * i + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * per_layer + d + head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: unsupported model_type {model_type!r} "
                f"(architectures={cfg.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: unsupported hidden_act {act!r} (only 'silu')")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(cfg)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=_attention_bias(model_type, cfg),
                sliding_window=_sliding_window(model_type, cfg),
                rope_scaling=_rope_scaling(cfg, source),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            )
        except KeyError as missing:
            raise UnsupportedModelError(f"{source}: missing required field {missing}") from None

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), source=path)


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _attention_bias(model_type: str, cfg: dict) -> bool:
    if model_type == "qwen2":
        return True  # Qwen2 always has q/k/v biases (and none on o_proj)
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"attention_bias=True is not supported for {model_type}")
    return False


def _sliding_window(model_type: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_scaling(cfg: dict, source: str):
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise UnsupportedModelError(f"{source}: unsupported rope_scaling type {kind!r}")
    items = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    items["rope_type"] = kind
    return tuple(sorted(items.items()))
