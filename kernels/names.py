"""The attention implementations ``jaxrunner.kernels`` has: their names and where each lives,
written once, without JAX.

``jaxrunner.config`` (imported by host-only code), the CLI's flags and the kernels' dispatch all
read this table; importing it loads no JAX (``jaxrunner.kernels`` imports its modules on first
use). A new implementation is its module here plus one entry of ``ATTENTION_KERNELS``. Which of
them run on a given platform is the capability query's answer (``jaxrunner.kernels.capabilities``);
which one ``auto`` picks is ``dispatch.choose_impl``'s.
"""
from __future__ import annotations

# name -> (module of jaxrunner.kernels, its function): every function takes
# (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap)
ATTENTION_KERNELS = {
    "reference": ("reference", "ragged_paged_attention_reference"),  # plain jnp: the oracle
    "xla": ("xla", "ragged_paged_attention_xla"),                    # plain XLA, any platform
    "native": ("native", "ragged_paged_attention_native"),           # the C++ CPU kernel (XLA FFI)
    "pallas": ("pallas_kernel", "ragged_paged_attention_pallas"),    # Triton on GPU, Mosaic on TPU
    "jax_tpu": ("jax_tpu", "ragged_paged_attention_jax_tpu"),        # jax's own TPU kernel
}

ATTENTION_IMPLS = tuple(ATTENTION_KERNELS)
"""Every ragged paged attention implementation, by name."""

FP8_POOL_IMPLS = tuple(name for name in ATTENTION_IMPLS if name not in ("pallas", "jax_tpu"))
"""The implementations that read 8-bit float pages (``kv_cache_dtype`` "fp8*"): the Pallas
kernels and jax's TPU kernel multiply in the pages' dtype, their tiles laid out for 16 and 32 bits."""

AUTO = "auto"
ATTENTION_IMPL_CHOICES = (AUTO, *ATTENTION_IMPLS)
"""What a user may ask for: ``auto`` (the best that runs for the model's shapes) or one implementation."""

CPU_MATMUL_CHOICES = (AUTO, "xla", "onednn")
"""Where a CPU engine's float linear products run (``EngineConfig.cpu_matmul``): ``auto`` (weights
packed for oneDNN's matmul where it was measured faster on this CPU kind, see
``platform_support.ONEDNN_FASTER``, and the rest transposed where XLA's dot takes them faster so,
``XLA_WEIGHTS_NK``), ``xla`` (XLA's dot on the weights as the model holds them) or ``onednn`` (every
bf16 and float32 weight packed for oneDNN)."""
