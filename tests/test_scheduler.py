"""Scheduler tests: unit behaviour plus property tests that drive it like the engine does.

``FakeEngine`` stands in for the engine and the device: for every planned chunk it writes each
token's "KV" (its position and token id) into a fake paged cache through the request's page
table, then checks that every position the chunk attends to reads back the right token. That
catches a wrong prefix-cache hit, a write into a page someone else reads, and pages lost or
handed out twice, with nothing but the public host-side API.
"""
import random

import pytest
from hypothesis import event, given, settings, strategies as st, target

from jaxrunner.engine.page_allocator import SCRATCH_PAGE, PageAllocator, cdiv
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan
from jaxrunner.sampling_params import SamplingParams


def make_config(**overrides) -> SchedulerConfig:
    values = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, page_size=4,
                  num_pages=64)
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(request_id, prompt, max_tokens=4) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


class FakeEngine:
    """Plays the engine: schedule, 'run' (fake KV writes and reads), update, sample, finish."""

    def __init__(self, scheduler: Scheduler, seed: int = 0):
        self.scheduler = scheduler
        self.config = scheduler.config
        self.rng = random.Random(seed)
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (page, slot) -> (position, token)
        self.plans: list[StepPlan] = []

    def step(self) -> StepPlan:
        had_work = self.scheduler.has_unfinished()
        plan = self.scheduler.schedule()
        assert plan.is_empty == (not had_work), "no progress while requests are unfinished"
        self.check_plan(plan)
        self.run(plan)
        self.scheduler.update(plan)
        for chunk in plan.chunks:
            request = chunk.request
            assert request.num_computed_tokens == chunk.end
            if chunk.sample:
                request.append_output(self.rng.randrange(5))
                if request.num_output_tokens >= request.max_tokens:
                    self.scheduler.finish(request, "length")
        self.scheduler.check_invariants()
        self.plans.append(plan)
        return plan

    def run_until_done(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("requests never finished")

    def check_plan(self, plan: StepPlan) -> None:
        config = self.config
        assert plan.num_batched_tokens <= config.max_num_batched_tokens
        assert len(plan.chunks) <= config.max_num_seqs
        if config.max_num_prefill_seqs is not None:
            assert sum(c.num_tokens > 1 for c in plan.chunks) <= config.max_num_prefill_seqs
        assert len({id(c.request) for c in plan.chunks}) == len(plan.chunks)
        for chunk in plan.chunks:
            request = chunk.request
            assert request.status is RequestStatus.RUNNING
            assert chunk.num_tokens >= 1
            assert chunk.start == request.num_computed_tokens
            assert chunk.end <= request.num_tokens
            assert chunk.sample == (chunk.end == request.num_tokens)
            assert len(request.page_ids) == cdiv(chunk.end, config.page_size)
            assert SCRATCH_PAGE not in request.page_ids
            whole_fits = request.num_tokens - chunk.start <= config.max_num_batched_tokens
            if not config.enable_chunked_prefill and whole_fits:
                assert chunk.sample, "a prefill was chunked with chunked prefill off"
        for request in plan.preempted:
            assert request.status is RequestStatus.WAITING and not request.page_ids

    def tokens(self, request: Request) -> list[int]:
        return request.all_token_ids

    def run(self, plan: StepPlan) -> None:
        """All writes of the batch land first, then every chunk reads its whole context."""
        allocator = self.scheduler.allocator
        for chunk in plan.chunks:
            tokens = self.tokens(chunk.request)
            for pos in range(chunk.start, chunk.end):
                page, slot = self.slot(chunk.request, pos)
                assert allocator.ref_count(page) == 1, "write into a shared page"
                assert not allocator.is_cached(page), "write into a cached page"
                self.kv[page, slot] = (pos, tokens[pos])
        for chunk in plan.chunks:
            tokens = self.tokens(chunk.request)
            for pos in range(chunk.end):
                assert self.kv.get(self.slot(chunk.request, pos)) == (pos, tokens[pos]), \
                    f"{chunk.request.request_id} reads wrong KV at position {pos}"

    def slot(self, request: Request, pos: int) -> tuple[int, int]:
        page_size = self.config.page_size
        return request.page_ids[pos // page_size], pos % page_size


class AsyncFakeEngine(FakeEngine):
    """Plays the engine under async scheduling: step N+1 is planned and 'dispatched' before step
    N's sampled tokens reach the host. The fake device samples a token when it runs a chunk; the
    next step reads it on the device (``on_device``), the host learns it one step later. Token 4
    stands for EOS: a stop the scheduler cannot foresee, so the step already planned computes one
    wasted token for that request."""

    EOS = 4

    def __init__(self, scheduler: Scheduler, seed: int = 0):
        super().__init__(scheduler, seed)
        self.on_device: dict[Request, int] = {}  # sampled by the step in flight, not yet on the host
        self.sampled: dict[int, dict[Request, int]] = {}  # per plan (by id): what its rows sampled
        self.in_flight: StepPlan | None = None

    def tokens(self, request: Request) -> list[int]:
        known = request.all_token_ids
        return known + [self.on_device[request]] if request.num_pending_outputs else known

    def launch(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        self.run(plan)
        assert all(chunk.request.num_pending_outputs <= 1 for chunk in plan.chunks)
        self.sampled[id(plan)] = {c.request: self.rng.randrange(5) for c in plan.chunks if c.sample}
        return plan

    def step(self) -> StepPlan:
        had_work = self.scheduler.has_unfinished()
        current = self.in_flight or self.launch()
        if self.in_flight is None:
            assert current.is_empty == (not had_work), "no progress while requests are unfinished"
        sampled = self.sampled.pop(id(current))
        self.scheduler.update(current)
        for request, token in sampled.items():
            if not request.is_finished:
                request.expect_output()
                self.on_device[request] = token
        following = self.launch()
        self.in_flight = None if following.is_empty else following
        for request, token in sampled.items():
            if request.is_finished:
                continue  # it stopped after this step was planned: its token is dropped
            request.append_output(token)
            if token == self.EOS:
                self.scheduler.finish(request, "stop")
            elif request.num_output_tokens >= request.max_tokens:
                self.scheduler.finish(request, "length")
        self.scheduler.check_invariants()
        self.plans.append(current)
        return current


def assert_all_pages_free(scheduler: Scheduler) -> None:
    allocator = scheduler.allocator
    allocator.check_invariants(owners=[])
    assert allocator.num_used_pages == 0
    assert allocator.num_free_pages == allocator.num_pages - 1


# -- unit tests -------------------------------------------------------------------------------


def test_request_tokens_grow_with_outputs():
    prompt = [5, 6, 7]
    request = Request("r", prompt, SamplingParams(max_tokens=9))
    prompt.append(8)  # the request owns its copy
    assert request.status is RequestStatus.WAITING and request.page_ids == []
    assert (request.num_prompt_tokens, request.num_tokens, request.max_tokens) == (3, 3, 9)
    request.append_output(11)
    assert request.all_token_ids == [5, 6, 7, 11] and request.output_token_ids == [11]
    assert (request.num_tokens, request.num_output_tokens) == (4, 1)
    assert request != Request("r", [5, 6, 7])  # identity, not field-wise equality


def test_a_token_still_on_the_device_counts_but_is_not_known():
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    request.expect_output()
    assert (request.num_tokens, request.num_output_tokens, request.num_expected_outputs) == (4, 0, 1)
    assert request.all_token_ids == [5, 6, 7]
    request.append_output(9)
    assert (request.num_tokens, request.num_pending_outputs, request.all_token_ids) == (4, 0, [5, 6, 7, 9])


def test_planning_ahead_feeds_the_pending_token_and_stops_at_max_tokens():
    """Async scheduling: the step after a decode is planned before its token is known. It
    computes that pending token (one new token), and a request whose pending token is its last
    (max_tokens) is not scheduled again."""
    scheduler = Scheduler(make_config())
    short, long = make_request("short", [1, 2, 3], max_tokens=1), make_request("long", [4, 5], max_tokens=3)
    scheduler.add(short)
    scheduler.add(long)
    first = scheduler.schedule()
    scheduler.update(first)
    for chunk in first.chunks:
        chunk.request.expect_output()
    second = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in second.chunks] == [("long", 2, 1, True)]
    short.append_output(8)
    scheduler.finish(short, "length")
    long.append_output(9)
    scheduler.update(second)
    assert long.num_computed_tokens == 3 and long.all_token_ids == [4, 5, 9]


def test_config_and_allocator_checks():
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        make_config(max_num_seqs=0)
    with pytest.raises(ValueError, match="num_pages=1"):
        make_config(num_pages=1)
    with pytest.raises(ValueError, match="allocator"):
        Scheduler(make_config(num_pages=8), PageAllocator(9, 4))


def test_single_request_prefills_then_decodes_and_finishes():
    scheduler = Scheduler(make_config())
    request = make_request("r", range(10), max_tokens=3)
    scheduler.add(request)
    engine = FakeEngine(scheduler)

    plan = engine.step()
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(0, 10, True)]
    assert request.status is RequestStatus.RUNNING
    plan = engine.step()
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(10, 1, True)]
    engine.step()
    assert request.status is RequestStatus.FINISHED and request.finish_reason == "length"
    assert request.num_output_tokens == 3
    assert not scheduler.has_unfinished()
    assert scheduler.num_steps == 3 and scheduler.last_step_num_tokens == 1
    assert_all_pages_free(scheduler)


