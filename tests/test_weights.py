"""Weights in memory: serve a params pytree, read it back, and swap it between steps with no compile."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import TINY_ENGINE, count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import LLM, SamplingParams
from jaxrunner.models.loading.hf import load_hf_tokenizer, read_hf_config
from jaxrunner.models.params import param_shapes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(6, llm.engine.model.config.vocab_size, 20, 40, seed=3)


def _perturbed(params, seed: int):
    """Other weights of the same shapes and dtypes: every leaf nudged by seeded noise."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


def test_param_shapes_describe_the_loaded_tree(llm):
    shapes = jax.tree.map(lambda x: tuple(x.shape), llm.params)
    assert shapes == param_shapes(llm.engine.model.config)


def test_from_params_serves_in_place_and_matches_the_checkpoint(llm, model_dir, prompts):
    given = llm.params
    # cpu_matmul="xla": the weights as given (elsewhere a CPU kind may lay them out for its matmuls)
    served = LLM.from_params(given, read_hf_config(model_dir), tokenizer=model_dir, **dict(TINY_ENGINE, cpu_matmul="xla"))
    assert token_ids(served.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    # the arrays were already on the right device: served as they are, not copied
    assert all(a is b for a, b in zip(jax.tree.leaves(served.params), jax.tree.leaves(given)))
    assert served.get_tokenizer() is not None


def test_update_weights_compiles_nothing_and_equals_a_fresh_engine(model_dir, prompts):
    llm = make_llm(model_dir)
    before = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    new = _perturbed(llm.params, seed=1)
    with count_compilations() as compiles:
        llm.update_weights(new)
        after = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert compiles == []
    fresh = LLM.from_params(new, read_hf_config(model_dir), **TINY_ENGINE)
    assert after == token_ids(fresh.generate(prompts, GREEDY, use_tqdm=False))
    assert after != before


def test_update_weights_empties_the_prefix_cache(model_dir, prompts):
    llm = make_llm(model_dir)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(_perturbed(llm.params, seed=2))
    again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    llm.engine.scheduler.allocator.check_invariants()


def test_requests_in_flight_continue_on_the_new_weights(model_dir, prompts):
    """A swap between steps: running requests finish (on the new weights), no page leaks, and
    their pages are never offered to the prefix cache (their KV mixes both weights)."""
    llm = make_llm(model_dir)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.step(), engine.step()
    llm.update_weights(_perturbed(llm.params, seed=3))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(prompts)))
    allocator = engine.scheduler.allocator
    allocator.check_invariants()
    assert allocator.num_used_pages == 0 and allocator.num_cached_pages == 0


def test_abort_in_flight(model_dir, prompts):
    llm = make_llm(model_dir)
    llm.engine.add_request("r", prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    llm.engine.step()
    llm.update_weights(llm.params, abort_in_flight=True)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def _replace_leaf(params, path: tuple, value):
    params = jax.tree.map(lambda x: x, params)  # a new tree with the same leaves
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return params


@pytest.mark.parametrize("change, message", [
    (lambda p: _replace_leaf(p, ("layers", 1, "wqkv"), p["layers"][1]["wqkv"][:, :-1]), r"\['layers'\]\[1\]\['wqkv'\]: shape"),
    (lambda p: _replace_leaf(p, ("embed",), p["embed"].astype(jnp.bfloat16)), r"\['embed'\]: dtype bfloat16, expected float32"),
    (lambda p: {k: v for k, v in p.items() if k != "final_norm"}, r"\['final_norm'\]: missing"),
    (lambda p: {**p, "extra": p["final_norm"]}, r"\['extra'\]: unknown leaf"),
    (lambda p: [p], r"params: expected the params pytree"),
])
def test_a_wrong_tree_is_refused_and_the_old_weights_keep_serving(llm, prompts, change, message):
    before = token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match=message):
        llm.update_weights(change(llm.params))
    assert token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == before


def test_from_params_checks_before_building_an_engine(llm, model_dir):
    config = read_hf_config(model_dir)
    with pytest.raises(ValueError, match=r"\['lm_head'\]: missing"):
        LLM.from_params({k: v for k, v in llm.params.items() if k != "lm_head"}, config, **TINY_ENGINE)
    mixed = _replace_leaf(llm.params, ("embed",), llm.params["embed"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        LLM.from_params(mixed, config, **TINY_ENGINE)
    with pytest.raises(ValueError, match="dtype='bfloat16': the params are float32"):
        LLM.from_params(llm.params, config, **{**TINY_ENGINE, "dtype": "bfloat16"})


def test_from_params_takes_host_arrays(llm, model_dir, prompts):
    host = jax.tree.map(np.asarray, llm.params)
    served = LLM.from_params(host, read_hf_config(model_dir), tokenizer=load_hf_tokenizer(model_dir), **TINY_ENGINE)
    assert token_ids(served.generate(prompts[:2], GREEDY, use_tqdm=False)) == \
        token_ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))


def test_rollout_logprobs_are_the_served_models(llm, prompts):
    """The differentiable sequence log-probs used for training equal what the engine sampled with."""
    from jaxrunner.rollouts import completion_logprob_sums, pad_rollouts, sequence_logprobs

    outputs = llm.generate(prompts[:3], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                       logprobs=0), use_tqdm=False)
    rollouts = pad_rollouts(outputs, length=64)
    assert rollouts.tokens.shape == (6, 64) and list(rollouts.prompt_index) == [0, 0, 1, 1, 2, 2]
    config = llm.engine.model.config
    per_token = sequence_logprobs(llm.params, config, rollouts.tokens)
    sums = completion_logprob_sums(llm.params, config, rollouts)
    for row, completion in enumerate(c for o in outputs for c in o.outputs):
        start = int(rollouts.prompt_lens[row])
        got = per_token[row, start:start + len(completion.token_ids)]
        assert float(sums[row]) == pytest.approx(completion.cumulative_logprob, abs=1e-3)
        assert float(got.sum()) == pytest.approx(completion.cumulative_logprob, abs=1e-3)
        np.testing.assert_allclose(np.asarray(got), rollouts.sampled_logprobs[row, start:start + len(got)], atol=1e-4)
    grads = jax.grad(lambda p: completion_logprob_sums(p, config, rollouts).sum())(llm.params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_update_weights_while_other_threads_generate(model_dir, prompts):
    """A swap from one thread while another thread's generate is being served: it lands between two
    steps on the engine loop, the generate completes, and later calls see the new weights."""
    import threading

    llm = make_llm(model_dir)
    new = _perturbed(llm.params, seed=4)
    fresh = token_ids(LLM.from_params(new, read_hf_config(model_dir), **TINY_ENGINE)
                      .generate(prompts, GREEDY, use_tqdm=False))
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("out", llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)))
    worker.start()
    llm.update_weights(new)
    worker.join(timeout=300)
    assert len(done["out"]) == len(prompts) and all(len(o.outputs[0].token_ids) == 40 for o in done["out"])
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == fresh


def test_n_samples_share_the_prompt_through_the_prefix_cache(model_dir):
    """generate(n=4): the first sample computes the prompt, the other three reuse its full pages."""
    llm = make_llm(model_dir)
    prompt = random_prompts(1, 512, 60, 60, seed=9)[0]
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 6 for c in out.outputs)
    page = TINY_ENGINE["page_size"]
    assert llm.engine.scheduler.prefix_cache_hit_tokens == 3 * (59 // page) * page
    llm.engine.scheduler.allocator.check_invariants()
