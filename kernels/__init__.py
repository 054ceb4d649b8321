"""Ragged paged attention, the KV page write, the native CPU matmuls and the capability query that
says which of them run here (installed as ``jaxrunner.kernels``). Everything outside the package
uses these names only; its modules are private."""
if __name__ != "jaxrunner.kernels":
    # Found under the top-level name `kernels` because the repository root is on sys.path (a shell
    # or `python -m pytest` in the checkout). That name belongs to another PyPI project which
    # transformers probes for by importing it; raising here would break `import transformers`.
    # Instead look like an empty namespace package: the probe then reports "not installed"
    # (transformers checks for a missing __file__) and nothing of ours is reachable as `kernels`.
    __file__ = None
    __path__ = []
else:
    from jaxrunner.kernel_names import ATTENTION_IMPL_CHOICES, ATTENTION_IMPLS
    from jaxrunner.kernels.blocks import SCRATCH_PAGE
    from jaxrunner.kernels.capabilities import XLA_MATMULS, KernelCapabilities, MatmulKernels, capabilities
    from jaxrunner.kernels.dispatch import choose_impl, ragged_paged_attention, resolve_impl, write_kv_and_attend
    from jaxrunner.kernels.kv_write import write_kv_pages
    # the native CPU matmuls, for the products ``capabilities().matmuls`` sends there (call them only then)
    from jaxrunner.kernels.native import (dequantize_native, quantized_matmul_native, quantized_matmul_supported,
                                          small_matmul_native, small_matmul_supported)

    __all__ = ["SCRATCH_PAGE", "ATTENTION_IMPLS", "ATTENTION_IMPL_CHOICES", "choose_impl", "ragged_paged_attention",
               "resolve_impl", "write_kv_pages", "write_kv_and_attend", "capabilities", "KernelCapabilities",
               "MatmulKernels", "XLA_MATMULS", "small_matmul_native", "small_matmul_supported",
               "quantized_matmul_native", "quantized_matmul_supported", "dequantize_native"]