def test_chunk_sample_is_fixed_when_planned():
    request = make_request("r", range(5))
    chunk = ScheduledChunk(request, 0, 5)
    assert chunk.sample
    request.append_output(1)  # the engine appends the sampled token...
    assert chunk.sample       # ...and the chunk still says its row was sampled
    assert not ScheduledChunk(request, 0, 3).sample


def test_decodes_go_first_then_prefill_chunks_fill_the_budget():
    scheduler = Scheduler(make_config(max_num_batched_tokens=8))
    short, long = make_request("short", range(4), 10), make_request("long", range(100, 120), 10)
    scheduler.add(short)
    scheduler.add(long)
    engine = FakeEngine(scheduler)

    plan = engine.step()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == \
        [("short", 0, 4), ("long", 0, 4)]
    plan = engine.step()
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks] == \
        [("short", 4, 1, True), ("long", 4, 7, False)]
    plan = engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == \
        [("short", 1), ("long", 7)]
    plan = engine.step()
    # 4 + 7 + 7 + 2 = 20: the long prompt is done and its last row sampled.
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks] == \
        [("short", 6, 1, True), ("long", 18, 2, True)]
    engine.run_until_done()
    assert_all_pages_free(scheduler)


def test_without_chunking_a_prompt_waits_until_it_fits_whole():
    scheduler = Scheduler(make_config(max_num_batched_tokens=10, enable_chunked_prefill=False))
    first, second = make_request("a", range(6), 5), make_request("b", range(50, 56), 5)
    scheduler.add(first)
    scheduler.add(second)
    engine = FakeEngine(scheduler)
    plan = engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 6)]
    plan = engine.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 6)]
    engine.run_until_done()


