"""The names of the attention implementations ``jaxrunner.kernels`` has, written once.

A module of its own, without JAX: ``jaxrunner.config`` (imported by host-only code), the CLI's
flags and the kernels' dispatch all read these tuples, and importing ``jaxrunner.kernels`` would
pull JAX in. Which of them run on a given platform is the kernels' capability query
(``jaxrunner.kernels.capabilities``).
"""
from __future__ import annotations

ATTENTION_IMPLS = ("reference", "xla", "native", "pallas", "jax_tpu")
"""Every ragged paged attention implementation: ``reference`` (plain jnp, the oracle), ``xla`` (plain
XLA, any platform), ``native`` (the C++ CPU kernel), ``pallas`` (Triton on GPU, Mosaic on TPU) and
``jax_tpu`` (jax's own TPU kernel)."""

AUTO = "auto"
ATTENTION_IMPL_CHOICES = (AUTO, *ATTENTION_IMPLS)
"""What a user may ask for: ``auto`` (the best that runs for the model's shapes) or one implementation."""
