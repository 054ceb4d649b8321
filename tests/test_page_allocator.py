import copy

import pytest
from hypothesis import given, settings, strategies as st

from jaxrunner.engine.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxrunner.engine.request import Request

PAGE = 4


def make_request(tokens, request_id="r", outputs=()):
    request = Request(request_id, list(tokens))
    for t in outputs:
        request.append_output(t)
    return request


def assert_private(allocator, request, start, end):
    """Positions [start, end) are about to be written: their pages must be the request's alone."""
    for pos in range(start, end):
        page = request.page_ids[pos // PAGE]
        assert allocator.ref_count(page) == 1 and not allocator.is_cached(page), pos


def admit(allocator, request, num_new=None):
    """What the scheduler does: cached prefix, then pages for the rest (all of it by default); the
    pages handed out are recorded on the request. Returns the number of cached tokens."""
    cached = allocator.find_cached_prefix(request)
    num_cached = len(cached) * PAGE
    num_new = request.num_tokens - num_cached if num_new is None else num_new
    pages = allocator.admit(request, cached, num_cached + num_new)
    assert pages is not None and pages[:len(cached)] == cached
    request.page_ids = pages
    request.num_cached_tokens = request.num_computed_tokens = num_cached
    return num_cached


def grow(allocator, request, num_new):
    """Pages for ``num_new`` more tokens, recorded on the request; False (nothing taken) when short."""
    pages = allocator.allocate(request, num_new)
    if pages is None:
        return False
    request.page_ids += pages
    return True


def free(allocator, request):
    """What the scheduler does when a request finishes or is preempted."""
    allocator.free(request)
    request.page_ids = []


def compute(allocator, request, num_new=None):
    """What update() does after a step."""
    num_new = request.num_tokens - request.num_computed_tokens if num_new is None else num_new
    request.num_computed_tokens += num_new
    allocator.commit_full_pages(request)


def test_scratch_page_is_never_handed_out():
    allocator = PageAllocator(num_pages=6, page_size=PAGE)
    request = make_request(range(5 * PAGE))
    admit(allocator, request)
    assert sorted(request.page_ids) == [1, 2, 3, 4, 5]
    assert SCRATCH_PAGE not in request.page_ids
    assert allocator.num_free_pages == 0
    allocator.check_invariants([request])


def test_allocate_grows_to_cover_tokens_and_refuses_when_out_of_pages():
    allocator = PageAllocator(num_pages=4, page_size=PAGE)
    request = make_request(range(5))
    admit(allocator, request, num_new=5)
    assert len(request.page_ids) == 2
    assert allocator.pages_needed(request, 0) == 0
    request.num_computed_tokens = 5
    assert allocator.pages_needed(request, 3) == 0  # 8 tokens still fit in 2 pages
    assert allocator.pages_needed(request, 4) == 1
    assert allocator.allocate(request, 8) is None  # 4 pages for 13 tokens: one more than is free
    assert allocator.num_free_pages == 1, "a refused allocation takes nothing"
    assert grow(allocator, request, 7) and len(request.page_ids) == 3 and allocator.num_free_pages == 0
    allocator.check_invariants([request])


def test_admit_takes_nothing_when_the_pool_is_short_and_refuses_a_request_holding_pages():
    allocator = PageAllocator(num_pages=4, page_size=PAGE)  # 3 usable
    request = make_request(range(3 * PAGE + 1))
    assert allocator.admit(request, [], request.num_tokens) is None
    assert allocator.num_free_pages == 3
    admit(allocator, request, num_new=2 * PAGE)
    with pytest.raises(ValueError, match="already holds pages"):
        allocator.admit(request, [], 1)
    allocator.check_invariants([request])


def test_the_allocator_writes_nothing_into_a_request():
    """It reads requests and returns pages; the scheduler alone records them. Every call, from
    admission through growth, registration and rollback to free, leaves the request as it was."""
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    first = make_request(range(2 * PAGE + 1), "a")
    admit(allocator, first)
    compute(allocator, first)
    request = make_request(range(2 * PAGE + 3), "b")

    def untouched(call):
        before = copy.deepcopy(vars(request))
        result = call()
        assert vars(request) == before, call
        return result

    cached = untouched(lambda: allocator.find_cached_prefix(request))
    assert len(cached) == 2
    assert untouched(lambda: allocator.can_admit(cached, request.num_tokens))
    request.page_ids = untouched(lambda: allocator.admit(request, cached, request.num_tokens))
    request.num_computed_tokens = request.num_tokens
    untouched(lambda: allocator.commit_full_pages(request))
    request.page_ids += untouched(lambda: allocator.allocate(request, 2 * PAGE))
    assert len(request.page_ids) == 5
    request.page_ids = untouched(lambda: allocator.release_tail(request, request.num_tokens))
    assert len(request.page_ids) == 3
    allocator.check_invariants([first, request])
    untouched(lambda: allocator.free(request))
    allocator.check_invariants([first])


def test_free_returns_every_page():
    allocator = PageAllocator(num_pages=8, page_size=PAGE, enable_prefix_caching=False)
    request = make_request(range(10))
    admit(allocator, request)
    compute(allocator, request)
    assert allocator.num_used_pages == 3
    allocator.free(request)
    assert allocator.num_used_pages == 0 and allocator.num_cached_pages == 0
    assert allocator.num_free_pages == 7
    allocator.check_invariants([])


def test_shared_prefix_hits_full_pages_and_bumps_refcounts():
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    prefix = list(range(100, 100 + 2 * PAGE))
    first = make_request(prefix + [1, 2, 3], "a")
    assert admit(allocator, first) == 0
    compute(allocator, first)

    second = make_request(prefix + [7, 8], "b")
    assert admit(allocator, second) == 2 * PAGE
    assert second.page_ids[:2] == first.page_ids[:2]
    assert second.page_ids[2] != first.page_ids[2]
    assert second.num_cached_tokens == second.num_computed_tokens == 2 * PAGE
    assert [allocator.ref_count(p) for p in first.page_ids] == [2, 2, 1]
    allocator.check_invariants([first, second])


def test_a_prefix_differing_in_an_earlier_page_does_not_hit():
    """Keys chain over all earlier pages: the same tokens at page 1 don't match after a change."""
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    first = make_request([1, 1, 1, 1, 2, 2, 2, 2, 9], "a")
    admit(allocator, first)
    compute(allocator, first)
    second = make_request([5, 1, 1, 1, 2, 2, 2, 2, 9], "b")
    assert allocator.find_cached_prefix(second) == []


def test_full_hit_leaves_the_last_page_to_compute():
    """Never a write into a shared page: an all-hit prompt recomputes its last page."""
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    tokens = list(range(3 * PAGE))
    first = make_request(tokens, "a")
    admit(allocator, first)
    compute(allocator, first)
    second = make_request(tokens, "b")
    assert admit(allocator, second) == 2 * PAGE
    assert second.page_ids[:2] == first.page_ids[:2]
    fresh = second.page_ids[2]
    assert fresh != first.page_ids[2]
    assert allocator.ref_count(fresh) == 1 and not allocator.is_cached(fresh)


def test_partial_last_page_is_never_cached():
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    first = make_request(range(PAGE + 2), "a")
    admit(allocator, first)
    compute(allocator, first)
    assert allocator.is_cached(first.page_ids[0]) and not allocator.is_cached(first.page_ids[1])
    allocator.free(first)
    assert allocator.num_cached_pages == 1


def test_freed_pages_stay_cached_and_count_as_free():
    allocator = PageAllocator(num_pages=8, page_size=PAGE)
    tokens = list(range(2 * PAGE + 1))
    first = make_request(tokens, "a")
    admit(allocator, first)
    compute(allocator, first)
    allocator.free(first)
    assert allocator.num_used_pages == 0
    assert allocator.num_cached_pages == 2
    assert allocator.num_free_pages == 7
    allocator.check_invariants([])

    again = make_request(tokens, "b")
    assert admit(allocator, again) == 2 * PAGE
    assert allocator.num_cached_pages == 0
    allocator.check_invariants([again])


def test_cached_pages_evicted_lru_only_when_no_plain_page_is_left():
    allocator = PageAllocator(num_pages=5, page_size=PAGE)  # 4 usable
    old = make_request([1] * PAGE + [0], "old")
    new = make_request([2] * PAGE + [0], "new")
    for request in (old, new):
        admit(allocator, request)
        compute(allocator, request)
    allocator.free(old)
    allocator.free(new)
    assert allocator.num_cached_pages == 2  # each request's one full page

    # Two plain free pages are used before any cached one is evicted.
    filler = make_request([3] * (2 * PAGE - 1), "filler")
    admit(allocator, filler)
    compute(allocator, filler)
    assert allocator.num_cached_pages == 2
    assert allocator.find_cached_prefix(make_request([1] * PAGE + [5])) != []

    # The next fresh page evicts the least recently freed cached page: old's.
    assert grow(allocator, filler, 2)
    assert allocator.find_cached_prefix(make_request([1] * PAGE + [5])) == []
    assert allocator.find_cached_prefix(make_request([2] * PAGE + [5])) != []
    allocator.check_invariants([filler])


def test_a_hit_revives_a_cached_page_so_it_is_not_evicted():
    allocator = PageAllocator(num_pages=3, page_size=PAGE)  # 2 usable
    tokens = [4] * PAGE + [1]
    first = make_request(tokens, "a")
    admit(allocator, first)
    compute(allocator, first)
    allocator.free(first)
    second = make_request(tokens, "b")
    cached = allocator.find_cached_prefix(second)
    assert cached and allocator.can_admit(cached, len(tokens))
    assert not allocator.can_admit(cached, 2 * PAGE + 1)  # 1 revived + 2 fresh > 2 free
    admit(allocator, second)
    assert allocator.num_free_pages == 0
    allocator.check_invariants([second])


def test_preempted_request_hits_its_own_outputs():
    """The lookup covers prompt + outputs: a preempted request recomputes both."""
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    request = make_request(range(PAGE + 1), "r")
    admit(allocator, request)
    compute(allocator, request)
    for t in range(2 * PAGE):  # decode steps
        request.append_output(50 + t)
        assert grow(allocator, request, 1)
        compute(allocator, request, 1)
    assert request.num_tokens == 3 * PAGE + 1
    free(allocator, request)
    request.num_computed_tokens = 0
    assert admit(allocator, request) == 3 * PAGE  # past the prompt, into the outputs


def test_identical_pages_computed_twice_keep_one_cached_copy():
    allocator = PageAllocator(num_pages=16, page_size=PAGE)
    tokens = list(range(PAGE + 1))
    a, b = make_request(tokens, "a"), make_request(tokens, "b")
    admit(allocator, a)
    admit(allocator, b)  # admitted before a's pages were computed: no hit
    compute(allocator, a)
    compute(allocator, b)
    assert allocator.is_cached(a.page_ids[0]) and not allocator.is_cached(b.page_ids[0])
    allocator.free(a)
    allocator.free(b)
    assert allocator.num_cached_pages == 1
    allocator.check_invariants([])


def test_no_prefix_caching_means_no_hits():
    allocator = PageAllocator(num_pages=16, page_size=PAGE, enable_prefix_caching=False)
    tokens = list(range(3 * PAGE))
    first = make_request(tokens, "a")
    admit(allocator, first)
    compute(allocator, first)
    assert allocator.find_cached_prefix(make_request(tokens, "b")) == []
    allocator.free(first)
    assert allocator.num_cached_pages == 0


def test_check_invariants_catches_a_wrong_owner_list():
    allocator = PageAllocator(num_pages=8, page_size=PAGE)
    request = make_request(range(6))
    admit(allocator, request)
    with pytest.raises(AssertionError, match="refcount"):
        allocator.check_invariants([])
    with pytest.raises(AssertionError, match="refcount"):
        allocator.check_invariants([request, request])


@pytest.mark.parametrize("num_pages, page_size", [(1, 4), (0, 4), (4, 0)])
def test_rejects_bad_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PageAllocator(num_pages, page_size)


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(2, 12),
    caching=st.booleans(),
    ops=st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 30),
                           st.integers(1, 9)), max_size=40),
)
def test_random_admit_grow_free_keeps_invariants(num_pages, caching, ops):
    """Random admissions (with shared prefixes), growth and frees: the books always balance and
    every page a request would write to is private to it."""
    allocator = PageAllocator(num_pages, PAGE, caching)
    live: list[Request] = []
    for n, (op, pick, size) in enumerate(ops):
        if op == "admit":
            request = make_request([pick % 3] * 6 + list(range(size)), f"r{n}")
            cached = allocator.find_cached_prefix(request)
            if not allocator.can_admit(cached, request.num_tokens):
                continue
            admit(allocator, request)
            assert_private(allocator, request, request.num_computed_tokens, request.num_tokens)
            compute(allocator, request)
            live.append(request)
        elif op == "grow" and live:
            request = live[pick % len(live)]
            if not grow(allocator, request, size):
                continue
            request.output_token_ids.extend([9] * size)
            start = request.num_computed_tokens
            assert_private(allocator, request, start, start + size)
            compute(allocator, request, size)
        elif op == "free" and live:
            free(allocator, live.pop(pick % len(live)))
        allocator.check_invariants(live)
    for request in live:
        allocator.free(request)
    allocator.check_invariants([])
    assert allocator.num_free_pages == num_pages - 1