def test_prompt_longer_than_budget_is_chunked_or_rejected():
    prompt = range(25)
    chunked = Scheduler(make_config(max_num_batched_tokens=10))
    chunked.add(make_request("r", prompt))
    engine = FakeEngine(chunked)
    sizes = [(c.num_tokens, c.sample) for c in engine.step().chunks + engine.step().chunks
             + engine.step().chunks]
    assert sizes == [(10, False), (10, False), (5, True)]

    unchunked = Scheduler(make_config(max_num_batched_tokens=10, enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="max_num_batched_tokens=10"):
        unchunked.add(make_request("r", prompt))
    assert not unchunked.has_unfinished()


def test_add_rejects_requests_that_can_never_fit():
    scheduler = Scheduler(make_config(max_model_len=32, num_pages=5, page_size=4))  # 4 pages
    with pytest.raises(ValueError, match="max_model_len=32"):
        scheduler.add(make_request("long", range(30), max_tokens=3))
    with pytest.raises(ValueError, match="KV pages"):
        scheduler.add(make_request("big", range(15), max_tokens=3))  # 17 tokens of KV: 5 pages
    with pytest.raises(ValueError, match="empty"):
        scheduler.add(make_request("empty", []))
    scheduler.add(make_request("ok", range(4)))
    with pytest.raises(ValueError, match="'ok'"):
        scheduler.add(make_request("ok", range(4)))


def test_the_engine_may_lower_max_tokens_to_fit_the_context():
    scheduler = Scheduler(make_config(max_model_len=32))
    request = make_request("r", range(30), max_tokens=16)
    request.max_tokens = 32 - 30
    scheduler.add(request)
    FakeEngine(scheduler).run_until_done()
    assert request.num_output_tokens == 2
    full = make_request("full", range(32))
    full.max_tokens = 0
    with pytest.raises(ValueError, match="no room to generate within max_model_len=32"):
        scheduler.add(full)
    capped = make_request("capped", range(31))
    capped.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens: 0 leaves nothing"):
        scheduler.add(capped)
    assert scheduler.get_request("full") is None and scheduler.get_request("capped") is None


def test_a_request_needing_every_usable_page_runs_alone():
    scheduler = Scheduler(make_config(num_pages=5, page_size=4))  # 16 KV slots
    request = make_request("exact", range(10), max_tokens=7)      # 16 tokens ever fed back
    scheduler.add(request)
    engine = FakeEngine(scheduler)
    engine.run_until_done()
    assert request.num_output_tokens == 7
    assert_all_pages_free(scheduler)


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(make_config(max_num_seqs=2))
    requests = [make_request(f"r{i}", range(i * 10, i * 10 + 3), 3) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    engine = FakeEngine(scheduler)
    plan = engine.step()
    assert [c.request.request_id for c in plan.chunks] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 3
    engine.run_until_done()
    assert all(r.num_output_tokens == 3 for r in requests)


def test_pages_running_out_preempts_the_newest_request():
    # 4 usable pages of 4 slots; each request eventually needs 3 pages of KV.
    scheduler = Scheduler(make_config(num_pages=5, page_size=4, enable_prefix_caching=False))
    old, new = make_request("old", range(6), 6), make_request("new", range(10, 16), 6)
    scheduler.add(old)
    scheduler.add(new)
    engine = FakeEngine(scheduler)
    engine.step()  # both prefill: 2 pages each, pool full
    engine.step()  # decode: 7 tokens, still 2 pages each
    engine.step()  # decode 8
    plan = engine.step()  # position 8 needs a third page for old: new has to go
    assert plan.preempted == [new]
    assert [c.request for c in plan.chunks] == [old]
    assert new.status is RequestStatus.WAITING and new.page_ids == []
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 3  # outputs kept
    assert new.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert scheduler.waiting[0] is new

    engine.run_until_done()
    assert old.num_output_tokens == new.num_output_tokens == 6
    resumed = [c for p in engine.plans for c in p.chunks if c.request is new and c.start == 0][1]
    assert resumed.num_tokens == 6 + 3  # the recompute covers prompt + kept outputs
    assert_all_pages_free(scheduler)


def test_preempting_a_request_already_planned_this_step_drops_its_chunk():
    """Decodes are planned before prefills, so the newest request may already have a chunk when
    an older one needs its pages: the chunk goes and its tokens return to the budget."""
    scheduler = Scheduler(make_config(num_pages=5, page_size=4, enable_prefix_caching=False))
    old, new = make_request("old", range(7), 6), make_request("new", range(10, 17), 6)
    scheduler.add(old)
    scheduler.add(new)
    plan = scheduler.schedule()  # both prefill: 2 pages each, pool full
    scheduler.update(plan)
    old.append_output(1)
    new.append_output(1)
    old.append_output(2)  # old now has 2 tokens to compute (8 and 9): it sorts after the decode
    plan = scheduler.schedule()
    assert plan.preempted == [new]
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(old, 7, 2)]
    assert plan.num_batched_tokens == 2
    scheduler.check_invariants()


def test_a_preempted_request_resumes_from_the_prefix_cache():
    scheduler = Scheduler(make_config(num_pages=5, page_size=4))
    old, new = make_request("old", range(6), 6), make_request("new", range(10, 18), 6)
    scheduler.add(old)
    scheduler.add(new)
    engine = FakeEngine(scheduler)
    engine.run_until_done()
    assert scheduler.num_preemptions >= 1
    assert scheduler.prefix_cache_hit_tokens > 0
    assert_all_pages_free(scheduler)


def test_shared_prefix_is_computed_once():
    scheduler = Scheduler(make_config(page_size=4))
    system = list(range(100, 112))  # 3 full pages
    first = make_request("a", system + [1, 2], 5)
    scheduler.add(first)
    engine = FakeEngine(scheduler)
    engine.step()
    second = make_request("b", system + [3], 2)
    scheduler.add(second)
    plan = engine.step()
    chunk = next(c for c in plan.chunks if c.request is second)
    assert (chunk.start, chunk.num_tokens) == (12, 1)
    assert second.num_cached_tokens == 12
    assert second.page_ids[:3] == first.page_ids[:3]
    assert scheduler.prefix_cache_hit_tokens == 12
    engine.run_until_done()
    assert_all_pages_free(scheduler)
    assert scheduler.allocator.num_cached_pages >= 3


def test_identical_prompt_recomputes_only_its_last_page():
    scheduler = Scheduler(make_config(page_size=4))
    prompt = list(range(8))
    engine = FakeEngine(scheduler)
    scheduler.add(make_request("a", prompt, 1))
    engine.run_until_done()
    again = make_request("b", prompt, 1)
    scheduler.add(again)
    plan = engine.step()  # FakeEngine asserts the write lands in a private page
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(4, 4)]


