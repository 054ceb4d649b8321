"""KV-cache pages for requests: refcounted, with automatic prefix caching.

The KV cache is ``num_pages`` pages of ``page_size`` token slots. A request's tokens fill its
pages in order (token ``i`` lives in ``page_ids[i // page_size]``).

Prefix caching (as in vLLM v1 / nano-vllm): once a page is FULL and computed, its contents are a
pure function of the tokens before it and in it, so it is registered under a key
``(hash of the previous page's key, tokens of this page)``. The chained hash ties a page to its
whole prefix (and thus to its positions). A newly admitted request walks its own pages' keys from
the start and shares every page that is already cached, paying only a refcount. Pages are
immutable once registered: a request only writes at positions ``>= num_computed_tokens``, and
admission always leaves at least one token to compute, so no write can land in a shared page.

A page is in exactly one of three states:

* used      -- refcount > 0, owned by that many requests;
* cached    -- refcount 0 but registered: still holds reusable KV, evictable, least recently
               freed first, and only when no plain free page is left;
* free      -- refcount 0, holds nothing of value.

Sliding windows do not free pages: a page that has fallen entirely outside a windowed layer's
window is kept until its request finishes. A page holds the K/V of *every* layer for its tokens,
and models that mix windowed and global layers (Gemma 2 and 3) read it from their global layers;
freeing would be correct only if every layer of the model slid, and would still break the chain of
registered pages that prefix caching walks from a request's first page.

``num_free_pages`` counts cached pages too: both can be handed out. ``SCRATCH_PAGE`` is never in
any of the three: padding tokens of a batch write there, so no request may ever own it.

Who owns what: the allocator reads a ``Request`` (its tokens, ``num_computed_tokens``, ``page_ids``)
and never writes into it. ``admit`` and ``allocate`` return the pages they handed out, or None
when the pool is short (nothing taken); the scheduler records them in ``Request.page_ids`` and
owns the request's progress. The chained hashes of each request's registered pages are the
allocator's own bookkeeping, kept by request id from ``admit`` to ``free``: they say where the
next registration continues, and nothing outside this module needs them.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from jaxrunner.engine.request import Request

# Same value as jaxrunner.kernels.SCRATCH_PAGE, repeated so the host side never imports JAX.
SCRATCH_PAGE = 0

# The "previous page" hash of a request's first page.
_ROOT_HASH = 0

# (hash of the previous page's key, this page's token ids). Used whole as the cache key, so a
# lookup also compares the tokens themselves, not just a hash.
PageKey = tuple[int, tuple[int, ...]]


def _root_hash(request: Request) -> int:
    """The "previous page" hash of a request's first page: a LoRA adapter's requests chain from
    their own (``Request.cache_salt``), so their pages never serve the base model or another adapter."""
    return _ROOT_HASH if not request.cache_salt else hash((_ROOT_HASH, request.cache_salt))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the scratch page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be at least 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_counts = [0] * num_pages
        self._free: deque[int] = deque(p for p in range(num_pages) if p != SCRATCH_PAGE)
        # Cached pages with refcount 0, least recently freed first (the eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._page_by_key: dict[PageKey, int] = {}
        self._key_of_page: list[PageKey | None] = [None] * num_pages
        # request_id -> chained hash of each of its registered (full, computed) pages, in order,
        # for every request holding pages (from admit to free). Its length says how many of the
        # request's pages are already registered.
        self._page_hashes: dict[str, list[int]] = {}
        # Requests whose KV was partly computed by weights no longer served: never registered.
        self._stale_requests: set[str] = set()

    # -- sizes --------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        """Every page but the scratch page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold reusable KV (a subset of ``num_free_pages``)."""
        return len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def is_cached(self, page_id: int) -> bool:
        """True when the page is registered in the prefix cache (so it must never be written)."""
        return self._key_of_page[page_id] is not None

    # -- admission ----------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The pages of the longest cached prefix of the request's tokens (no state change).

        All known tokens count, prompt and outputs: a preempted request recomputes both. At most
        ``num_tokens - 1`` tokens may hit, so at least one token is left to compute: the step
        needs it to produce logits, and it keeps every write out of shared pages.
        """
        if not self.enable_prefix_caching or request.skips_prefix_cache:
            return []
        tokens = request.all_token_ids
        max_hit_pages = (len(tokens) - 1) // self.page_size
        hit_pages: list[int] = []
        parent_hash = _root_hash(request)
        for i in range(max_hit_pages):
            key = self._key(parent_hash, tokens, i)
            page = self._page_by_key.get(key)
            if page is None:
                break
            hit_pages.append(page)
            parent_hash = hash(key)
        return hit_pages

    def can_admit(self, cached_pages: list[int], num_tokens: int) -> bool:
        """Whether a request that reuses ``cached_pages`` can get pages for ``num_tokens`` tokens.

        Reviving a cached page with refcount 0 takes it out of the free count, just like a
        fresh page does.
        """
        num_fresh = max(0, self.pages_for_tokens(num_tokens) - len(cached_pages))
        num_revived = sum(1 for p in cached_pages if self._ref_counts[p] == 0)
        return num_fresh + num_revived <= self.num_free_pages

    def admit(self, request: Request, cached_pages: list[int], num_tokens: int) -> list[int] | None:
        """Pages for a request that holds none to hold ``num_tokens`` tokens: ``cached_pages`` (from
        ``find_cached_prefix``; their ``len * page_size`` tokens need no computing) followed by fresh
        ones. None, with nothing taken, when the pool cannot hold them (``can_admit``)."""
        if request.request_id in self._page_hashes:
            raise ValueError(f"request {request.request_id!r} already holds pages")
        if not self.can_admit(cached_pages, num_tokens):
            return None
        for page in cached_pages:
            self._take_page(page)
        self._page_hashes[request.request_id] = [hash(self._key_of_page[p]) for p in cached_pages]
        num_fresh = max(0, self.pages_for_tokens(num_tokens) - len(cached_pages))
        return list(cached_pages) + [self._take_fresh_page() for _ in range(num_fresh)]

    # -- growth -------------------------------------------------------------------------------

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Fresh pages the request needs to compute ``num_new_tokens`` more tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, self.pages_for_tokens(num_tokens) - len(request.page_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Fresh pages for the request to compute ``num_new_tokens`` more tokens past
        ``num_computed_tokens`` with the pages it holds: their ids to append to ``page_ids`` (empty
        when it holds enough), or None, with nothing taken, when too few pages are free."""
        num_pages = self.pages_needed(request, num_new_tokens)
        if num_pages > self.num_free_pages:
            return None
        return [self._take_fresh_page() for _ in range(num_pages)]

    def commit_full_pages(self, request: Request) -> None:
        """Register the request's pages that are now full and computed, so others can reuse them.

        Call after ``num_computed_tokens`` advanced. If an identical page is already registered
        (two requests computed the same prefix at once), the first one stays the cached copy and
        this one is simply freed as a plain page later.
        """
        if not self.enable_prefix_caching or request.request_id in self._stale_requests:
            return
        hashes = self._page_hashes[request.request_id]
        num_full_pages = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        if len(hashes) >= num_full_pages:
            return
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full_pages):
            key = self._key(hashes[-1] if hashes else _root_hash(request), tokens, i)
            page = request.page_ids[i]
            if key not in self._page_by_key:
                self._page_by_key[key] = page
                self._key_of_page[page] = key
            hashes.append(hash(key))

    # -- release ------------------------------------------------------------------------------

    def release_tail(self, request: Request, num_tokens: int) -> list[int]:
        """Speculative rollback: release the request's pages past those ``num_tokens`` tokens need and
        return the ones it keeps. The released pages held nothing but rejected proposals and were
        never registered (``commit_full_pages`` stops at ``num_computed_tokens``, which counts
        accepted tokens only)."""
        keep = self.pages_for_tokens(num_tokens)
        for page in reversed(request.page_ids[keep:]):
            self._release_page(page)
        return request.page_ids[:keep]

    def free(self, request: Request) -> None:
        """Drop the request's hold on every page in ``page_ids`` and forget its hashes; the caller
        then clears its page list.

        Pages are released last-first: a cached request's tail is the least likely to be shared,
        so it should be evicted before its head.
        """
        for page in reversed(request.page_ids):
            self._release_page(page)
        self._page_hashes.pop(request.request_id, None)
        self._stale_requests.discard(request.request_id)

    def invalidate_prefix_cache(self, live_request_ids: Iterable[str]) -> None:
        """Forget every cached page: the weights that computed their KV are no longer served.

        Pages held by the ``live_request_ids`` stay theirs (they finish on what they have), but
        neither those pages nor any their requests fill later are registered again: all of them
        hold or attend to KV of the old weights. Evictable pages become plain free pages.
        """
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_by_key.clear()
        self._key_of_page = [None] * self.num_pages
        self._stale_requests.update(live_request_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page nobody holds (they become plain free pages). True when no
        cached KV is left; False when requests still hold registered pages (those stay cached)."""
        for page in self._evictable:
            del self._page_by_key[self._key_of_page[page]]
            self._key_of_page[page] = None
            self._free.append(page)
        self._evictable.clear()
        return not self._page_by_key

    # -- page states --------------------------------------------------------------------------

    def _key(self, parent_hash: int, tokens: list[int], page_index: int) -> PageKey:
        start = page_index * self.page_size
        return parent_hash, tuple(tokens[start:start + self.page_size])

    def _take_page(self, page: int) -> None:
        """Add one owner to a cached page (reviving it if nobody held it)."""
        if self._ref_counts[page] == 0:
            del self._evictable[page]
        self._ref_counts[page] += 1

    def _take_fresh_page(self) -> int:
        """A page with no useful contents: a plain free one, else evict the LRU cached one."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_by_key[self._key_of_page[page]]
            self._key_of_page[page] = None
        self._ref_counts[page] = 1
        return page

    def _release_page(self, page: int) -> None:
        self._ref_counts[page] -= 1
        if self._ref_counts[page] > 0:
            return
        if self._key_of_page[page] is not None:
            self._evictable[page] = None  # most recently freed: evicted last
        else:
            self._free.append(page)

    # -- checks -------------------------------------------------------------------------------

    def check_invariants(self, owners: Iterable[Request] | None = None) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (used by tests).

        With ``owners`` (every request that holds pages), also check that each page's refcount
        equals the number of requests holding it and that no request holds a page twice.
        """
        free, evictable = list(self._free), list(self._evictable)
        _check(len(set(free)) == len(free), "a page is twice in the free list")
        _check(not set(free) & set(evictable), "a page is both free and cached")
        _check(SCRATCH_PAGE not in free and SCRATCH_PAGE not in self._evictable,
               "the scratch page is free")
        _check(self._ref_counts[SCRATCH_PAGE] == 0, "the scratch page is owned")
        _check(self._key_of_page[SCRATCH_PAGE] is None, "the scratch page is cached")
        for page in free:
            _check(self._ref_counts[page] == 0, f"free page {page} has owners")
            _check(self._key_of_page[page] is None, f"free page {page} is registered")
        for page in evictable:
            _check(self._ref_counts[page] == 0, f"evictable page {page} has owners")
            _check(self._key_of_page[page] is not None, f"evictable page {page} not registered")
        _check(all(c >= 0 for c in self._ref_counts), "negative refcount")
        num_used = sum(1 for c in self._ref_counts if c > 0)
        _check(len(free) + len(evictable) + num_used == self.num_usable_pages,
               f"pages leaked: free {len(free)} + cached {len(evictable)} + used {num_used} "
               f"!= {self.num_usable_pages}")
        for key, page in self._page_by_key.items():
            _check(self._key_of_page[page] == key, f"page {page} registered under a stale key")
        num_registered = sum(1 for k in self._key_of_page if k is not None)
        _check(num_registered == len(self._page_by_key), "registered pages and keys disagree")
        if owners is not None:
            self._check_owners(list(owners))

    def _check_owners(self, owners: list[Request]) -> None:
        counts = [0] * self.num_pages
        for request in owners:
            pages = request.page_ids
            _check(len(set(pages)) == len(pages), f"{request.request_id} holds a page twice")
            _check(SCRATCH_PAGE not in pages, f"{request.request_id} holds the scratch page")
            _check(len(pages) >= self.pages_for_tokens(request.num_computed_tokens),
                   f"{request.request_id} has computed tokens without pages")
            for page in pages:
                counts[page] += 1
        for page, (owned, counted) in enumerate(zip(counts, self._ref_counts)):
            _check(owned == counted, f"page {page}: refcount {counted} but {owned} owners")
        _check(set(self._page_hashes) == {request.request_id for request in owners},
               "the owners given and the requests admitted here disagree")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
