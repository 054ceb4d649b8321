"""One entry point from a model name to (config, params, tokenizer), whatever the source format."""
from __future__ import annotations

import dataclasses
import logging
import time

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.loading.resolve import ModelSource, resolve_model
from jaxrunner.models.params import cast_params, params_count, params_from_state_dict, params_nbytes

logger = logging.getLogger("jaxrunner")


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    hf_config: dict
    params: dict
    tokenizer: object
    source: ModelSource
    dtype: str
    load_seconds: float

    @property
    def num_params(self) -> int:
        return params_count(self.params)

    @property
    def nbytes(self) -> int:
        return params_nbytes(self.params)

    def summary(self) -> str:
        return (f"loaded {self.source.path} ({self.source.kind}) as {self.dtype}: "
                f"{self.num_params / 1e6:.1f}M params, {self.nbytes / 2**20:.1f} MiB, {self.load_seconds:.2f} s")


def _read_source(source: ModelSource, dtype: str, progress: bool):
    """(hf_config, params, tokenizer) for one source kind."""
    if source.kind == "orbax":
        from jaxrunner.models.loading.orbax_ckpt import load_checkpoint

        params, hf_config, tokenizer = load_checkpoint(source.path, dtype=dtype)
        ModelConfig.from_hf_dict(hf_config, source=source.path)  # validate before use
        return hf_config, cast_params(params, dtype), tokenizer
    if source.kind == "gguf":
        from jaxrunner.models.loading.gguf import load_gguf, load_gguf_tokenizer

        checkpoint = load_gguf(source.path, progress=progress)
        hf_config, state, tokenizer = checkpoint.hf_config, checkpoint.state_dict, load_gguf_tokenizer(source.path)
    else:
        from jaxrunner.models.loading.hf import load_hf_state_dict, load_hf_tokenizer, read_hf_config

        hf_config = read_hf_config(source.path)
        ModelConfig.from_hf_dict(hf_config, source=source.path)  # fail on architecture before reading weights
        state, tokenizer = load_hf_state_dict(source.path, progress=progress), load_hf_tokenizer(source.path)
    cfg = ModelConfig.from_hf_dict(hf_config, source=source.path)
    return hf_config, params_from_state_dict(state, cfg, dtype, source=source.path), tokenizer


def load_model(model: str, dtype: str = "float32", progress: bool = True) -> LoadedModel:
    source = resolve_model(model)
    start = time.perf_counter()
    hf_config, params, tokenizer = _read_source(source, dtype, progress)
    config = ModelConfig.from_hf_dict(hf_config, source=source.path)
    loaded = LoadedModel(config, hf_config, params, tokenizer, source, dtype, time.perf_counter() - start)
    logger.info(loaded.summary())
    return loaded