def test_abort_frees_pages_wherever_the_request_is():
    scheduler = Scheduler(make_config(max_num_seqs=1))
    running, waiting = make_request("run", range(9), 8), make_request("wait", range(9), 8)
    scheduler.add(running)
    scheduler.add(waiting)
    engine = FakeEngine(scheduler)
    engine.step()
    assert scheduler.num_used_pages > 0
    assert scheduler.abort("wait") is waiting
    assert scheduler.abort("run") is running
    for request in (running, waiting):
        assert request.status is RequestStatus.FINISHED and request.finish_reason == "abort"
        assert request.page_ids == []
    assert scheduler.abort("run") is None and scheduler.abort("nobody") is None
    assert not scheduler.has_unfinished()
    assert scheduler.schedule().is_empty
    assert_all_pages_free(scheduler)


def test_abort_between_schedule_and_update_is_harmless():
    scheduler = Scheduler(make_config())
    request = make_request("r", range(6))
    scheduler.add(request)
    plan = scheduler.schedule()
    scheduler.abort("r")
    scheduler.update(plan)
    assert request.status is RequestStatus.FINISHED
    assert_all_pages_free(scheduler)


def test_update_twice_is_an_error():
    scheduler = Scheduler(make_config())
    scheduler.add(make_request("r", range(6)))
    plan = scheduler.schedule()
    scheduler.update(plan)
    with pytest.raises(RuntimeError, match="stale"):
        scheduler.update(plan)


