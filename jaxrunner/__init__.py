"""jaxrunner: a JAX/XLA LLM inference runtime (paged KV cache, Pallas ragged paged attention,
continuous batching, warm-up on random dummy batches)."""
from jaxrunner.config import EngineConfig
from jaxrunner.lora_request import LoRARequest
from jaxrunner.outputs import CompletionOutput, RequestOutput
from jaxrunner.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "LLMEngine", "create_engine", "EngineConfig", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput"]


def __getattr__(name):  # LLM and LLMEngine pull in JAX and transformers: import them on first use
    if name == "LLM":
        from jaxrunner.llm import LLM  # lazy: `import jaxrunner` loads no JAX
        return LLM
    if name == "AsyncLLM":
        from jaxrunner.async_llm import AsyncLLM  # lazy: `import jaxrunner` stays light
        return AsyncLLM
    if name == "LLMEngine":
        from jaxrunner.engine.engine import LLMEngine  # lazy: `import jaxrunner` stays light
        return LLMEngine
    if name == "create_engine":  # an LLMEngine for an EngineConfig: loads, starts the executors
        from jaxrunner.engine_factory import create_engine  # lazy: `import jaxrunner` loads no JAX
        return create_engine
    raise AttributeError(name)
