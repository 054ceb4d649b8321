"""Ragged paged attention and the KV page write (installed as ``jaxrunner.kernels``)."""
if __name__ != "jaxrunner.kernels":
    # Found under the top-level name `kernels` because the repository root is on sys.path (a shell
    # or `python -m pytest` in the checkout). That name belongs to another PyPI project which
    # transformers probes for by importing it; raising here would break `import transformers`.
    # Instead look like an empty namespace package: the probe then reports "not installed"
    # (transformers checks for a missing __file__) and nothing of ours is reachable as `kernels`.
    __file__ = None
    __path__ = []
else:
    from jaxrunner.kernels.blocks import SCRATCH_PAGE
    from jaxrunner.kernel_names import ATTENTION_IMPLS
    from jaxrunner.kernels.dispatch import choose_impl, ragged_paged_attention, resolve_impl, write_kv_and_attend
    from jaxrunner.kernels.kv_write import write_kv_pages

    __all__ = ["SCRATCH_PAGE", "ATTENTION_IMPLS", "choose_impl", "ragged_paged_attention", "resolve_impl",
               "write_kv_pages", "write_kv_and_attend"]