def test_finish_frees_pages_now():
    scheduler = Scheduler(make_config())
    request = make_request("r", range(6), 10)
    scheduler.add(request)
    FakeEngine(scheduler).step()
    scheduler.finish(request, "stop")
    assert request.finish_reason == "stop" and request.page_ids == []
    assert scheduler.num_running == 0
    assert_all_pages_free(scheduler)


# -- property tests ---------------------------------------------------------------------------

PREFIXES = [[7, 7, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]


@st.composite
def workloads(draw):
    """A config and requests: (id, prompt, max_tokens, arrival step, abort delay or None).

    Half the pools are "tight": just big enough for the longest request's whole life, so requests
    compete for pages and preemption is common. The rest are random and often reject requests.
    """
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = PREFIXES[draw(st.integers(0, len(PREFIXES) - 1))]
        shared = prefix[:draw(st.sampled_from([0, 4, 8, 10, 16]))]
        own = draw(st.lists(st.integers(0, 3), max_size=12))
        prompt = shared + own or [0]
        arrival = draw(st.integers(0, 6))
        abort_after = draw(st.none() | st.integers(0, 15))
        requests.append((f"r{i}", prompt, draw(st.integers(1, 12)), arrival, abort_after))

    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    if draw(st.booleans()):
        longest_life = max(len(prompt) + max_tokens - 1 for _, prompt, max_tokens, *_ in requests)
        num_pages = 1 + cdiv(longest_life, page_size) + draw(st.integers(0, 3))
        max_model_len, max_num_seqs = 64, draw(st.integers(2, 6))
        max_num_batched_tokens = draw(st.integers(8, 48))
    else:
        num_pages = draw(st.integers(2, 24))
        max_model_len, max_num_seqs = draw(st.integers(8, 64)), draw(st.integers(1, 6))
        max_num_batched_tokens = draw(st.integers(1, 40))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        max_num_prefill_seqs=draw(st.none() | st.integers(1, 3)),
    )
    return config, requests, draw(st.integers(0, 2**16))


def expected_rejection(config: SchedulerConfig, prompt, max_tokens) -> bool:
    total = len(prompt) + max_tokens
    return (total > config.max_model_len
            or cdiv(total - 1, config.page_size) > config.num_pages - 1
            or (not config.enable_chunked_prefill and len(prompt) > config.max_num_batched_tokens))


