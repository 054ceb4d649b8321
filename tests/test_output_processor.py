"""The output processor on its own: sampled tokens fed in as the runner's host arrays, stops
(EOS, stop_token_ids, stop strings, min_tokens, length), logprobs in vLLM's shape, prompt logprobs
and the speculative walk. No model: a tiny tokenizer trained in-process and a real scheduler that
finishes requests, as the engine does."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from conftest import train_tiny_tokenizer
from jaxrunner.engine.output_processor import OutputProcessor
from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from jaxrunner.executor_protocol import SampledRows
from jaxrunner.outputs import Logprob
from jaxrunner.sampling_params import SamplingParams

TOP = 4  # top logprob columns in the sampled arrays


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


class Harness:
    """What the engine does around the processor: queue, feed sampled rows, finish on a stop."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.processor = OutputProcessor(tokenizer, [self.eos])
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                                   page_size=4, num_pages=64))

    def add(self, prompt: str, request_id: str = "r", max_tokens: int = 16, **params) -> Request:
        ids = self.tokenizer.encode(prompt)
        request = Request(request_id, ids, SamplingParams(max_tokens=max_tokens, **params))
        self.scheduler.add(request)
        self.processor.add_request(request, prompt)
        return request

    def feed(self, request: Request, tokens, draft=(), **arrays):
        """One chunk's sampled rows (``draft`` rows first); returns (num accepted, output)."""
        sampled = sampled_arrays(tokens, **arrays)
        num_accepted, reason = self.processor.append_sampled(request, sampled, range(len(tokens)), draft)
        if reason is not None:
            self.scheduler.finish(request, reason)
        return num_accepted, self.processor.make_output(request)

    def run(self, request: Request, tokens):
        """Feed one token per step until the request finishes; returns every output."""
        outputs = []
        for token in tokens:
            outputs.append(self.feed(request, [token])[1])
            if outputs[-1].finished:
                break
        return outputs


def sampled_arrays(tokens, logprobs=None, ranks=None, top_ids=None, top_logprobs=None) -> SampledRows:
    """The runner's host arrays for ``len(tokens)`` sampled rows."""
    n = len(tokens)
    return SampledRows(
        tokens=np.asarray(tokens, np.int32),
        logprobs=np.asarray(logprobs if logprobs is not None else [-0.5] * n, np.float32),
        ranks=np.asarray(ranks if ranks is not None else [1] * n, np.int32),
        top_ids=np.asarray(top_ids if top_ids is not None else [[0] * TOP] * n, np.int32),
        top_logprobs=np.asarray(top_logprobs if top_logprobs is not None else [[-1.0] * TOP] * n, np.float32),
    )


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_eos_stops_with_no_stop_reason_unless_ignored(tokenizer):
    h = Harness(tokenizer)
    request = h.add("Hello world", "a")
    tokens = words(tokenizer, " hello there") + [h.eos] + words(tokenizer, " dog")
    out = h.run(request, tokens)[-1]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.outputs[0].token_ids == tokens[:tokens.index(h.eos) + 1]
    assert "a" not in h.processor

    ignoring = h.add("Hello world", "b", max_tokens=len(tokens), ignore_eos=True)
    out = h.run(ignoring, tokens)[-1]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == tokens


def test_stop_token_ids_report_the_token(tokenizer):
    h = Harness(tokenizer)
    tokens = words(tokenizer, " quick brown fox")
    request = h.add("The", stop_token_ids=[tokens[1]])
    out = h.run(request, tokens)[-1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == tokens[1]
    assert out.outputs[0].token_ids == tokens[:2]


def test_min_tokens_holds_eos_and_stop_tokens_back(tokenizer):
    h = Harness(tokenizer)
    dog = words(tokenizer, " dog")[0]
    request = h.add("The lazy", min_tokens=3, stop_token_ids=[dog])
    out = h.run(request, [h.eos, dog, h.eos, dog])[-1]
    assert out.outputs[0].token_ids == [h.eos, dog, h.eos]  # the third output may stop, and does
    assert out.outputs[0].finish_reason == "stop"


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    h = Harness(tokenizer)
    text = " quick brown fox jumps over the lazy dog"
    tokens = words(tokenizer, text)
    request = h.add("The", stop=["fox jum"])
    outputs = h.run(request, tokens)
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "fox jum"
    assert final.outputs[0].text == " quick brown "
    assert "".join(o.delta_text for o in outputs) == " quick brown "
    assert all("f" not in o.delta_text for o in outputs), "part of the stop string was streamed"
    assert len(final.outputs[0].token_ids) < len(tokens)

    kept = h.add("The", "kept", stop=["fox jum"], include_stop_str_in_output=True)
    assert h.run(kept, tokens)[-1].outputs[0].text == " quick brown fox jum"


def test_min_tokens_holds_stop_strings_back(tokenizer):
    h = Harness(tokenizer)
    tokens = words(tokenizer, " dog dog dog dog")
    request = h.add("The lazy", min_tokens=3, stop=["dog"])
    out = h.run(request, tokens)[-1]
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 3


def test_max_tokens_finishes_by_length(tokenizer):
    h = Harness(tokenizer)
    tokens = words(tokenizer, " quick brown fox jumps over")
    request = h.add("The", max_tokens=3)
    outputs = h.run(request, tokens)
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].outputs[0].finish_reason == "length" and outputs[-1].outputs[0].stop_reason is None
    assert outputs[-1].outputs[0].token_ids == tokens[:3]
    assert outputs[-1].outputs[0].text == tokenizer.decode(tokens[:3])
    assert len(h.processor) == 0


