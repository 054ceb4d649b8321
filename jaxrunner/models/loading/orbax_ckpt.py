"""jaxrunner's own checkpoint format: the params pytree through orbax-checkpoint.

Layout of a checkpoint directory::

    <dir>/jaxrunner_checkpoint.json   marker + metadata (format, format_version, dtype, ...) -- written last
    <dir>/config.json                 the HF config dict the params were built from
    <dir>/tokenizer*.json, ...        ``tokenizer.save_pretrained(dir)`` (optional)
    <dir>/params/                     orbax PyTree checkpoint of the params pytree

The params pytree is the one of "Contract: model parameters" (docs/architecture.md): a dict with
``"embed"``, ``"layers"`` (a list of dicts), ``"final_norm"`` and optionally ``"lm_head"``; any
pytree of arrays round-trips. Arrays come back bit-identical (float32, bfloat16, ...) as host numpy
arrays, or as ``jax.Array`` placed by ``shardings`` when given.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from typing import Any

import numpy as np

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_FORMAT_VERSION",
    "MARKER_FILE",
    "CheckpointError",
    "is_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_info",
]

CHECKPOINT_FORMAT = "jaxrunner-orbax"
# 2: q/k/v grouped by KV head and gate/up interleaved (jaxrunner.models.params), so a checkpoint
#    restores straight into any tensor-parallel sharding. Version 1 held [q | k | v], [gate | up].
CHECKPOINT_FORMAT_VERSION = 2
MARKER_FILE = "jaxrunner_checkpoint.json"
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A jaxrunner checkpoint directory is not one, is incomplete, or is corrupt."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding a jaxrunner checkpoint marker."""
    return os.path.isfile(os.path.join(os.fspath(path), MARKER_FILE))


def _leaves_dtype(params) -> str:
    import jax  # lazy: the format readers load JAX only to save or restore weights

    dtypes = {str(np.dtype(x.dtype)) for x in jax.tree_util.tree_leaves(params)}
    if not dtypes:
        return "none"
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def _to_host(params):
    """Fully addressable jax arrays -> numpy (topology-free checkpoint); the rest stays as is."""
    import jax  # lazy: the format readers load JAX only to save or restore weights

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(one, params)


def save_checkpoint(dst_dir: str | os.PathLike, params, hf_config: dict, tokenizer=None, *,
                    overwrite: bool = False, generation_config: dict | None = None) -> str:
    """Write ``params`` (pytree of jax/numpy arrays), ``hf_config``, ``tokenizer`` and the source's
    ``generation_config`` (as generation_config.json) to ``dst_dir``.

    ``dst_dir`` must not exist, be empty, or (with ``overwrite=True``) hold a jaxrunner checkpoint,
    which is replaced. The marker file is written last, so an interrupted save is recognised as
    incomplete by :func:`load_checkpoint`. Returns the absolute directory.
    """
    # lazy: orbax is heavy, and the format readers load JAX only to save or restore weights
    import jax
    import orbax.checkpoint as ocp

    dst = os.path.abspath(os.fspath(dst_dir))
    if os.path.exists(dst):
        if not os.path.isdir(dst):
            raise CheckpointError(f"{dst}: exists and is not a directory", dst)
        if os.listdir(dst):
            if not overwrite:
                raise CheckpointError(f"{dst}: directory is not empty (pass overwrite=True to replace "
                                      f"an existing jaxrunner checkpoint)", dst)
            if not is_checkpoint(dst):
                raise CheckpointError(f"{dst}: refusing to overwrite a directory that is not a "
                                      f"jaxrunner checkpoint", dst)
            shutil.rmtree(dst)
    os.makedirs(dst, exist_ok=True)

    leaves = jax.tree_util.tree_leaves(params)
    if not leaves:
        raise ValueError("save_checkpoint: params holds no arrays")
    if not isinstance(hf_config, dict):
        raise TypeError(f"save_checkpoint: hf_config must be a dict, got {type(hf_config).__name__}")

    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(os.path.join(dst, PARAMS_DIR), _to_host(params))
    with open(os.path.join(dst, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(dst)
    if generation_config is not None:
        with open(os.path.join(dst, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2, sort_keys=True)
    marker = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "dtype": _leaves_dtype(params),
        "num_arrays": len(leaves),
        "num_parameters": int(sum(int(np.prod(x.shape)) for x in leaves)),
        "has_tokenizer": tokenizer is not None,
    }
    try:
        marker["jaxrunner_version"] = importlib.metadata.version("jaxrunner")
    except Exception:
        pass
    tmp = os.path.join(dst, MARKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=2)
    os.replace(tmp, os.path.join(dst, MARKER_FILE))
    return dst


def read_checkpoint_info(src_dir: str | os.PathLike) -> dict:
    """The marker metadata of a checkpoint; errors like :func:`load_checkpoint`."""
    src = os.path.abspath(os.fspath(src_dir))
    if not os.path.exists(src):
        raise FileNotFoundError(f"jaxrunner checkpoint directory not found: {src}")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: not a directory (a jaxrunner checkpoint is a directory)", src)
    marker = os.path.join(src, MARKER_FILE)
    if not os.path.isfile(marker):
        raise CheckpointError(f"{src}: not a jaxrunner checkpoint, or an incomplete one "
                              f"({MARKER_FILE} missing)", src)
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{src}: corrupt checkpoint: cannot read {MARKER_FILE} ({e})", src) from e
    if not isinstance(info, dict) or info.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{src}: {MARKER_FILE} does not describe a {CHECKPOINT_FORMAT} checkpoint", src)
    if int(info.get("format_version", -1)) > CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{src}: checkpoint format version {info.get('format_version')} is newer than this "
            f"jaxrunner supports ({CHECKPOINT_FORMAT_VERSION})", src)
    if int(info.get("format_version", -1)) < CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{src}: checkpoint format version {info.get('format_version')} stores the fused weights in an "
            f"older layout; convert the original model again with `jaxrunner convert`", src)
    return info