@settings(max_examples=150, deadline=None)
@given(workloads(), st.booleans())
def test_random_workloads_keep_every_invariant(workload, async_scheduling):
    """Random arrivals, prompts sharing prefixes, aborts, pool sizes, chunking on and off, steps
    planned before or after the previous step's tokens are known (async scheduling).

    Every step: budget and max_num_seqs hold, pages are neither leaked nor owned twice, the
    scratch page is never handed out, writes never land in shared pages and every read sees the
    right KV (FakeEngine). At the end every request finished (or was rejected at add, exactly
    when it could never fit) and all pages are free again.
    """
    config, specs, seed = workload
    scheduler = Scheduler(config)
    engine = (AsyncFakeEngine if async_scheduling else FakeEngine)(scheduler, seed)
    accepted, rejected, abort_at = [], [], {}
    step = 0
    while step <= 12 or scheduler.has_unfinished():
        for rid, prompt, max_tokens, arrival, abort_after in specs:
            if arrival != step:
                continue
            request = make_request(rid, prompt, max_tokens)
            try:
                scheduler.add(request)
            except ValueError as err:
                assert rid in str(err)
                rejected.append(request)
                assert expected_rejection(config, prompt, max_tokens)
                continue
            assert not expected_rejection(config, prompt, max_tokens)
            accepted.append(request)
            if abort_after is not None:
                abort_at.setdefault(step + abort_after, []).append(rid)
        for rid in abort_at.pop(step, []):
            scheduler.abort(rid)
            scheduler.check_invariants()
        engine.step()
        step += 1
        assert step < 5_000, "requests never finished"

    for request in accepted:
        assert request.status is RequestStatus.FINISHED
        if request.finish_reason == "length":
            assert request.num_output_tokens == request.max_tokens
        elif request.finish_reason == "stop":
            assert async_scheduling and request.output_token_ids[-1] == AsyncFakeEngine.EOS
        else:
            assert request.finish_reason == "abort"
    assert len(accepted) + len(rejected) == len(specs)
    assert_all_pages_free(scheduler)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"prefix hits: {scheduler.prefix_cache_hit_tokens > 0}")
    event(f"rejected: {len(rejected) > 0}")
    target(float(scheduler.num_preemptions), label="preemptions")
    target(float(scheduler.prefix_cache_hit_tokens), label="prefix cache hits")


@settings(max_examples=40, deadline=None)
@given(
    system_pages=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 4]),
    suffixes=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=2,
                      max_size=6),
    chunked=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_shared_system_prompt_is_computed_once(system_pages, page_size, suffixes, chunked, seed):
    """Requests that arrive after a system prompt was computed reuse all its full pages."""
    system = [50 + i % 7 for i in range(system_pages * page_size)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             page_size=page_size, num_pages=1 + 64 * len(suffixes),
                             enable_chunked_prefill=chunked)
    scheduler = Scheduler(config)
    engine = FakeEngine(scheduler, seed)
    first, *later = [make_request(f"r{i}", system + suffix, 3) for i, suffix in enumerate(suffixes)]
    scheduler.add(first)
    engine.step()  # computes the whole first prompt, system pages included
    for request in later:
        scheduler.add(request)
    engine.run_until_done()
    for request in later:
        assert request.num_cached_tokens >= len(system)
    assert scheduler.prefix_cache_hit_tokens >= len(system) * len(later)
    assert scheduler.num_preemptions == 0
    assert_all_pages_free(scheduler)


@settings(max_examples=40, deadline=None)
@given(
    num_requests=st.integers(3, 8),
    prompt_len=st.integers(4, 12),
    chunked=st.booleans(),
    caching=st.booleans(),
    seed=st.integers(0, 1000),
    async_scheduling=st.booleans(),
)
def test_tiny_pool_forces_preemption_and_still_finishes(num_requests, prompt_len, chunked,
                                                        caching, seed, async_scheduling):
    """A pool that fits two prompts but not two whole lives: preemption must kick in, also while
    a preempted request's last token is still on the device (async scheduling)."""
    page_size, max_tokens = 2, 10
    pages_per_life = cdiv(prompt_len + max_tokens - 1, page_size)
    usable_pages = max(pages_per_life, 2 * cdiv(prompt_len, page_size))
    assert usable_pages < 2 * pages_per_life
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                             page_size=page_size, num_pages=usable_pages + 1,
                             enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    scheduler = Scheduler(config)
    rng = random.Random(seed)
    requests = [make_request(f"r{i}", [rng.randrange(3) for _ in range(prompt_len)], max_tokens)
                for i in range(num_requests)]
    for request in requests:
        scheduler.add(request)
    engine = (AsyncFakeEngine if async_scheduling else FakeEngine)(scheduler, seed)
    if async_scheduling:
        engine.EOS = -1  # no early stops: every request lives its whole life
    engine.run_until_done()
    assert scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    assert all(r.num_output_tokens == max_tokens for r in requests)
    assert_all_pages_free(scheduler)