def test_logprobs_are_the_token_then_the_top_k(tokenizer):
    h = Harness(tokenizer)
    tokens = words(tokenizer, " quick brown")
    request = h.add("The", logprobs=2)
    top_ids = [[tokens[0], 7, 8, 9], [5, 6, tokens[1], 9]]
    top_logprobs = [[-0.1, -2.0, -3.0, -4.0], [-0.2, -0.9, -1.5, -4.0]]
    _, out = h.feed(request, tokens[:1], logprobs=[-0.1], ranks=[1], top_ids=top_ids[:1], top_logprobs=top_logprobs[:1])
    _, out = h.feed(request, tokens[1:], logprobs=[-1.5], ranks=[3], top_ids=top_ids[1:], top_logprobs=top_logprobs[1:])
    first, second = out.outputs[0].logprobs
    decode = lambda t: tokenizer.decode([t])
    # the sampled token in the top k keeps its own entry: k entries
    assert first == {tokens[0]: Logprob(pytest.approx(-0.1), 1, decode(tokens[0])),
                     7: Logprob(-2.0, 2, decode(7))}
    # outside the top k: the sampled token first, then k more
    assert list(second) == [tokens[1], 5, 6]
    assert second[tokens[1]] == Logprob(-1.5, 3, decode(tokens[1]))
    assert [entry.rank for entry in second.values()] == [3, 1, 2]
    assert math.isclose(out.outputs[0].cumulative_logprob, -1.6, rel_tol=1e-6)

    plain = h.add("The", "plain")
    assert h.feed(plain, tokens[:1])[1].outputs[0].logprobs is None


def test_prompt_logprobs_accumulate_over_chunks_and_keep_the_first_record(tokenizer):
    h = Harness(tokenizer)
    request = h.add("The quick brown fox jumps", prompt_logprobs=1)
    prompt = request.prompt_token_ids
    n = len(prompt)
    assert n >= 4

    def rows(count, value):
        return dataclasses.replace(
            sampled_arrays([0] * count), prompt_logprobs=np.full(count, value, np.float32),
            prompt_ranks=np.full(count, 2, np.int32), prompt_top_ids=np.full((count, TOP), 3, np.int32),
            prompt_top_logprobs=np.full((count, TOP), -0.25, np.float32))

    h.processor.accept_prompt_logprobs([ScheduledChunk(request, 0, 2)], rows(2, -1.0))
    h.processor.accept_prompt_logprobs([ScheduledChunk(request, 2, n - 2)], rows(n - 2, -2.0))
    recomputed = rows(n, -9.0)  # after a preemption: every position again
    h.processor.accept_prompt_logprobs([ScheduledChunk(request, 0, n)], recomputed)
    out = h.feed(request, words(tokenizer, " over"))[1]
    records = out.prompt_logprobs
    assert len(records) == n and records[0] is None
    assert [records[p][prompt[p]].logprob for p in range(1, n)] == [-1.0, -1.0] + [-2.0] * (n - 3)
    assert all(list(records[p]) == [prompt[p], 3] for p in range(1, n))  # the token, then the top 1


def test_speculative_walk_keeps_tokens_while_they_match_the_proposals(tokenizer):
    h = Harness(tokenizer)
    a, b, c, d = words(tokenizer, " quick brown fox jumps")[:4]
    request = h.add("The", max_tokens=10)
    num_accepted, out = h.feed(request, [a, b, d], draft=[a, c])  # b disagrees with proposal c
    assert num_accepted == 1 and out.outputs[0].token_ids == [a, b]
    num_accepted, out = h.feed(request, [c, d, a], draft=[c, d])  # all accepted, plus the bonus token
    assert num_accepted == 2 and out.outputs[0].token_ids == [a, b, c, d, a]

    stopping = h.add("The", "stopping", stop_token_ids=[b])
    num_accepted, out = h.feed(stopping, [a, b, c], draft=[a, b])  # stops on an accepted proposal's row
    assert num_accepted == 1 and out.finished and out.outputs[0].token_ids == [a, b]


def test_abort_forgets_the_request(tokenizer):
    h = Harness(tokenizer)
    h.add("The", "gone")
    assert "gone" in h.processor and h.processor.request_ids() == ["gone"]
    assert h.processor.abort_request("gone") and not h.processor.abort_request("gone")
    assert len(h.processor) == 0


def test_without_a_tokenizer_outputs_carry_ids_only():
    processor = OutputProcessor(None, [2])
    request = Request("ids", [5, 6, 7], SamplingParams(max_tokens=2, logprobs=1))
    processor.add_request(request)
    processor.append_sampled(request, sampled_arrays([9]), [0])
    out = processor.make_output(request)
    assert out.prompt is None and out.outputs[0].text == "" and out.delta_text == ""
    assert out.outputs[0].token_ids == [9]
    assert out.outputs[0].logprobs[0][9].decoded_token is None
