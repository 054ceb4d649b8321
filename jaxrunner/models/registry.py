"""The model registry: every architecture family jaxrunner serves, found by its HF name.

A family lives in one module of ``jaxrunner.models`` that builds a :class:`ModelFamily` and passes
it to :func:`register` when imported. The family owns everything that names its tensors or reads
its config: the HF config mapping, the pure ``forward``/``compute_logits``, the state dict → params
mapping, the tensor-parallel partition rules and the leaves int8 quantization may touch. The
runner, sharding, quantization, the loaders and start-up ask the registry; none of them knows a
family's leaf names.

A checkpoint's family is chosen by its ``architectures`` entry (``LlamaForCausalLM``), falling
back to ``model_type``; a served :class:`ModelConfig` finds its family again by ``model_type``.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from jaxrunner.models.config import ModelConfig, UnsupportedModelError

# The modules that define families, imported on the first lookup. Adding an architecture is one
# module here plus this line.
FAMILY_MODULES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """What one architecture family provides (see the module docstring).

    - ``config_from_hf(hf_dict, source) -> ModelConfig`` (the family's subclass, with its own
      fields); raises :class:`UnsupportedModelError` on options it does not implement.
    - ``architecture(cfg, matmuls)``: an object with ``forward(params, token_ids, positions, kv_cache,
      meta, attention, rows=None)`` and ``compute_logits(params, hidden)``, pure over the paged cache;
      ``meta`` (the step's ``models.attention.AttentionMetadata``) goes to ``attention`` untouched, and
      its linear products run where ``matmuls`` (a ``kernels.MatmulKernels``) says.
    - ``build_params(state, cfg, place, source, progress)``: HF-named state dict → params pytree,
      each piece handed to ``place`` as soon as it is built (see ``models.params.build_params``).
    - ``param_shapes(cfg)``: the shape of every leaf ``build_params`` makes.
    - ``partition_rules(cfg, tp)``: leaf name → ``PartitionSpec`` of its float weight, for every
      leaf name the family has (an unknown name is an error in ``parallel.sharding``).
    - ``quantized_leaves``: the layer leaves (``[in, out]`` matrices) int8 quantization replaces.
    - ``quantized_embedding``: whether weight-only quantization may also quantize a tied
      embedding (the family's embedding lookup and logits then take the packed rows).
    - ``kv_grouped_leaves``: layer leaves whose last dimension is laid out by KV-head group
      (``models.params.group_qkv``); they are regrouped when KV heads are replicated for tensor
      parallelism.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict, str], ModelConfig]
    architecture: Callable[[ModelConfig, Any], Any]
    build_params: Callable[..., dict]
    param_shapes: Callable[[ModelConfig], dict]
    partition_rules: Callable[[ModelConfig, int], Mapping[str, Any]]
    quantized_leaves: tuple[str, ...]
    kv_grouped_leaves: tuple[str, ...] = ()
    quantized_embedding: bool = False  # its forward reads a weight-only tied embedding (int8 rows)


_BY_ARCHITECTURE: dict[str, ModelFamily] = {}
_BY_MODEL_TYPE: dict[str, ModelFamily] = {}
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Make ``family`` findable by its HF architecture names and model types."""
    for name in family.architectures:
        _BY_ARCHITECTURE[name] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in FAMILY_MODULES:
            importlib.import_module(f"jaxrunner.models.{module}")


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(_BY_ARCHITECTURE)


def family_for_hf_config(hf_config: dict, source: str = "config.json") -> ModelFamily:
    """The family of an HF ``config.json`` dict: by ``architectures``, else by ``model_type``."""
    _load_families()
    for name in hf_config.get("architectures") or ():
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    model_type = hf_config.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise UnsupportedModelError(
        f"{source}: unsupported architecture (architectures={hf_config.get('architectures')}, "
        f"model_type={model_type!r}); supported architectures: {', '.join(supported_architectures())}")


def family_for_config(cfg: ModelConfig) -> ModelFamily:
    """The family a served config belongs to (by its ``model_type``)."""
    _load_families()
    family = _BY_MODEL_TYPE.get(cfg.model_type)
    if family is None:
        raise UnsupportedModelError(f"model_type {cfg.model_type!r} has no registered family; "
                                    f"supported: {', '.join(sorted(_BY_MODEL_TYPE))}")
    return family


def config_from_hf(hf_config: dict, source: str = "config.json") -> ModelConfig:
    """The family's :class:`ModelConfig` for an HF config dict."""
    return family_for_hf_config(hf_config, source).config_from_hf(hf_config, source)


def partition_rules(cfg: ModelConfig) -> Callable[[int], Mapping[str, Any]]:
    """``tp -> rules`` of ``cfg``'s family: what ``parallel.sharding`` lays params out by (looked up
    only when asked: one shard consults no rules, so unregistered models serve on one device)."""
    return lambda tp: family_for_config(cfg).partition_rules(cfg, tp)


def kv_grouped_leaves(cfg: ModelConfig) -> tuple[str, ...]:
    """The layer leaves of ``cfg``'s family laid out by KV-head group (regrouped when KV heads are
    replicated for tensor parallelism)."""
    return family_for_config(cfg).kv_grouped_leaves


def architecture_for(cfg: ModelConfig, matmuls=None):
    """The ``forward``/``compute_logits`` object of ``cfg``'s family, bound to ``cfg`` and to where its
    linear products run: ``matmuls``, the runner's ``kernels.capabilities().matmuls`` (None: XLA's
    dot, which runs anywhere)."""
    family = family_for_config(cfg)
    return family.architecture(cfg) if matmuls is None else family.architecture(cfg, matmuls)