def load_checkpoint(src_dir: str | os.PathLike, dtype=None, *, shardings=None,
                    load_tokenizer: bool = True) -> tuple[Any, dict, Any]:
    """Restore ``(params, hf_config, tokenizer)`` saved by :func:`save_checkpoint`.

    ``dtype``: cast every array on restore, e.g. ``"bfloat16"`` (``None`` keeps the saved dtypes,
    bit-identical).
    ``shardings``: ``None`` restores host numpy arrays; otherwise a pytree matching ``params`` of
    ``jax.sharding.Sharding`` (or a single sharding for all leaves, or a function of the leaf's key
    path), restored as ``jax.Array`` with each device reading only its own slice.
    ``tokenizer`` is ``None`` when the checkpoint holds none (or ``load_tokenizer=False``).
    """
    # lazy: orbax is heavy, and the format readers load JAX only to save or restore weights
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    src = os.path.abspath(os.fspath(src_dir))
    info = read_checkpoint_info(src)
    cfg_path = os.path.join(src, CONFIG_FILE)
    try:
        with open(cfg_path) as f:
            hf_config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{src}: corrupt checkpoint: {CONFIG_FILE} missing", src) from None
    except ValueError as e:
        raise CheckpointError(f"{src}: corrupt checkpoint: {CONFIG_FILE} is not valid JSON ({e})", src) from e

    params_dir = os.path.join(src, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{src}: corrupt checkpoint: {PARAMS_DIR}/ missing", src)
    ckptr = ocp.PyTreeCheckpointer()
    try:
        meta = ckptr.metadata(params_dir)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
    except Exception as e:
        raise CheckpointError(f"{src}: corrupt checkpoint: cannot read the params metadata "
                              f"({type(e).__name__}: {e})", src) from e
    if tree is None:
        raise CheckpointError(f"{src}: corrupt checkpoint: no params metadata", src)

    np_dtype = None if dtype is None else jnp.dtype(dtype)  # accepts "bfloat16" too
    if shardings is None:
        restore_args = jax.tree_util.tree_map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np_dtype), tree)
    else:
        if isinstance(shardings, jax.sharding.Sharding):
            shard_tree = jax.tree_util.tree_map(lambda _: shardings, tree)
        elif callable(shardings):  # key path -> sharding, for callers that do not know the tree
            shard_tree = jax.tree_util.tree_map_with_path(lambda path, _: shardings(path), tree)
        else:
            shard_tree = shardings
        try:
            restore_args = jax.tree_util.tree_map(
                lambda _, s: ocp.ArrayRestoreArgs(sharding=s, dtype=np_dtype, restore_type=jax.Array),
                tree, shard_tree)
        except ValueError as e:
            raise ValueError(f"load_checkpoint: shardings do not match the checkpoint's params tree "
                             f"({e})") from e
    try:
        params = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as e:
        raise CheckpointError(f"{src}: corrupt checkpoint: restoring params failed "
                              f"({type(e).__name__}: {e})", src) from e

    n = len(jax.tree_util.tree_leaves(params))
    if "num_arrays" in info and n != int(info["num_arrays"]):
        raise CheckpointError(f"{src}: corrupt checkpoint: restored {n} arrays, marker says "
                              f"{info['num_arrays']}", src)

    tokenizer = None
    if load_tokenizer and info.get("has_tokenizer", True) and (
            os.path.isfile(os.path.join(src, "tokenizer_config.json"))
            or os.path.isfile(os.path.join(src, "tokenizer.json"))):
        from transformers import AutoTokenizer  # lazy: transformers is heavy; only a saved tokenizer needs it

        try:
            tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
        except Exception as e:
            raise CheckpointError(f"{src}: corrupt checkpoint: cannot load the tokenizer "
                                  f"({type(e).__name__}: {e})", src) from e
    elif load_tokenizer and info.get("has_tokenizer"):
        raise CheckpointError(f"{src}: corrupt checkpoint: tokenizer files missing", src)
    return params, hf_config, tokenizer
