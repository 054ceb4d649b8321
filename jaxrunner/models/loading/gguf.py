"""GGUF (llama.cpp) checkpoints -> HF-named float32 numpy state dict + HF ``config.json`` dict.

Reads the file with ``gguf.GGUFReader`` (memory-mapped; see :class:`_FastReader`), dequantizes
tensors with ``gguf.quants.dequantize`` (each when it is read, from :func:`open_gguf`; all at once,
from :func:`load_gguf`) and renames llama.cpp tensors to their Hugging Face names, in torch layout
([out, in] for linear weights). See "Contract: model parameters" in docs/architecture.md.

Q/K rotary layout. Hugging Face Llama checkpoints use the *rotate-half* RoPE layout: inside each
head of size ``Dh`` the rotary pairs are ``(j, j + Dh/2)``. llama.cpp uses the *interleaved* layout,
pairs ``(2j, 2j+1)``, so ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the output rows
of ``q_proj``/``k_proj`` (weights and biases) for llama-family models::

    w.reshape(n_head, 2, Dh // 2, *rest).swapaxes(1, 2).reshape(w.shape)   # HF -> GGUF

i.e. GGUF row ``h*Dh + 2j + s`` holds HF row ``h*Dh + s*Dh/2 + j`` (``s`` in {0, 1}), with
``n_head = num_attention_heads`` for Q and ``num_key_value_heads`` for K. :func:`unpermute_qk`
applies the inverse (``reshape(n_head, Dh // 2, 2, *rest).swapaxes(1, 2)``). Qwen2 is converted
without the permutation (llama.cpp runs it in NEOX/rotate-half mode), so nothing is undone there.
Quantization blocks run along the input dimension, within one row, so the row reordering commutes
with (de)quantization exactly.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import gguf
import numpy as np
from tqdm.auto import tqdm

from jaxrunner.models.loading import gguf_tokenizer

__all__ = [
    "GGUFCheckpoint",
    "GGUFError",
    "GGUFFormatError",
    "UnsupportedGGUFError",
    "SUPPORTED_ARCHITECTURES",
    "DequantizedTensors",
    "load_gguf",
    "open_gguf",
    "load_gguf_tokenizer",
    "read_gguf_metadata",
    "unpermute_qk",
    "permute_qk",
]

GGUF_MAGIC = b"GGUF"

# GGUF architecture -> (HF model_type, HF architectures entry, llama.cpp permuted Q/K rows?)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}

# Defaults llama.cpp / transformers assume when a key is absent.
_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}
_DEFAULT_RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6}

_LAYER_MAP = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that carry no weights of their own (consumed or ignored here).
_ROPE_FREQS = "rope_freqs.weight"
_IGNORED_LAYER_SUFFIXES = ("attn_rot_embd",)
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(ValueError):
    """A GGUF file could not be loaded; the message names the file and the problem."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


class GGUFFormatError(GGUFError):
    """Not a GGUF file, or a truncated / corrupt one."""


class UnsupportedGGUFError(GGUFError):
    """A valid GGUF file using an architecture, tensor type or feature jaxrunner does not support."""


@dataclass
class GGUFCheckpoint:
    """What :func:`load_gguf` returns.

    ``hf_config``: an HF ``config.json`` dict; ``state_dict``: HF name -> float32 array (torch
    layout; from :func:`open_gguf`, a :class:`DequantizedTensors` that reads them on access);
    ``tensor_types``: HF name -> the GGML type it was stored as (e.g. ``"Q4_1"``);
    ``metadata``: the file's scalar metadata (big token arrays left out).
    """

    hf_config: dict
    state_dict: dict[str, np.ndarray]
    path: str = ""
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    reader: Any = None  # the parsed file (open_gguf only): load_gguf_tokenizer can reuse it


# ----------------------------------------------------------------------------- Q/K layout


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF interleaved rotary row order -> HF rotate-half order (inverse of llama.cpp's permute).

    ``w``: [n_head * Dh, ...] (a weight [out, in] or a bias [out]).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> GGUF interleaved order (what ``convert_hf_to_gguf.py`` does)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- reading


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if os.path.isdir(path):
        raise GGUFFormatError(f"{path}: is a directory, expected a .gguf file", path)
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) < 4:
        raise GGUFFormatError(
            f"{path}: not a GGUF file (only {len(head)} bytes; file truncated or corrupt)", path)
    if head != GGUF_MAGIC:
        raise GGUFFormatError(
            f"{path}: not a GGUF file (magic bytes {head!r}, expected {GGUF_MAGIC!r})", path)


