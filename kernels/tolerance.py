"""How far an attention implementation may differ from the reference, from the dtype and the
precision of the dots it actually runs.

Error model, for an output ``o = sum_i p_i v_i / sum_i p_i`` compared with the reference (float32
math on the same cache values, full-precision dots):

* every implementation casts the probabilities ``p`` to the dot's operand format for ``P @ V``;
  a relative error ``u`` per ``p_i`` moves ``o`` by at most ``u * max|v|`` (``EXACT_INPUTS_FACTOR
  = 4`` of them; ``ROUNDED_INPUTS_FACTOR = 8`` where the dots also round q, k and v);
* a score ``s`` off by ``e`` turns into a relative error ``e`` of ``exp(s)``, in the numerator and
  the denominator alike. Scores carry an error proportional to their size: ``2u|s|`` where the
  dot rounds ``q`` and ``k`` to a narrower format (a float32 cache on TF32 or one-pass bf16), and
  a few float32 roundings of ``|s|`` otherwise (the dot's order of sums; the log2(e) folded into
  the scale for ``exp2``). So the tolerance grows with the largest live score:
  ``SCORE_FACTOR = 4`` times its unit roundoff times ``max|s|``. Unit-normal data at the usual
  ``1/sqrt(D)`` scale keeps ``|s|`` under ``ASSUMED_MAX_ABS_SCORE = 6``, the default; a caller
  that knows its scores (``PagedCase.max_abs_score``) passes them;
* float32 sums over ``n`` cache rows in a different order (online softmax vs one pass) add about
  ``sqrt(n)`` float32 roundings, counted with a factor 4.

The tolerance is ``max|v| * (factor * u + SCORE_FACTOR * u_s * max|s| + 4 * sqrt(n) * u_f32)``,
with ``u`` the unit roundoff (half the machine epsilon) of the narrowest dot operand format and
``u_s`` that of the scores' inputs (``u`` when rounded, float32's when exact).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrunner.kernels.kv_write import is_fp8

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "tf32": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float16": 2.0 ** -11}
EXACT_INPUTS_FACTOR = 4
ROUNDED_INPUTS_FACTOR = 8
SCORE_FACTOR = 4
ASSUMED_MAX_ABS_SCORE = 6.0


def dot_format(impl: str, dtype, platform: str | None = None) -> str:
    """The narrowest operand format the dots of ``impl`` use for a cache of ``dtype``.

    16-bit caches: their own format (``p`` is cast to it). 8-bit float caches (read only by the
    native kernel and the XLA paths, which widen them exactly to float32): the bf16 of the queries
    and outputs that come with them. float32 caches: full float32 for our
    kernels and the XLA paths, which ask for ``Precision.HIGHEST``; jax's TPU kernel runs its
    float32 dots at the TPU default, one bfloat16 pass.
    """
    name = jnp.dtype(dtype).name
    if is_fp8(dtype):
        return "bfloat16"
    if name != "float32":
        return name
    platform = (platform or jax.default_backend()).lower()
    return "bfloat16" if impl == "jax_tpu" and platform == "tpu" else "float32"


def attention_tolerance(impl: str, dtype, *, max_abs_v: float, max_kv_len: int,
                        platform: str | None = None, max_abs_score: float | None = None) -> float:
    """Max abs difference from the reference that ``impl`` may show (see the module docstring).
    ``max_abs_score``: the largest ``|score|`` of a live query/key pair (after scale and soft
    cap); None assumes unit-normal data (``ASSUMED_MAX_ABS_SCORE``)."""
    fmt = dot_format(impl, dtype, platform)
    u = UNIT_ROUNDOFF[fmt]
    exact = fmt == jnp.dtype(dtype).name
    factor = EXACT_INPUTS_FACTOR if exact else ROUNDED_INPUTS_FACTOR
    score_roundoff = UNIT_ROUNDOFF["float32"] if exact else u
    scores = ASSUMED_MAX_ABS_SCORE if max_abs_score is None else float(max_abs_score)
    accumulation = 4 * math.sqrt(max(1, max_kv_len)) * UNIT_ROUNDOFF["float32"]
    return float(max_abs_v) * (factor * u + SCORE_FACTOR * score_roundoff * scores + accumulation)
