"""LoRA adapters in PEFT's format -> the factors of one slot (``models.lora``), on the host.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ...)
and ``adapter_model.safetensors`` with, per targeted projection, ``...layers.{i}.{module}.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r] (torch layout). Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are split into their parts (the shared A, each part's rows of B). The adapter's delta is
``scaling * x @ A.T @ B.T`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA).

Laid out for a slot (``models.lora``), each of our fused projections gets ``a`` [in, P * R] (its
parts' A side by side, ranks zero-padded to the slots' ``R``) and one ``b`` [R, out_p] per part
(its B, scaled, transposed). Modules the adapter does not target stay zero. The same layout
serves adapters given as arrays in memory (``LLM.add_lora``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Mapping

import numpy as np
from safetensors.numpy import load_file

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.lora import PROJECTIONS, part_sizes, slot_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Modules some families' checkpoints fuse (Phi-3): one A, and a B whose rows are the parts' in order.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MODULE_TO_PROJECTION = {**{module: projection for projection, modules in PROJECTIONS.items() for module in modules},
                        "qkv_proj": "wqkv", "gate_up_proj": "w_gate_up"}
# PEFT options that change what the adapter computes, and the value that means "not used"
UNSUPPORTED_OPTIONS = {"use_dora": False, "modules_to_save": None, "bias": "none", "rank_pattern": {},
                       "alpha_pattern": {}, "lora_bias": False, "fan_in_fan_out": False, "layer_replication": None}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter laid out for a slot (float32 host arrays)."""

    name: str
    rank: int
    modules: tuple[str, ...]  # the HF modules it targets
    layers: list              # per layer: {projection: {"a": [in, P * R], "b": [P * R, out]}}

    @property
    def nbytes(self) -> int:
        return sum(factors["a"].nbytes + sum(b.nbytes for b in factors["b"])
                   for layer in self.layers for factors in layer.values())


def read_peft_adapter(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory."""
    path = os.path.expanduser(os.fspath(path))
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for required in (config_path, weights_path):
        if not os.path.isfile(required):
            raise AdapterError(f"lora_path {path!r}: no {os.path.basename(required)} (a PEFT adapter directory "
                               f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(config_path) as f:
            config = json.load(f)
        tensors = load_file(weights_path)
    except (OSError, ValueError) as err:
        raise AdapterError(f"lora_path {path!r}: unreadable ({type(err).__name__}: {err})") from None
    return config, tensors


def adapter_from_peft(name: str, path: str, cfg: ModelConfig, layer_shapes: list[dict], max_rank: int) -> Adapter:
    """The adapter in PEFT directory ``path``, checked against the model and laid out for a slot."""
    config, tensors = read_peft_adapter(path)
    source = f"LoRA adapter {name!r} ({path})"
    for option, off in UNSUPPORTED_OPTIONS.items():
        if config.get(option) is not None and config[option] != off:
            raise AdapterError(f"{source}: {option}={config[option]!r} is not supported (only plain LoRA: "
                               f"{option}={off!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{source}: adapter_config.json needs a positive integer 'r' and a number "
                           f"'lora_alpha', got r={rank!r}, lora_alpha={alpha!r}")
    return adapter_from_tensors(name, tensors, cfg, layer_shapes, max_rank, rank=rank, alpha=float(alpha),
                                use_rslora=bool(config.get("use_rslora", False)), source=source)


def adapter_from_tensors(name: str, tensors: Mapping[str, np.ndarray], cfg: ModelConfig, layer_shapes: list[dict],
                         max_rank: int, *, rank: int, alpha: float, use_rslora: bool = False,
                         source: str | None = None) -> Adapter:
    """An adapter from PEFT-named arrays (``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in],
    ``lora_B.weight`` [out, r]), scaled by ``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""
    source = source or f"LoRA adapter {name!r}"
    if rank > max_rank:
        raise AdapterError(f"{source}: rank {rank} exceeds max_lora_rank={max_rank}; raise max_lora_rank")
    factors = _factors_by_module(tensors, cfg, layer_shapes, rank, source)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    layers = [_layer_slot(factors.get(i, {}), cfg, shapes, max_rank, scaling) for i, shapes in enumerate(layer_shapes)]
    modules = tuple(sorted({module for per_layer in factors.values() for module in per_layer}))
    return Adapter(name=name, rank=rank, modules=modules, layers=layers)


def adapter_from_layers(name: str, layers, cfg: ModelConfig, layer_shapes: list[dict], max_rank: int) -> Adapter:
    """An adapter given in one slot's layout (``models.lora.new_adapter``: per layer and projection
    ``a`` [in, P * r], ``b`` [[r, out_p] per part], scaling folded in; JAX or numpy arrays), its
    rank ``r`` padded to ``max_rank``."""
    source = f"LoRA adapter {name!r}"
    if not isinstance(layers, (list, tuple)) or len(layers) != len(layer_shapes):
        raise AdapterError(f"{source}: expected one dict of projections per layer ({len(layer_shapes)} layers)")
    rank = None
    padded = []
    for index, (layer, shapes) in enumerate(zip(layers, layer_shapes)):
        expected = slot_shapes(cfg, shapes, 1, 1)
        if not isinstance(layer, dict) or set(layer) != set(expected):
            raise AdapterError(f"{source}: layer {index} must hold the projections {sorted(expected)}")
        padded.append({})
        for projection, factors in layer.items():
            a, b = np.asarray(factors["a"], np.float32), [np.asarray(part, np.float32) for part in factors["b"]]
            parts = len(expected[projection]["b"])
            rank = a.shape[1] // parts if rank is None else rank
            want = slot_shapes(cfg, shapes, 1, rank)[projection]
            if a.shape != want["a"] or [part.shape for part in b] != want["b"]:
                raise AdapterError(f"{source}: layer {index} {projection}: a {a.shape}, b {[p.shape for p in b]}; "
                                   f"expected {want['a']} and {want['b']} for rank {rank}")
            if rank > max_rank:
                raise AdapterError(f"{source}: rank {rank} exceeds max_lora_rank={max_rank}; raise max_lora_rank")
            padded[index][projection] = _padded(a, b, parts, rank, max_rank)
    return Adapter(name=name, rank=rank, modules=tuple(m for p in PROJECTIONS for m in PROJECTIONS[p]), layers=padded)


