"""How far an attention implementation may differ from the reference, from the dtype and the
precision of the dots it actually runs.

Error model, for an output ``o = sum_i p_i v_i / sum_i p_i`` compared with the reference (float32
math on the same cache values, full-precision dots):

* every implementation casts the probabilities ``p`` to the dot's operand format for ``P @ V``;
  a relative error ``u`` per ``p_i`` moves ``o`` by at most ``u * max|v|``;
* when the dot's operand format is narrower than the cache (a float32 cache on TF32 or one-pass
  bf16 dots), ``q``, ``k`` and ``v`` are rounded too: a score ``s`` is off by about ``2u|s|``, and
  ``exp`` turns that into a relative error of ``p``; ``|s|`` stays below ~6 for unit-normal data
  at the usual ``1/sqrt(D)`` scale, so such dots get ``ROUNDED_INPUTS_FACTOR = 32`` where exact
  inputs get ``EXACT_INPUTS_FACTOR = 4``;
* float32 sums over ``n`` cache rows in a different order (online softmax vs one pass) add about
  ``sqrt(n)`` float32 roundings, counted with a factor 4.

The tolerance is ``max|v| * (factor * u + 4 * sqrt(n) * u_f32)``, with ``u`` the unit roundoff
(half the machine epsilon) of the narrowest dot operand format.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "tf32": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float16": 2.0 ** -11}
EXACT_INPUTS_FACTOR = 4
ROUNDED_INPUTS_FACTOR = 32


def dot_format(impl: str, dtype, platform: str | None = None) -> str:
    """The narrowest operand format the dots of ``impl`` use for a cache of ``dtype``.

    16-bit caches: their own format (``p`` is cast to it). float32 caches: full float32 for our
    kernels and the XLA paths, which ask for ``Precision.HIGHEST``; jax's TPU kernel runs its
    float32 dots at the TPU default, one bfloat16 pass.
    """
    name = jnp.dtype(dtype).name
    if name != "float32":
        return name
    platform = (platform or jax.default_backend()).lower()
    return "bfloat16" if impl == "jax_tpu" and platform == "tpu" else "float32"


def attention_tolerance(impl: str, dtype, *, max_abs_v: float, max_kv_len: int,
                        platform: str | None = None) -> float:
    """Max abs difference from the reference that ``impl`` may show (see the module docstring)."""
    fmt = dot_format(impl, dtype, platform)
    u = UNIT_ROUNDOFF[fmt]
    factor = EXACT_INPUTS_FACTOR if fmt == jnp.dtype(dtype).name else ROUNDED_INPUTS_FACTOR
    accumulation = 4 * math.sqrt(max(1, max_kv_len)) * UNIT_ROUNDOFF["float32"]
    return float(max_abs_v) * (factor * u + accumulation)