class _FastReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` that slices a plain ndarray view of its memory map.

    The stock reader slices the ``np.memmap`` itself for every value it parses, and each slice of
    a memmap subclass runs ``memmap.__array_finalize__``: the ~100k strings of a tokenizer's
    vocabulary and merges took 2.4 s to parse (SmolLM2). The same bytes viewed as ``np.ndarray``
    parse in 0.8 s, and the arrays handed out still point into the map.
    """

    def _get(self, offset: int, dtype, count: int = 1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        values = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))


def _open_reader(path: str):
    _check_file(path)
    try:
        reader = _FastReader(path)
    except Exception as e:  # the reader fails in many obscure ways on damaged files
        raise GGUFFormatError(
            f"{path}: GGUF file is truncated or corrupt ({type(e).__name__}: {e})", path) from e
    if getattr(reader, "byte_order", "I") != "I":
        raise UnsupportedGGUFError(f"{path}: big-endian (byte-swapped) GGUF files are not supported", path)
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFFormatError(
                f"{path}: GGUF file is truncated or corrupt: tensor {t.name!r} needs bytes up to "
                f"{end} but the file has {size}", path)
    return reader


def _field_value(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    if isinstance(v, np.generic):
        v = v.item()
    return v


def read_gguf_metadata(path: str | os.PathLike, include_arrays: bool = False) -> dict[str, Any]:
    """The file's key/value metadata (arrays such as the token list only with ``include_arrays``)."""
    path = os.fspath(path)
    reader = _open_reader(path)
    return _metadata(reader, include_arrays)


def _metadata(reader, include_arrays: bool = False) -> dict[str, Any]:
    out = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and not include_arrays:
            continue
        try:
            v = f.contents()
        except Exception:  # pragma: no cover - unparseable field: keep going, it is metadata only
            continue
        out[key] = v.item() if isinstance(v, np.generic) else v
    return out


def _dequantize(t, path: str) -> np.ndarray:
    qtype = t.tensor_type
    if qtype.name in ("I8", "I16", "I32", "I64"):
        raise UnsupportedGGUFError(
            f"{path}: tensor {t.name!r} has integer GGML type {qtype.name}, not a weight type", path)
    try:
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                     gguf.GGMLQuantizationType.F64):
            out = np.asarray(t.data).astype(np.float32)  # always a copy, off the memmap
        else:
            out = gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError as e:
        raise UnsupportedGGUFError(
            f"{path}: tensor {t.name!r} has GGML type {qtype.name}, which cannot be dequantized "
            f"(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, K-quants, ...): {e}", path) from e
    out = np.ascontiguousarray(out, dtype=np.float32)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if out.shape != shape:
        out = out.reshape(shape)
    if not np.isfinite(out).all():
        raise GGUFFormatError(f"{path}: tensor {t.name!r} ({qtype.name}) holds non-finite values "
                              f"after dequantization (corrupt file?)", path)
    return out


# ----------------------------------------------------------------------------- config


def _llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                         orig: int) -> np.ndarray:
    # Same computation as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors).
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl, high_wl = orig / low, orig / high
    out = []
    for freq in freqs:
        wl = 2 * math.pi / freq
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (orig / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _rope_scaling_from_freqs(freqs: np.ndarray, theta: float, dim: int, path: str) -> dict | None:
    """llama.cpp stores Llama-3 rope scaling only as a ``rope_freqs`` tensor; recover the params."""
    freqs = np.asarray(freqs, dtype=np.float32).reshape(-1)
    if freqs.size and np.allclose(freqs, 1.0):
        return None
    if freqs.size != dim // 2:
        raise UnsupportedGGUFError(
            f"{path}: rope_freqs has {freqs.size} entries, expected head_dim/2 = {dim // 2}", path)
    factor = float(freqs.max())
    for orig in (8192, 4096, 16384, 32768, 2048, 65536, 131072):
        for low in (1.0, 0.5, 2.0, 4.0):
            for high in (4.0, 2.0, 8.0, 1.0, 16.0, 32.0):
                if high <= low:
                    continue
                ref = _llama3_rope_factors(theta, dim, factor, low, high, orig)
                if np.allclose(ref, freqs, rtol=1e-5, atol=1e-6):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise UnsupportedGGUFError(
        f"{path}: rope_freqs tensor does not match a Llama-3 rope scaling with standard parameters; "
        f"this rope scaling is not supported", path)


def _rope_scaling_from_metadata(reader, arch: str, path: str) -> dict | None:
    kind = _field_value(reader, f"{arch}.rope.scaling.type")
    factor = _field_value(reader, f"{arch}.rope.scaling.factor")
    if kind is None and factor is None:
        return None
    kind = kind or "linear"
    if kind == "none":
        return None
    if factor is None:
        raise GGUFFormatError(f"{path}: rope scaling type {kind!r} without {arch}.rope.scaling.factor", path)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        orig = _field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        for gkey, hkey in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                           ("attn_factor", "attention_factor")):
            v = _field_value(reader, f"{arch}.rope.scaling.{gkey}")
            if v is not None:
                out[hkey] = float(v)
        return out
    raise UnsupportedGGUFError(f"{path}: rope scaling type {kind!r} is not supported", path)


def _build_config(reader, path: str, tensors: dict) -> tuple[str, dict]:
    arch = _field_value(reader, "general.architecture")
    if arch is None:
        raise GGUFFormatError(f"{path}: GGUF metadata has no general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})", path)
    model_type, hf_arch, _ = SUPPORTED_ARCHITECTURES[arch]

    def req(key: str):
        v = _field_value(reader, f"{arch}.{key}")
        if v is None:
            raise GGUFFormatError(f"{path}: GGUF metadata lacks required key {arch}.{key}", path)
        return v

    hidden = int(req("embedding_length"))
    n_layers = int(req("block_count"))
    n_heads = int(req("attention.head_count"))
    n_kv = _field_value(reader, f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list (some archs); all equal is all we support
        if len(set(n_kv)) != 1:
            raise UnsupportedGGUFError(f"{path}: per-layer head_count_kv {n_kv} is not supported", path)
        n_kv = n_kv[0]
    n_kv = int(n_kv)
    ffn = req("feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise UnsupportedGGUFError(f"{path}: per-layer feed_forward_length is not supported", path)
        ffn = ffn[0]
    head_dim = _field_value(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = hidden // n_heads
    head_dim = int(head_dim)
    v_dim = _field_value(reader, f"{arch}.attention.value_length")
    if v_dim is not None and int(v_dim) != head_dim:
        raise UnsupportedGGUFError(f"{path}: key_length {head_dim} != value_length {v_dim} is not supported", path)
    rot_dim = _field_value(reader, f"{arch}.rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise UnsupportedGGUFError(
            f"{path}: partial rotary embedding (rope.dimension_count {rot_dim} != head_dim {head_dim}) "
            f"is not supported", path)

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFFormatError(f"{path}: GGUF file has no token_embd.weight tensor", path)
    vocab = int(embd.shape[-1])  # ggml dims: [D, V]
    meta_vocab = _field_value(reader, f"{arch}.vocab_size")
    if meta_vocab is not None and int(meta_vocab) != vocab:
        raise GGUFFormatError(
            f"{path}: {arch}.vocab_size = {meta_vocab} but token_embd.weight has {vocab} rows", path)

    theta = float(_field_value(reader, f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA[arch]))
    eps = float(_field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", _DEFAULT_RMS_EPS[arch]))
    # stored as float32 in the file: 1e-5 reads back as 9.99999974738e-06; undo the widening.
    eps = float(np.format_float_positional(np.float32(eps), unique=True, trim="-"))
    theta = float(np.format_float_positional(np.float32(theta), unique=True, trim="-"))
    ctx = int(_field_value(reader, f"{arch}.context_length", 2048))

    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for n in tensors),
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = True
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = n_layers
    else:
        cfg["mlp_bias"] = False
    for gkey, hkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "pad_token_id")):
        v = _field_value(reader, f"tokenizer.ggml.{gkey}")
        if v is not None:
            cfg[hkey] = int(v)
    scaling = _rope_scaling_from_metadata(reader, arch, path)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return arch, cfg


# ----------------------------------------------------------------------------- public API


class DequantizedTensors(Mapping):
    """The file's weights by HF name, each dequantized to float32 when it is read (not kept).

    What :func:`open_gguf` hands out, so that the engine can build and place a model one layer at
    a time: a 4-bit file is ~6x smaller than its float32 weights, and dequantizing all of them
    first made loading peak at 2.4x (float32) to 4x (bfloat16) the served weights. Holds the
    file's memory map open while it lives.
    """

    def __init__(self, reader, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 qk_heads: dict[str, int], path: str):
        self._reader, self._names, self._shapes, self._qk_heads, self._path = reader, names, shapes, qk_heads, path
        self._tensors = {t.name: t for t in reader.tensors}

    def __getitem__(self, hf_name: str) -> np.ndarray:
        gguf_name = self._names[hf_name]
        w = _dequantize(self._tensors[gguf_name], self._path)
        if w.shape != self._shapes[hf_name]:
            raise GGUFFormatError(
                f"{self._path}: tensor {gguf_name!r} has shape {w.shape}, expected {self._shapes[hf_name]} "
                f"for {hf_name} from the file's metadata", self._path)
        if hf_name in self._qk_heads:
            w = unpermute_qk(w, self._qk_heads[hf_name])
        return np.ascontiguousarray(w)

    def packed(self, hf_name: str) -> dict | None:
        """``hf_name``'s weight-only leaf ([out, in], numpy; ``models/quant.py``) read from the
        file's quantized blocks without dequantizing (see ``gguf_blocks``), or None when its
        GGML type has no exact packed form (F32, F16, Q5_*, Q6_K, ...)."""
        # lazy: gguf_blocks loads JAX, which reading a GGUF does not need
        from jaxrunner.models.loading.gguf_blocks import weight_only_leaf

        t = self._tensors[self._names[hf_name]]
        rows = self._shapes[hf_name][0]
        leaf = weight_only_leaf(t.tensor_type.name, np.asarray(t.data).reshape(rows, -1))
        if leaf is not None and hf_name in self._qk_heads:
            leaf = {key: unpermute_qk(part, self._qk_heads[hf_name]) for key, part in leaf.items()}
        return leaf

    def __contains__(self, hf_name) -> bool:  # Mapping's default would dequantize the tensor
        return hf_name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a llama / qwen2 / qwen3 GGUF file's config, tensor table and metadata; the weights stay in the
    file until read (``state_dict`` is a :class:`DequantizedTensors`).

    Every check that needs no tensor data runs here (see :func:`load_gguf` for the errors); a
    tensor's values are checked when it is dequantized.
    """
    path = os.fspath(path)
    reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch, cfg = _build_config(reader, path, tensors)
    names, rope_freqs = _name_plan(tensors, arch, cfg, path)
    shapes = _expected_shapes(cfg)
    missing = [k for k in shapes if k not in names]
    if missing:
        raise GGUFFormatError(
            f"{path}: GGUF file lacks tensors for {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else ""), path)
    qk_heads = {}
    if SUPPORTED_ARCHITECTURES[arch][2]:  # llama.cpp permuted these rows; undo it on read
        for hf_name in names:
            if ".q_proj." in hf_name or ".k_proj." in hf_name:
                qk_heads[hf_name] = cfg["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"]
    if rope_freqs is not None:
        scaling = _rope_scaling_from_freqs(_dequantize(tensors[rope_freqs], path), cfg["rope_theta"],
                                           cfg["head_dim"], path)
        if scaling is not None:
            if "rope_scaling" in cfg:
                raise UnsupportedGGUFError(f"{path}: both rope_freqs and {arch}.rope.scaling.* are set", path)
            cfg["rope_scaling"] = scaling
    types = {hf: tensors[g].tensor_type.name for hf, g in names.items()}
    return GGUFCheckpoint(hf_config=cfg, state_dict=DequantizedTensors(reader, names, shapes, qk_heads, path),
                          path=path, tensor_types=types, metadata=_metadata(reader), reader=reader)


def load_gguf(path: str | os.PathLike, *, progress: bool = True) -> GGUFCheckpoint:
    """Load a llama / qwen2 / qwen3 GGUF file as an HF-named float32 state dict plus an HF config dict.

    Every tensor is dequantized to float32 with ``gguf.quants.dequantize``; llama-family Q/K rows
    are put back into HF's rotate-half layout (see module docstring). Raises ``FileNotFoundError``
    for a missing file, :class:`GGUFFormatError` for a non-GGUF / truncated / corrupt file and
    :class:`UnsupportedGGUFError` for an unsupported architecture or tensor type; nothing is
    silently dropped or zero-filled (unknown or missing tensors are errors).
    """
    checkpoint = open_gguf(path)
    lazy = checkpoint.state_dict
    bar = tqdm(lazy, desc=f"Loading {os.path.basename(checkpoint.path)}", unit="tensor",
               disable=not progress, leave=False)
    checkpoint.state_dict = {name: lazy[name] for name in bar}
    bar.close()
    return checkpoint  # the memory map closes with ``lazy``: every tensor above is a copy


def _name_plan(tensors: dict, arch: str, cfg: dict, path: str) -> tuple[dict[str, str], str | None]:
    """({HF name: GGUF name}, the rope_freqs tensor's name or None); unknown tensors are an error:
    a silently dropped weight is a wrong model."""
    names: dict[str, str] = {}
    unexpected, rope_freqs = [], None
    for name in tensors:
        if name in _GLOBAL_MAP:
            names[_GLOBAL_MAP[name]] = name
            continue
        if name == _ROPE_FREQS:
            rope_freqs = name
            continue
        m = _BLK_RE.match(name)
        if m and int(m.group(1)) < cfg["num_hidden_layers"]:
            suffix = m.group(2)
            if suffix in _LAYER_MAP:
                names[f"model.layers.{m.group(1)}.{_LAYER_MAP[suffix]}"] = name
                continue
            if suffix.split(".")[0] in _IGNORED_LAYER_SUFFIXES:
                continue
        unexpected.append(name)
    if unexpected:
        raise UnsupportedGGUFError(
            f"{path}: unexpected tensors for architecture {arch!r}: {', '.join(unexpected[:8])}"
            + (" ..." if len(unexpected) > 8 else ""), path)
    return names, rope_freqs


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape (torch layout) of every tensor the config calls for."""
    n_heads, n_kv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    d, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (n_heads * dh, d),
            p + "self_attn.k_proj.weight": (n_kv * dh, d),
            p + "self_attn.v_proj.weight": (n_kv * dh, d),
            p + "self_attn.o_proj.weight": (d, n_heads * dh),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        })
        if cfg["model_type"] == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,)})
        if cfg["attention_bias"]:
            shapes.update({
                p + "self_attn.q_proj.bias": (n_heads * dh,),
                p + "self_attn.k_proj.bias": (n_kv * dh,),
                p + "self_attn.v_proj.bias": (n_kv * dh,),
            })
    return shapes


def load_gguf_tokenizer(path: str | os.PathLike, reader=None):
    """A transformers fast tokenizer built offline from the GGUF metadata (chat template included).

    Byte-level BPE files (``tokenizer.ggml.model = "gpt2"``: SmolLM2, Llama 3, Qwen2) and
    SentencePiece BPE files (``"llama"``: Llama 2, Mistral) are built with the ``tokenizers`` library
    from the parsed metadata (:mod:`.gguf_tokenizer`), so no torch is imported; other tokenizer
    models go through transformers' GGUF converter, which needs torch.
    Errors like :func:`load_gguf`, plus :class:`GGUFFormatError` for a file without a tokenizer and
    :class:`UnsupportedGGUFError` when no tokenizer can be built from the metadata.
    """
    path = os.fspath(path)
    reader = reader if reader is not None else _open_reader(path)  # ``reader``: open_gguf's, parsed already
    kind = _field_value(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GGUFFormatError(f"{path}: GGUF file holds no tokenizer (no tokenizer.ggml.model)", path)
    if kind not in ("gpt2", "llama"):
        return _transformers_gguf_tokenizer(path, kind)
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    merges = _field_value(reader, "tokenizer.ggml.merges")
    if not tokens or (kind == "gpt2" and merges is None):
        raise GGUFFormatError(f"{path}: {kind} tokenizer without tokenizer.ggml.tokens"
                              + (" or .merges" if kind == "gpt2" else ""), path)
    ids = {name: _field_value(reader, f"tokenizer.ggml.{key}") for name, key in
           (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))}
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(_field_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    types = _field_value(reader, "tokenizer.ggml.token_type")
    try:
        if kind == "gpt2":
            backend = gguf_tokenizer.byte_level_bpe(tokens, merges, types, _field_value(reader, "tokenizer.ggml.pre"),
                                                    ids["bos_token"], add_bos)
        else:
            backend = gguf_tokenizer.sentencepiece_bpe(tokens, _field_value(reader, "tokenizer.ggml.scores"), merges,
                                                       types, ids["bos_token"], add_bos)
    except Exception as e:  # the tokenizers library rejects inconsistent vocabularies / merges
        raise UnsupportedGGUFError(f"{path}: could not build a tokenizer from the GGUF metadata "
                                   f"({type(e).__name__}: {e})", path) from e
    return gguf_tokenizer.wrap(backend, tokens, ids, _field_value(reader, "tokenizer.chat_template"), add_bos)


def _transformers_gguf_tokenizer(path: str, kind: str):
    """transformers' GGUF converter (needs torch): tokenizer models other than byte-level BPE."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers is heavy; other tokenizers do without it

    directory, name = os.path.split(os.path.abspath(path))
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except Exception as e:
        raise UnsupportedGGUFError(
            f"{path}: could not build a transformers tokenizer for tokenizer.ggml.model={kind!r} "
            f"({type(e).__name__}: {e}); only 'gpt2' and 'llama' tokenizers are built without torch", path) from e
    if not getattr(tok, "chat_template", None):
        chat_template = _field_value(_open_reader(path), "tokenizer.chat_template")
        if chat_template:
            tok.chat_template = chat_template
    return tok