def _padded(a: np.ndarray, b: list, parts: int, rank: int, max_rank: int) -> dict:
    """One projection's factors with each part's rank zero-padded to ``max_rank``."""
    wide = np.zeros((a.shape[0], parts * max_rank), np.float32)
    for part in range(parts):
        wide[:, part * max_rank:part * max_rank + rank] = a[:, part * rank:(part + 1) * rank]
    return {"a": wide, "b": [np.pad(part, ((0, max_rank - rank), (0, 0))) for part in b]}


def _factors_by_module(tensors, cfg: ModelConfig, layer_shapes: list[dict], rank: int, source: str) -> dict:
    """{layer: {module: (A [r, in], B [out, r])}}, every name and shape checked."""
    found: dict = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{source}: tensor {key!r} is not a LoRA factor of a decoder layer's projection")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if module not in MODULE_TO_PROJECTION:
            raise AdapterError(f"{source}: targets module {module!r}, which jaxrunner cannot adapt; valid: "
                               f"{', '.join(MODULE_TO_PROJECTION)}")
        if layer >= len(layer_shapes):
            raise AdapterError(f"{source}: tensor {key!r} names layer {layer}; the model has {len(layer_shapes)}")
        projection = MODULE_TO_PROJECTION[module]
        if projection not in layer_shapes[layer]:
            raise AdapterError(f"{source}: targets {module!r}, which layer {layer} of this model does not have "
                               f"as a dense projection")
        found.setdefault(layer, {}).setdefault(module, {})[side] = np.asarray(value, np.float32)
    for layer, modules in found.items():
        for module, sides in modules.items():
            _check_pair(sides, module, layer, cfg, layer_shapes[layer], rank, source)
    return {layer: _split_fused({module: (sides["A"], sides["B"]) for module, sides in modules.items()}, cfg,
                                f"{source}: layer {layer}")
            for layer, modules in found.items()}


def _split_fused(modules: dict, cfg: ModelConfig, where: str) -> dict:
    """A fused module's factors as its parts': each part keeps the shared A and its rows of B."""
    split = {}
    for module, (lora_a, lora_b) in modules.items():
        parts = FUSED_MODULES.get(module, (module,))
        bounds = np.cumsum([_module_out(part, cfg) for part in parts])[:-1]
        for part, rows in zip(parts, np.split(lora_b, bounds)):
            if part in split:
                raise AdapterError(f"{where}: adapts {part!r} twice (as itself and inside a fused module)")
            split[part] = (lora_a, rows)
    return split


def _check_pair(sides: dict, module: str, layer: int, cfg: ModelConfig, shapes: dict, rank: int, source: str) -> None:
    where = f"{source}: layer {layer} {module}"
    if set(sides) != {"A", "B"}:
        raise AdapterError(f"{where}: has lora_{'A' if 'A' in sides else 'B'} without its lora_"
                           f"{'B' if 'A' in sides else 'A'}")
    fan_in = shapes[MODULE_TO_PROJECTION[module]][0]
    fan_out = _module_out(module, cfg)
    if sides["A"].shape != (rank, fan_in) or sides["B"].shape != (fan_out, rank):
        raise AdapterError(f"{where}: lora_A {sides['A'].shape} and lora_B {sides['B'].shape} do not match the "
                           f"base model (expected {(rank, fan_in)} and {(fan_out, rank)} for rank {rank})")


def _module_out(module: str, cfg: ModelConfig) -> int:
    if module in FUSED_MODULES:
        return sum(_module_out(part, cfg) for part in FUSED_MODULES[module])
    return {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size, "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
            "down_proj": cfg.hidden_size}[module]


def _layer_slot(modules: dict, cfg: ModelConfig, shapes: dict, max_rank: int, scaling: float) -> dict:
    """One layer's {projection: {"a": [in, P * R], "b": [[R, out_p] per part]}}, zeros where a
    module is not targeted and past the adapter's rank."""
    slot = {}
    for projection, parts in PROJECTIONS.items():
        if projection not in shapes:
            continue
        a = np.zeros((shapes[projection][0], len(parts) * max_rank), np.float32)
        b = [np.zeros((max_rank, size), np.float32) for size in part_sizes(projection, cfg)]
        for part, module in enumerate(parts):
            if module in modules:
                lora_a, lora_b = modules[module]
                rank = lora_a.shape[0]
                a[:, part * max_rank:part * max_rank + rank] = lora_a.T
                b[part][:rank] = (lora_b * scaling).T
        slot[projection] = {"a": a, "b": b}
    return slot
