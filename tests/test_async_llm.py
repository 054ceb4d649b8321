"""The engine loop on a tiny random-weight Llama: LLM calls from many threads and AsyncLLM callers are
served together, each getting exactly its own outputs; callers that leave free their pages at once;
direct engine use is refused while the loop serves; a failed step reaches its callers only."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_helpers import make_llm, random_prompts
from jaxrunner import SamplingParams
from jaxrunner.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(16, llm.engine.model.config.vocab_size, 3, 40, seed=3)


def alone_text(llm, prompt, params=GREEDY) -> tuple[list[int], str]:
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return completion.token_ids, completion.text


def wait_until_idle(llm, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while llm.engine_loop.num_requests() or llm.engine.owner_thread is not None:
        assert time.monotonic() < deadline, "the engine loop did not go idle"
        time.sleep(0.01)


def assert_all_pages_free(llm) -> None:
    allocator = llm.engine.scheduler.allocator
    allocator.check_invariants()
    assert allocator.num_used_pages == 0
    assert not llm.engine.has_unfinished_requests()


def test_eight_threads_mixing_generate_chat_and_stream_get_their_own_outputs(llm, prompts):
    conversations = [[{"role": "user", "content": f"Hello world {i}, the quick brown fox"}] for i in range(4)]
    texts = ["Paris is the capital", "The lazy dog jumps", "JAX compiles programs", "hello there"]
    expected_generate = [alone_text(llm, p) for p in prompts]
    expected_chat = [alone_text(llm, llm.chat_prompt(c)) for c in conversations]
    expected_stream = [alone_text(llm, t)[1] for t in texts]
    failures: list[str] = []

    def worker(index: int) -> None:
        for round_ in range(3):
            kind = (index + round_) % 3
            if kind == 0:
                chosen = [(index + round_ + k) % len(prompts) for k in range(3)]
                got = [o.outputs[0] for o in llm.generate([prompts[i] for i in chosen], GREEDY, use_tqdm=False)]
                want = [expected_generate[i] for i in chosen]
                if [(c.token_ids, c.text) for c in got] != want:
                    failures.append(f"generate {index}/{round_}")
            elif kind == 1:
                i = (index + round_) % len(conversations)
                got = llm.chat(conversations[i], GREEDY, use_tqdm=False)[0].outputs[0]
                if (got.token_ids, got.text) != expected_chat[i]:
                    failures.append(f"chat {index}/{round_}")
            else:
                i = (index + round_) % len(texts)
                if "".join(llm.stream(texts[i], GREEDY)) != expected_stream[i]:
                    failures.append(f"stream {index}/{round_}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    wait_until_idle(llm)
    assert_all_pages_free(llm)


def test_suspended_stream_keeps_its_text_while_generate_runs(llm, prompts):
    expected = alone_text(llm, "The quick brown fox", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stream = llm.stream("The quick brown fox", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    first = next(stream)
    assert llm.generate(prompts[:4], GREEDY, use_tqdm=False)  # runs while the stream is suspended
    assert first + "".join(stream) == expected[1]
    wait_until_idle(llm)
    assert_all_pages_free(llm)


def test_direct_engine_requests_are_not_consumed(llm, prompts):
    engine = llm.engine
    engine.add_request("direct", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="engine.add_request"):
        llm.generate(prompts[1:2], GREEDY, use_tqdm=False)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["direct"].outputs[0].token_ids == alone_text(llm, prompts[0])[0]


def test_direct_engine_use_while_the_loop_serves_raises(llm, prompts):
    stream = llm.stream(prompts[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    with pytest.raises(RuntimeError, match="engine loop"):
        llm.engine.add_request("intruder", prompts[1], GREEDY)
    stream.close()  # leaving early aborts the request
    wait_until_idle(llm)
    assert_all_pages_free(llm)
    llm.engine.add_request("after", prompts[1], GREEDY)  # the loop handed the engine back
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_async_callers_get_their_own_streams_and_cancelled_ones_free_pages(llm, prompts):
    expected = [alone_text(llm, p) for p in prompts[:6]]
    async_llm = AsyncLLM(llm)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def collect(prompt, request_id):
        last = None
        async for output in async_llm.generate(prompt, GREEDY, request_id=request_id):
            last = output
        return last.outputs[0].token_ids, last.outputs[0].text

    async def abandoned(prompt, request_id):
        async for _ in async_llm.generate(prompt, long, request_id=request_id):
            await asyncio.sleep(3600)  # the caller stalls after its first output; it gets cancelled

    async def leaves_after_one(prompt):
        async for _ in async_llm.generate(prompt, long):
            break  # the generator is closed (finalized) and its request aborted
        await asyncio.sleep(0.01)
        assert async_llm.engine_loop.num_requests() == 0  # long before its 60 tokens could be done

    async def main():
        await leaves_after_one(prompts[9])
        doomed = [asyncio.create_task(abandoned(prompts[10 + i], f"doomed-{i}")) for i in range(3)]
        results = await asyncio.gather(*(collect(p, f"kept-{i}") for i, p in enumerate(prompts[:6])))
        with pytest.raises(ValueError, match="request_id"):
            async_llm.add_request(prompts[0], GREEDY, request_id="doomed-0")
        for task in doomed:
            task.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        return results

    assert asyncio.run(main()) == expected
    wait_until_idle(llm)
    assert_all_pages_free(llm)


def test_abort_from_another_task_ends_the_consumer_with_finish_reason_abort(llm, prompts):
    """``AsyncLLM.abort(request_id)`` from elsewhere ends the ``generate()`` consumer with a final output
    (``finish_reason="abort"``, the text so far), as vLLM does; before and after the request reached
    the engine."""
    async_llm = AsyncLLM(llm)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume(request_id):
        outputs = [output async for output in async_llm.generate(prompts[1], long, request_id=request_id)]
        return outputs[-1]

    async def main():
        started = asyncio.create_task(consume("abort-running"))
        while llm.engine_loop.stats.running == 0:
            await asyncio.sleep(0.005)
        await async_llm.abort("abort-running")
        queued = asyncio.create_task(consume("abort-queued"))
        await asyncio.sleep(0)  # submitted, not yet taken by the loop thread
        await async_llm.abort("abort-queued")
        return await asyncio.wait_for(asyncio.gather(started, queued), timeout=60)

    running, queued = asyncio.run(main())
    for final in (running, queued):
        assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(running.outputs[0].token_ids) < 200
    wait_until_idle(llm)
    assert_all_pages_free(llm)


def test_a_failed_step_fails_its_callers_and_the_loop_goes_on(llm, prompts):
    runner = llm.engine.executor.runner
    fetch = runner.fetch

    def failing_fetch(*args):
        raise RuntimeError("device lost (injected)")

    runner.fetch = failing_fetch
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    finally:
        del runner.fetch
    assert runner.fetch == fetch
    wait_until_idle(llm)
    assert_all_pages_free(llm)
    assert llm.generate(prompts[:2], GREEDY, use_tqdm=False)[1].outputs[0].token_ids == alone_text(llm, prompts[1])[0]
