"""A Flax NNX module served directly: the example Llama gives the built-in Llama's tokens."""
from __future__ import annotations

import jax
import pytest
from flax import nnx

from engine_helpers import TINY_ENGINE, count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import LLM, SamplingParams
from jaxrunner.models.loading.hf import open_hf_state_dict, read_hf_config
from jaxrunner.models.nnx_llama import NnxLlama
from jaxrunner.models.registry import config_from_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def nnx_model(model_dir):
    config = config_from_hf(read_hf_config(model_dir))
    return NnxLlama.from_state_dict(open_hf_state_dict(model_dir), config)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 512, 3, 70, seed=4)


def test_nnx_llama_gives_the_builtin_tokens(model_dir, nnx_model, prompts):
    """Same weights, same tokens: through the paged cache, chunked prefill and a mixed batch."""
    builtin = make_llm(model_dir)
    served = LLM.from_nnx(nnx_model, tokenizer=model_dir, **TINY_ENGINE)
    expected = token_ids(builtin.generate(prompts, GREEDY, use_tqdm=False))
    with count_compilations() as compiles:
        got = token_ids(served.generate(prompts, GREEDY, use_tqdm=False))
    assert got == expected
    assert compiles == []
    assert served.generate("Paris is", GREEDY, use_tqdm=False)[0].outputs[0].text


def test_nnx_update_weights_takes_the_module_state(nnx_model, prompts):
    served = LLM.from_nnx(nnx_model, **TINY_ENGINE)
    before = token_ids(served.generate(prompts[:3], GREEDY, use_tqdm=False))
    state = nnx.state(nnx_model)
    scaled = jax.tree.map(lambda x: x * 1.3, state)
    with count_compilations() as compiles:
        served.update_weights(scaled)
        after = token_ids(served.generate(prompts[:3], GREEDY, use_tqdm=False))
    assert compiles == [] and after != before
    served.update_weights(state)
    assert token_ids(served.generate(prompts[:3], GREEDY, use_tqdm=False)) == before


class _TwiceAttending(nnx.Module):
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, positions, attend):
        self.layer(x, positions, attend)
        return self.layer(x, positions, attend)


def test_a_module_off_the_protocol_is_refused(nnx_model):
    with pytest.raises(ValueError, match="lacks config, embed, layers, norm, logits"):
        LLM.from_nnx(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), **TINY_ENGINE)
    config = nnx_model.config
    broken = NnxLlama(config, nnx.Rngs(1))
    broken.layers = type(broken.layers)([_TwiceAttending(layer) for layer in broken.layers])
    with pytest.raises(ValueError, match=r"layers\[0\]: called attend 2 times"):
        LLM.from_nnx(broken, **TINY_ENGINE)
