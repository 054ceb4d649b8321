"""From a model name to loaded params: ``model.py`` is the entry point (``load_model``,
``peek_model``, ``LoadedModel``); the other modules read one format each (``resolve``: names and
paths, ``hf``, ``gguf`` with ``gguf_blocks`` and ``gguf_tokenizer``, ``orbax_ckpt``).

The entry point is re-exported here on first use: it pulls in JAX, which the format readers
(``resolve`` above all) do not need.
"""
ENTRY_POINT = ("LoadedModel", "ModelPeek", "load_model", "peek_model")


def __getattr__(name):
    if name in ENTRY_POINT:
        from jaxrunner.models.loading import model  # lazy: it loads JAX; the format readers do not

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
