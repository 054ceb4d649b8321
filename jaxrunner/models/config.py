"""ModelConfig: the static facts of a decoder every family shares, read from an HF ``config.json``.

Each family (``models.registry``) maps the HF dict itself, usually to a subclass of
:class:`ModelConfig` with its own fields; :func:`common_fields` reads the part they share.
"""
from __future__ import annotations

import dataclasses
from typing import Any


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

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: global). One window for all layers by default."""
        return self.sliding_window


def common_fields(cfg: dict[str, Any], source: str, default_eps: float = 1e-6) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads the same way (no window, bias or scaling)."""
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return dict(
            model_type=cfg["model_type"],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", default_eps)),
            rope_theta=float(rope_theta(cfg)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"{source}: missing required field {missing}") from None


def check_activation(cfg: dict, source: str, allowed: tuple[str, ...], key: str = "hidden_act") -> str:
    act = cfg.get(key) or allowed[0]
    if act not in allowed:
        raise UnsupportedModelError(f"{source}: unsupported {key} {act!r} (supported: {', '.join(allowed)})")
    return act


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    full = params.get("full_attention") or {}  # per layer type (Gemma 3 under transformers 5)
    return full.get("rope_theta", default)


def rope_scaling(cfg: dict, source: str, supported: tuple[str, ...] = ("llama3", "linear")):
    """rope_scaling as a sorted tuple of pairs (None for plain RoPE); other kinds are refused."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if scaling and "full_attention" in scaling:  # per layer type (Gemma 3): the global layers' own
        scaling = scaling["full_attention"]
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in supported:
        raise UnsupportedModelError(f"{source}: unsupported rope_scaling type {kind!r} "
                                    f"(supported: {', '.join(supported)})")
    items = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    items["rope_type"] = kind
    return tuple(sorted(items.items()))
