"""Ragged paged attention, the KV page write, the native CPU matmuls and the capability query that
says which of them run here (installed as ``jaxrunner.kernels``). Everything outside the package
uses these names only; its modules are private."""
if __name__ != "jaxrunner.kernels":
    # Found under the top-level name `kernels` because the repository root is on sys.path (a script,
    # a notebook or `python -m ...` started in the checkout). That name belongs to another PyPI project,
    # which transformers imports names from when it is installed. Step aside: load the installed
    # project in our place, or, when there is none, look like an empty namespace package (transformers
    # then reports "not installed": no version and no __file__). Nothing of ours is reachable as `kernels`.
    import sys as _sys

    from jaxrunner._shadowed_import import load_shadowed_package as _load_shadowed

    _installed = _load_shadowed(__name__, __spec__)
    if _installed is not None:
        _sys.modules[__name__] = _installed  # the import statement returns what sys.modules holds
    else:
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
