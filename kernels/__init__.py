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
    import importlib as _importlib

    # no JAX: host-only code (the config, the CLI) reads these names
    from jaxrunner.kernels.names import ATTENTION_IMPL_CHOICES, ATTENTION_IMPLS, CPU_MATMUL_CHOICES

    # the rest of the public API, each name from its module, imported (with JAX) on first use; no
    # module may share a public name (importing it would bind the module over the name)
    _PUBLIC = {
        "SCRATCH_PAGE": "blocks",
        "XLA_MATMULS": "platform_support", "KernelCapabilities": "platform_support",
        "MatmulKernels": "platform_support", "capabilities": "platform_support",
        "choose_matmuls": "platform_support", "onednn_unavailable": "platform_support",
        "choose_impl": "dispatch", "ragged_paged_attention": "dispatch", "resolve_impl": "dispatch",
        "write_kv_and_attend": "dispatch", "kv_pool_shapes": "dispatch", "kv_pools": "dispatch",
        "kv_from_pools": "dispatch",
        "write_kv_pages": "kv_write", "is_fp8": "kv_write",
        # the native CPU matmuls, for the products ``capabilities().matmuls`` sends there (call them only then)
        "dequantize_native": "native", "quantized_matmul_native": "native", "quantized_matmul_supported": "native",
        "PanelWeight": "quant_panels", "panel_matmul": "quant_panels", "to_panels": "quant_panels",
        "from_panels": "quant_panels", "fits_panels": "quant_panels", "panel_rows": "quant_panels",
        "small_matmul_native": "native", "small_matmul_supported": "native",
        "silu_mul_native": "native", "silu_mul_supported": "native", "rotary_native": "native",
        "rotary_supported": "native", "sampling_thresholds_native": "native",
        "logprob_stats_native": "native",
        # the CPU's flags as the kernels are built and chosen for (JAXRUNNER_CPU_MAX_ISA caps them)
        "cpu_flags": "cpu_isa", "cpu_features": "native", "max_isa": "cpu_isa",
        "attention_tiles_ready": "native",  # bf16 prefill attention on AMX tiles here
        "onednn_matmul": "onednn", "onednn_pack": "onednn", "onednn_unpack": "onednn",
        "onednn_quant_matmul": "onednn", "onednn_panel_matmul": "onednn",
        "OnednnPackedWeight": "onednn",
        "W8a8TileWeight": "w8a8_tiles", "to_w8a8_tiles": "w8a8_tiles", "from_w8a8_tiles": "w8a8_tiles",
        "fits_w8a8_tiles": "w8a8_tiles", "w8a8_tile_matmul": "w8a8_tiles",
    }
    __all__ = ["ATTENTION_IMPLS", "ATTENTION_IMPL_CHOICES", "CPU_MATMUL_CHOICES", *_PUBLIC]

    def __getattr__(name: str):
        if name not in _PUBLIC:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
