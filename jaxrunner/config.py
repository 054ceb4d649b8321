"""EngineConfig: every knob of an engine instance, validated once at construction."""
from __future__ import annotations

import dataclasses
import os

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    seed: int = 0
    page_size: int = 16
    num_pages: int | None = None           # overrides memory-based sizing of the KV pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_num_prefill_seqs: int | None = 8   # most prefill chunks (>1 token) in one step; None: no limit
    max_model_len: int | None = 2048        # capped by the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True           # plan step N+1 while step N runs on the device
    attention_impl: str = "auto"            # auto | pallas | jax_tpu (TPU) | native (CPU) | xla | reference
    kv_cache_dtype: str | None = None       # defaults to dtype (float32 for bf16 on CPU without the native kernel)
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float = 0.9         # fraction of device memory an accelerator may use
    warmup_inputs: str = "random"           # random | zeros
    quantization: str | None = None         # None | "int8" | "int4" (weight-only) | "w8a8" (models/quant.py)
    quantization_group_size: int = 32       # int4: inputs per scale (32 or 64)
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "JAXRUNNER_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxrunner", "xla")))
    min_token_bucket: int = 1
    tensor_parallel_size: int = 1           # devices that split one model (heads, MLP, vocabulary)
    data_parallel_size: int = 1             # independent engine replicas, each on its own devices
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            ("dtype", self.dtype in ("float32", "bfloat16", "float16")),
            ("page_size", self.page_size >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("max_num_prefill_seqs", self.max_num_prefill_seqs is None or self.max_num_prefill_seqs >= 1),
            ("num_pages", self.num_pages is None or self.num_pages >= 2),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1),
            ("attention_impl", self.attention_impl in ("auto", "pallas", "jax_tpu", "xla", "native", "reference")),
            ("memory_utilization", 0.0 < self.memory_utilization <= 1.0),
            ("warmup_inputs", self.warmup_inputs in ("random", "zeros")),
            ("tensor_parallel_size", isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1),
            ("data_parallel_size", isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1),
        ]
        from jaxrunner.models.quant import check_quantization
        check_quantization(self.quantization, self.quantization_group_size)
        for name, ok in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}: invalid value {getattr(self, name)!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"EngineConfig.max_num_seqs ({self.max_num_seqs}) exceeds "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
