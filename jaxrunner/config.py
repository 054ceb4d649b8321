"""EngineConfig: every knob of an engine instance, validated once at construction.

Validation here is about the values alone (types, ranges, choices) and costs nothing: a wrong
option fails before any model file is opened. Checks that need the model's config file or the
machine's memory run next, still before any weight is read (``runner/preflight.py``).
"""
from __future__ import annotations

import dataclasses
import numbers
import os

from jaxrunner.kernels.names import ATTENTION_IMPL_CHOICES, CPU_MATMUL_CHOICES

DEFAULT_MODEL = "smollm2-135m-instruct"

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = (None, "auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's names of the 8-bit float pools -> the dtype the pools hold ("fp8" is e4m3, as in vLLM)
FP8_KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
WARMUP_INPUTS = ("random", "zeros")
SPECULATIVE_METHODS = (None, "ngram", "draft_model")
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # 1 + 3 query tokens fill the 4-token bucket a batch-1 decode already has
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


@dataclasses.dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"                     # auto: the checkpoint's dtype where the device computes it natively
    seed: int = 0
    page_size: int = 16
    num_pages: int | None = None           # overrides memory-based sizing of the KV pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_num_prefill_seqs: int | None = 8   # most prefill chunks (>1 token) in one step; None: no limit
    max_model_len: int | None = None        # None: the model's limit, lowered to what the KV pool holds
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True           # plan step N+1 while step N runs on the device
    attention_impl: str = "auto"            # auto | pallas | jax_tpu (TPU) | native (CPU) | xla | reference
    cpu_matmul: str = "auto"                # auto | xla | onednn: where a CPU's linear products run
    # None or "auto": the compute dtype (float32 for bf16 on CPU without the native kernel); "fp8",
    # "fp8_e4m3", "fp8_e5m2": one byte a value, unscaled (saturating), held as float8_e4m3fn/e5m2
    kv_cache_dtype: str | None = None
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float = 0.9         # fraction of device memory an accelerator may use
    warmup_inputs: str = "random"           # random | zeros
    quantization: str | None = None         # None | "int8" | "int4" (weight-only) | "w4a8" | "w8a8" (models/quant.py)
    quantization_group_size: int = 32       # int4: inputs per scale (32 or 64)
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "JAXRUNNER_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxrunner", "xla")))
    min_token_bucket: int = 1
    tensor_parallel_size: int = 1           # devices that split one model (heads, MLP, vocabulary)
    data_parallel_size: int = 1             # independent engine replicas, each on its own devices
    progress: bool = True
    # Speculative decoding, like vLLM's speculative_config: "ngram" proposes the tokens that followed
    # the last occurrence of the most recent n tokens (n from prompt_lookup_max down to _min);
    # "draft_model" proposes greedily with speculative_model, a model sharing the tokenizer.
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None   # default DEFAULT_NUM_SPECULATIVE_TOKENS with a method
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    speculative_model: str | None = None        # draft_model: an alias, a .gguf file or a model directory
    speculative_quantization: str | None = None  # the draft's weights: None or one of quantization's
    # LoRA adapters, as vLLM's: max_loras adapters on the device at once (one batch mixes them),
    # ranks up to max_lora_rank; max_cpu_loras adapters kept in host memory (default max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        _check_str("model", self.model, "an alias, a .gguf file or a model directory")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPL_CHOICES)
        _check_choice("cpu_matmul", self.cpu_matmul, CPU_MATMUL_CHOICES)
        _check_choice("warmup_inputs", self.warmup_inputs, WARMUP_INPUTS)
        for name, low in (("seed", 0), ("page_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                          ("min_token_bucket", 1), ("tensor_parallel_size", 1), ("data_parallel_size", 1)):
            setattr(self, name, _check_int(name, getattr(self, name), low))
        for name, low in (("num_pages", 2), ("max_num_prefill_seqs", 1), ("max_model_len", 1),
                          ("kv_cache_memory_bytes", 1)):
            setattr(self, name, _check_int(name, getattr(self, name), low, optional=True))
        for name in ("max_loras", "max_lora_rank"):
            setattr(self, name, _check_int(name, getattr(self, name), 1))
        self.max_cpu_loras = _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras, optional=True)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling", "progress", "enable_lora"):
            _check_bool(name, getattr(self, name))
        _check_fraction("memory_utilization", self.memory_utilization)
        if self.compilation_cache_dir is not None:
            _check_str("compilation_cache_dir", self.compilation_cache_dir, "a directory path or None")
        # lazy: models.quant (where the formats live) loads JAX, and the config loads none
        from jaxrunner.models.quant import check_quantization

        check_quantization(self.quantization, self.quantization_group_size)
        check_quantization(self.speculative_quantization, self.quantization_group_size, "speculative_quantization")
        self._check_speculative()
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"EngineConfig.max_num_seqs ({self.max_num_seqs}) exceeds "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}); valid: "
                             f"max_num_seqs <= max_num_batched_tokens")

    @property
    def kv_pool_dtype(self) -> str | None:
        """The dtype the KV pages are held in, as ``kv_cache_dtype`` asks (None: the engine's default)."""
        if self.kv_cache_dtype == "auto":
            return None
        return FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    def _check_speculative(self) -> None:
        _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        names = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        for name in names:
            setattr(self, name, _check_int(name, getattr(self, name), 1, optional=True))
        if isinstance(self.speculative_model, os.PathLike):
            self.speculative_model = os.fspath(self.speculative_model)
        if self.speculative_model is not None:
            _check_str("speculative_model", self.speculative_model, "an alias, a .gguf file or a model directory")
        method = self.speculative_method
        _only_with("num_speculative_tokens", self.num_speculative_tokens, method is not None, "speculative_method is set")
        for name in names[1:]:
            _only_with(name, getattr(self, name), method == "ngram", "speculative_method='ngram'")
        for name in ("speculative_model", "speculative_quantization"):
            _only_with(name, getattr(self, name), method == "draft_model", "speculative_method='draft_model'")
        if method == "draft_model" and self.speculative_model is None:
            raise _invalid("speculative_model", None, "the draft model (an alias, a .gguf file or a model directory) "
                           "when speculative_method='draft_model'")
        if method is None:
            return
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
        if self.num_speculative_tokens >= self.max_num_batched_tokens:
            raise _invalid("num_speculative_tokens", self.num_speculative_tokens,
                           f"an integer in [1, max_num_batched_tokens={self.max_num_batched_tokens})")
        if method == "ngram":
            self._fill_prompt_lookup()

    def _fill_prompt_lookup(self) -> None:
        if self.prompt_lookup_max is None:
            self.prompt_lookup_max = max(DEFAULT_PROMPT_LOOKUP_MAX, self.prompt_lookup_min or 1)
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = min(DEFAULT_PROMPT_LOOKUP_MIN, self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _invalid("prompt_lookup_min", self.prompt_lookup_min,
                           f"an integer in [1, prompt_lookup_max={self.prompt_lookup_max}]")


def _only_with(name: str, value, allowed: bool, condition: str) -> None:
    """A speculative option given where its method does not use it."""
    if value is not None and not allowed:
        raise _invalid(name, value, f"None unless {condition}")


def _invalid(name: str, value, valid: str) -> ValueError:
    return ValueError(f"EngineConfig.{name}: invalid value {value!r}; valid: {valid}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if not isinstance(value, (str, type(None))) or value not in choices:
        raise _invalid(name, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_int(name: str, value, low: int, optional: bool = False) -> int | None:
    """``value`` as a Python int if it is an integer (numpy's too; not a bool, not a float) >= ``low``;
    None passes when ``optional``."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise _invalid(name, value, f"an integer >= {low}" + (" or None" if optional else ""))
    return int(value)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise _invalid(name, value, "True or False")


def _check_fraction(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value <= 1.0:
        raise _invalid(name, value, "a number in (0, 1]")


def _check_str(name: str, value, valid: str) -> None:
    if not isinstance(value, str) or not value:
        raise _invalid(name, value, valid)
