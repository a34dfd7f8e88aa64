"""Hand-worked allocation sequences for the CUDA caching allocator model (llmem.memory.allocator).

Each case states the arithmetic from the CUDACachingAllocator.cpp rules. MiB = 1048576 B.
"""

from __future__ import annotations

import random

import pytest

from llmem.memory.allocator import (
    AllocatorOOM,
    CachingAllocator,
    _Block,
    allocation_size,
    replay,
    round_size,
)

KiB = 1024
MiB = 1024**2


def test_round_size_and_allocation_size() -> None:
    # round_size: < 512 B -> kMinBlockSize; else up to a multiple of 512.
    assert round_size(0) == 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(MiB + 1) == MiB + 512
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else round up to 2 MiB.
    assert allocation_size(1) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 1) == 20 * MiB  # rounds to 1 MiB + 512 -> large pool
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB - 1) == 10 * MiB  # rounds to exactly 10 MiB, not < kMinLargeAlloc
    assert allocation_size(30 * MiB) == 30 * MiB
    assert allocation_size(30 * MiB + 1) == 32 * MiB


def test_small_requests_pack_into_one_small_segment() -> None:
    # 3 x 100 B: each rounds to 512 -> allocated 1536 B; first cudaMallocs a 2 MiB small segment,
    # split (remainder 2 MiB - 512 >= 512); the next two are carved from the remainder.
    a = CachingAllocator()
    for _ in range(3):
        a.malloc(100)
    s = a.stats()
    assert s.allocated_bytes == 1536
    assert s.reserved_bytes == 2 * MiB
    assert s.num_segments == 1
    assert s.num_alloc_calls == 3
    assert s.num_device_allocs == 1


def test_large_request_under_10mib_gets_20mib_segment_then_shares_it() -> None:
    # 5 MiB -> 20 MiB segment, split (remainder 15 MiB > 1 MiB): 5 allocated, 15 free.
    # 12 MiB -> best fit is the 15 MiB free block; split (3 MiB > 1 MiB): allocated 5 + 12 = 17 MiB.
    a = CachingAllocator()
    a.malloc(5 * MiB)
    a.malloc(12 * MiB)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (17 * MiB, 20 * MiB, 1)


def test_big_requests_get_exact_or_2mib_rounded_segments() -> None:
    # 30 MiB -> segment of exactly 30 MiB (multiple of kRoundLarge), no remainder.
    a = CachingAllocator()
    a.malloc(30 * MiB)
    assert a.stats().reserved_bytes == 30 * MiB
    assert a.stats().allocated_bytes == 30 * MiB
    # 30 MiB + 1 B -> rounds to 30 MiB + 512 -> segment 32 MiB; remainder 2 MiB - 512 > 1 MiB: split.
    b = CachingAllocator()
    b.malloc(30 * MiB + 1)
    s = b.stats()
    assert (s.allocated_bytes, s.reserved_bytes) == (30 * MiB + 512, 32 * MiB)
    # 1.5 MiB (large pool) fits the 2 MiB - 512 remainder; what is left, 0.5 MiB - 512, is <= 1 MiB,
    # so the block is not split and allocated counts all of it: 30 MiB + 512 + 2 MiB - 512 = 32 MiB.
    b.malloc(3 * MiB // 2)
    s = b.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (32 * MiB, 32 * MiB, 1)


def test_large_remainder_up_to_1mib_is_not_split() -> None:
    # 11.5 MiB -> segment 12 MiB; remainder 0.5 MiB <= kSmallSize: whole 12 MiB block allocated.
    a = CachingAllocator()
    a.malloc(23 * MiB // 2)
    assert a.stats().allocated_bytes == 12 * MiB
    # 11 MiB -> segment 12 MiB; remainder exactly 1 MiB is not > kSmallSize: not split, 12 MiB counted.
    b = CachingAllocator()
    b.malloc(11 * MiB)
    assert b.stats().allocated_bytes == 12 * MiB
    # 11 MiB - 512 -> segment 12 MiB; remainder 1 MiB + 512 > kSmallSize: split, 11 MiB - 512 counted.
    c = CachingAllocator()
    c.malloc(11 * MiB - 512)
    assert c.stats().allocated_bytes == 11 * MiB - 512
    assert c.stats().reserved_bytes == 12 * MiB


def test_free_then_best_fit_reuse() -> None:
    # One 20 MiB segment: a=2, b=6, c=2, d=3 MiB, tail 7 MiB free. Free b -> 6 MiB hole.
    # 5 MiB: best fit is the 6 MiB hole (smaller than the 7 MiB tail); remainder 1 MiB is not
    # split, so allocated = 2 + 6 + 2 + 3 = 13 MiB (the tail would have given 12 MiB).
    # Then 7 MiB fits the tail exactly: allocated 20 MiB, still one 20 MiB segment.
    a = CachingAllocator()
    a.malloc(2 * MiB)
    hb = a.malloc(6 * MiB)
    a.malloc(2 * MiB)
    a.malloc(3 * MiB)
    a.free(hb)
    assert a.stats().allocated_bytes == 7 * MiB
    a.malloc(5 * MiB)
    assert a.stats().allocated_bytes == 13 * MiB
    a.malloc(7 * MiB)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (20 * MiB, 20 * MiB, 1)
    assert s.peak_allocated_bytes == 20 * MiB


def test_small_pool_best_fit_picks_smallest_hole() -> None:
    # Small segment (2 MiB): x=4 KiB, y=1 KiB, z=8 KiB, w=1 KiB, rest free. Free x and z -> holes of
    # 4 KiB and 8 KiB (not adjacent, so no merge). A 3 KiB request best-fits the 4 KiB hole and is split
    # (remainder 1 KiB >= 512): live y + w + the new 3 KiB = 1 + 1 + 3 = 5 KiB.
    # Then 8 KiB fits the 8 KiB hole exactly: 13 KiB; still one segment.
    a = CachingAllocator()
    hx = a.malloc(4 * KiB)
    a.malloc(KiB)
    hz = a.malloc(8 * KiB)
    a.malloc(KiB)
    a.free(hx)
    a.free(hz)
    h3 = a.malloc(3 * KiB)
    assert a.stats().allocated_bytes == 5 * KiB
    assert a._live[h3].addr == a._live[h3].seg.base  # it took x's hole at the segment start
    a.malloc(8 * KiB)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (13 * KiB, 2 * MiB, 1)


def test_freed_neighbours_merge_and_serve_a_bigger_request() -> None:
    # 20 MiB segment: a=4, b=5, c=4 MiB, tail 7 MiB. Free a (4 MiB hole), free b -> merges with a: 9 MiB.
    # 9 MiB request: the 9 MiB merged block fits (tail 7 MiB does not) -> no new segment,
    # allocated = 9 + 4 = 13 MiB, reserved 20 MiB. Without merging it would need a new segment.
    a = CachingAllocator()
    ha = a.malloc(4 * MiB)
    hb = a.malloc(5 * MiB)
    hc = a.malloc(4 * MiB)
    a.free(ha)
    a.free(hb)
    a.malloc(9 * MiB)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (13 * MiB, 20 * MiB, 1)
    # Freeing everything merges the whole segment back into one block, which empty_cache releases.
    a.free(hc)
    for h in list(a._live):
        a.free(h)
    a.empty_cache()
    assert a.stats().reserved_bytes == 0
    assert a.stats().num_segments == 0
    assert a.stats().peak_reserved_bytes == 20 * MiB


def test_small_and_large_pools_never_share_segments() -> None:
    # 5 MiB -> large 20 MiB segment with 15 MiB free; 100 B -> small pool: a new 2 MiB segment anyway.
    a = CachingAllocator()
    a.malloc(5 * MiB)
    a.malloc(100)
    s = a.stats()
    assert (s.reserved_bytes, s.num_segments, s.allocated_bytes) == (22 * MiB, 2, 5 * MiB + 512)
    # Two 1 MiB (small) requests fill a 2 MiB small segment exactly (second: remainder 0, no split).
    # Free both: 2 MiB free in the small pool. A 1 MiB + 512 request is large: new 20 MiB segment.
    b = CachingAllocator()
    h1 = b.malloc(MiB)
    h2 = b.malloc(MiB)
    assert b.stats().reserved_bytes == 2 * MiB
    b.free(h1)
    b.free(h2)
    b.malloc(MiB + 512)
    s = b.stats()
    assert (s.reserved_bytes, s.num_segments, s.allocated_bytes) == (22 * MiB, 2, MiB + 512)


def test_streams_do_not_share_free_blocks() -> None:
    # 5 MiB on stream 0 leaves 15 MiB free on stream 0; 5 MiB on stream 1 needs its own 20 MiB segment.
    a = CachingAllocator()
    a.malloc(5 * MiB, stream=0)
    a.malloc(5 * MiB, stream=1)
    assert a.stats().reserved_bytes == 40 * MiB
    a.malloc(5 * MiB, stream=1)  # reuses stream 1's 15 MiB remainder
    assert a.stats().reserved_bytes == 40 * MiB


def test_empty_cache_releases_only_fully_free_segments() -> None:
    # seg1 20 MiB: 5 MiB live + 15 MiB free (kept: it is split); seg2 30 MiB fully free (released);
    # seg3 small 2 MiB fully free (released). After empty_cache: reserved 20 MiB, 1 segment.
    a = CachingAllocator()
    a.malloc(5 * MiB)
    h30 = a.malloc(30 * MiB)
    hs = a.malloc(100)
    a.free(h30)
    a.free(hs)
    assert a.stats().reserved_bytes == 52 * MiB
    a.empty_cache()
    s = a.stats()
    assert (s.reserved_bytes, s.num_segments, s.allocated_bytes) == (20 * MiB, 1, 5 * MiB)
    assert s.peak_reserved_bytes == 52 * MiB


def test_oom_releases_cache_then_retries_then_raises() -> None:
    # capacity 64 MiB. 30 MiB (segment 30) freed -> cached. 40 MiB: the 30 MiB block is too small;
    # cudaMalloc(40) fails (30 + 40 > 64); release_cached_blocks frees the 30 MiB segment; retry
    # succeeds: reserved 40 MiB, one retry counted. Peak reserved 40 MiB.
    a = CachingAllocator(capacity_bytes=64 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(40 * MiB)
    s = a.stats()
    assert (s.reserved_bytes, s.num_segments, s.num_alloc_retries, s.peak_reserved_bytes) == (
        40 * MiB, 1, 1, 40 * MiB)
    # 30 MiB more: 40 + 30 > 64, nothing cached to release -> AllocatorOOM; state unchanged.
    with pytest.raises(AllocatorOOM) as err:
        a.malloc(30 * MiB)
    assert err.value.requested_bytes == 30 * MiB
    s = a.stats()
    assert (s.reserved_bytes, s.allocated_bytes, s.num_ooms) == (40 * MiB, 40 * MiB, 1)


def test_oom_retry_counts_both_pools() -> None:
    # capacity 22 MiB. Three 1 MiB small requests fill one 2 MiB small segment and start a second; all
    # freed, 4 MiB stays cached. 5 MiB needs a 20 MiB segment: 4 + 20 > 22, so release_cached_blocks
    # frees both small segments (the cache spans both pools), and the retried cudaMalloc succeeds.
    a = CachingAllocator(capacity_bytes=22 * MiB)
    h1 = a.malloc(MiB)
    h2 = a.malloc(MiB)
    h3 = a.malloc(MiB)  # small segment full -> second 2 MiB small segment
    for h in (h1, h2, h3):
        a.free(h)
    assert a.stats().reserved_bytes == 4 * MiB
    a.malloc(5 * MiB)
    s = a.stats()
    assert (s.reserved_bytes, s.num_segments, s.num_alloc_retries) == (20 * MiB, 1, 1)


def test_max_split_size_rules() -> None:
    # max_split 40 MiB. A cached 50 MiB block is oversize (>= 40): a 25 MiB request (< 40) may not use it
    # -> new segment round2(25 MiB) = 26 MiB; remainder 1 MiB not split -> allocated 26 MiB; reserved 76.
    a = CachingAllocator(max_split_size_bytes=40 * MiB)
    a.free(a.malloc(50 * MiB))
    a.malloc(25 * MiB)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes) == (26 * MiB, 76 * MiB)
    # Without the option, the 25 MiB request splits the cached 50 MiB block: allocated 25, reserved 50.
    b = CachingAllocator()
    b.free(b.malloc(50 * MiB))
    b.malloc(25 * MiB)
    assert (b.stats().allocated_bytes, b.stats().reserved_bytes) == (25 * MiB, 50 * MiB)
    # A 45 MiB request (>= 40) may take the 50 MiB block (50 < 45 + 20), unsplit: allocated 50 MiB.
    c = CachingAllocator(max_split_size_bytes=40 * MiB)
    c.free(c.malloc(50 * MiB))
    c.malloc(45 * MiB)
    assert (c.stats().allocated_bytes, c.stats().reserved_bytes) == (50 * MiB, 50 * MiB)
    # A 41 MiB request may not take a cached 64 MiB block (64 >= 41 + 20): new 42 MiB segment (41 rounded
    # to 2 MiB); 41 >= max_split so it is not split: allocated 42 MiB; reserved 64 + 42 = 106 MiB.
    d = CachingAllocator(max_split_size_bytes=40 * MiB)
    d.free(d.malloc(64 * MiB))
    d.malloc(41 * MiB)
    assert (d.stats().allocated_bytes, d.stats().reserved_bytes) == (42 * MiB, 106 * MiB)
    # Boundary of "block.size >= request + kLargeBuffer": a 44 MiB request may not take a cached 64 MiB
    # block (64 >= 44 + 20): new 44 MiB segment; reserved 64 + 44 = 108 MiB.
    e = CachingAllocator(max_split_size_bytes=40 * MiB)
    e.free(e.malloc(64 * MiB))
    e.malloc(44 * MiB)
    assert (e.stats().allocated_bytes, e.stats().reserved_bytes) == (44 * MiB, 108 * MiB)
    with pytest.raises(ValueError):
        CachingAllocator(max_split_size_bytes=20 * MiB)  # must be > kLargeBuffer


def test_max_split_release_available_cached_blocks() -> None:
    # capacity 100 MiB, max_split 40 MiB. Cached free oversize segments: 50 MiB and 46 MiB (45 -> 46).
    # 60 MiB request: no block >= 60; cudaMalloc fails (96 + 60 > 100). release_available_cached_blocks:
    # key = max(60, 40) = 60; none that large, so free oversize blocks largest first: 50 (50 < 60),
    # then 46 (96 >= 60) -> retry without the isRetry count: reserved 60 MiB, 0 retries counted.
    a = CachingAllocator(max_split_size_bytes=40 * MiB, capacity_bytes=100 * MiB)
    h1 = a.malloc(50 * MiB)
    h2 = a.malloc(45 * MiB)
    a.free(h1)
    a.free(h2)
    assert a.stats().reserved_bytes == 96 * MiB
    a.malloc(60 * MiB)
    s = a.stats()
    assert (s.reserved_bytes, s.num_segments, s.num_alloc_retries) == (60 * MiB, 1, 0)


def test_expandable_segments_small_and_large_pages() -> None:
    # Small pool pages are kSmallBuffer (2 MiB): 3 x 100 B -> 1536 B allocated, one page mapped.
    a = CachingAllocator(expandable_segments=True)
    for _ in range(3):
        a.malloc(100)
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (1536, 2 * MiB, 1)
    # Large pool pages are kLargeBuffer (20 MiB). 15 MiB -> map 1 page (20 MiB), split (5 MiB free after).
    # 15 MiB more: 5 MiB free block too small; find_expandable_block takes that free block + the unmapped
    # space after it; maps ceil((15 - 5) / 20) = 1 page -> a 25 MiB free block, split: 15 + 10 free.
    # allocated 30 MiB, reserved 40 MiB (+2 MiB small), carved contiguously at offset 15 MiB.
    h1 = a.malloc(15 * MiB)
    h2 = a.malloc(15 * MiB)
    s = a.stats()
    assert s.allocated_bytes == 30 * MiB + 1536
    assert s.reserved_bytes == 42 * MiB
    assert a._live[h2].addr == a._live[h1].addr + 15 * MiB
    assert s.num_segments == 2  # one expandable segment per pool


def test_expandable_segments_avoid_fragmentation() -> None:
    # Plain: 12 MiB (segment 12) freed, then 14 MiB does not fit -> new 14 MiB segment: reserved 26 MiB.
    plain = replay([("alloc", 1, 12 * MiB), ("free", 1, 0), ("alloc", 2, 14 * MiB)])
    assert plain.reserved_bytes == 26 * MiB
    # Expandable: 12 MiB maps one 20 MiB page; freed, the 20 MiB free block serves 14 MiB: reserved 20 MiB.
    exp = replay([("alloc", 1, 12 * MiB), ("free", 1, 0), ("alloc", 2, 14 * MiB)], expandable_segments=True)
    assert exp.reserved_bytes == 20 * MiB
    assert exp.allocated_bytes == 14 * MiB  # expandable: always split (remainder >= 512)


def test_expandable_best_fit_prefers_blocks_that_cannot_grow() -> None:
    # Large pool, one 20 MiB page: x = [0, 10 MiB), y = [10, 15 MiB), free tail T = [15, 20 MiB) followed
    # by unmapped space. Free x -> A = [0, 10 MiB) free. A 4 MiB request: lower_bound finds T (5 MiB), but
    # get_free_block counts T as 5 MiB + the unmapped space after it, so it moves on to A (10 MiB < that)
    # and carves the request at offset 0, keeping the growable tail free.
    a = CachingAllocator(expandable_segments=True)
    hx = a.malloc(10 * MiB)
    a.malloc(5 * MiB)
    base = a._live[hx].addr
    a.free(hx)
    h = a.malloc(4 * MiB)
    assert a._live[h].addr == base
    s = a.stats()
    assert (s.allocated_bytes, s.reserved_bytes) == (9 * MiB, 20 * MiB)


def test_expandable_empty_cache_unmaps_only_whole_free_pages() -> None:
    # Small pool, 2 MiB pages: a=1 MiB, b=1 MiB fill page 0; c=1 MiB maps page 1 (1 MiB free after c).
    a = CachingAllocator(expandable_segments=True)
    ha = a.malloc(MiB)
    hb = a.malloc(MiB)
    a.malloc(MiB)
    assert a.stats().reserved_bytes == 4 * MiB
    # Free a: free block [0, 1 MiB) holds no whole page; the [3, 4 MiB) tail neither: nothing unmapped.
    a.free(ha)
    a.empty_cache()
    assert a.stats().reserved_bytes == 4 * MiB
    # Free b: [0, 2 MiB) is free -> page 0 unmapped: reserved 2 MiB.
    a.free(hb)
    a.empty_cache()
    assert a.stats().reserved_bytes == 2 * MiB
    assert a.stats().allocated_bytes == MiB
    # A 1 MiB request: the free [3, 4 MiB) block serves it, no mapping.
    a.malloc(MiB)
    assert a.stats().reserved_bytes == 2 * MiB
    # Another 1 MiB: re-maps page 0 (lowest unmapped address first): reserved 4 MiB again.
    a.malloc(MiB)
    assert a.stats().reserved_bytes == 4 * MiB
    assert a.stats().peak_reserved_bytes == 4 * MiB


def test_expandable_oom_unmaps_cache_then_raises() -> None:
    # capacity 40 MiB (2 large pages). 30 MiB maps 2 pages; freed (still mapped). 35 MiB: the 40 MiB free
    # block fits -> no mapping. Free; 1 MiB small request needs a 2 MiB page: 40 + 2 > 40 -> unmap the
    # cached large pages (reserved 0), retry maps the small page. Then 41 MiB can never fit -> OOM.
    a = CachingAllocator(expandable_segments=True, capacity_bytes=40 * MiB)
    a.free(a.malloc(30 * MiB))
    h = a.malloc(35 * MiB)
    assert a.stats().reserved_bytes == 40 * MiB
    a.free(h)
    a.malloc(MiB)
    s = a.stats()
    assert (s.reserved_bytes, s.num_alloc_retries, s.num_segments) == (2 * MiB, 1, 1)
    with pytest.raises(AllocatorOOM):
        a.malloc(41 * MiB)


def test_reset_peak_and_zero_byte_requests() -> None:
    # 30 MiB allocated then freed: peak 30, current 0. reset_peak -> peaks = current (0 alloc, 30 reserved).
    a = CachingAllocator()
    a.free(a.malloc(30 * MiB))
    a.reset_peak()
    s = a.stats()
    assert (s.peak_allocated_bytes, s.peak_reserved_bytes) == (0, 30 * MiB)
    # A 0-byte tensor never reaches the allocator (allocate() returns nullptr for size 0).
    h = a.malloc(0)
    assert a.stats().allocated_bytes == 0 and a.stats().num_alloc_calls == 1
    a.free(h)
    with pytest.raises(ValueError):
        a.free(h)


def test_replay_events_and_errors() -> None:
    # Three 100 B tensors, the middle one freed, then 600 B: rounds to 1024; the free 512 B hole is too
    # small, so it is carved after the third: allocated (and peak) 512 + 512 + 1024 = 2048 B.
    events = [("alloc", 1, 100), ("alloc", 2, 100), ("alloc", 3, 100), ("free", 2, 0), ("alloc", 4, 600)]
    s = replay(events)
    assert (s.allocated_bytes, s.peak_allocated_bytes, s.reserved_bytes) == (2048, 2048, 2 * MiB)
    with pytest.raises(ValueError):
        replay([("free", 7, 0)])
    with pytest.raises(ValueError):
        replay([("alloc", 1, 10), ("alloc", 1, 10)])


# ---------------------------------------------------------------------- randomized property test


def _check_structure(a: CachingAllocator) -> None:
    """Blocks tile their segments; free neighbours are merged; reserved matches the segments."""
    blocks: list[_Block] = [b for b in a._live.values() if b is not None]
    for pool in (a._small, a._large):
        assert pool.blocks == sorted(pool.blocks)
        assert len(pool.blocks) == len(pool.free)
        blocks += list(pool.free.values()) + list(pool.unmapped_blocks.values())
    by_seg: dict[int, list[_Block]] = {}
    for b in blocks:
        by_seg.setdefault(id(b.seg), []).append(b)
    reserved = 0
    for seg_blocks in by_seg.values():
        seg_blocks.sort(key=lambda b: b.addr)
        seg = seg_blocks[0].seg
        assert seg_blocks[0].addr == seg.base and seg_blocks[0].prev is None
        assert sum(b.size for b in seg_blocks) == seg.size
        for x, y in zip(seg_blocks, seg_blocks[1:], strict=False):
            assert x.addr + x.size == y.addr and x.next is y and y.prev is x
            if not x.allocated and not y.allocated:
                assert x.mapped != y.mapped  # two free mapped (or two unmapped) neighbours would be merged
        assert seg_blocks[-1].next is None
        reserved += sum(b.size for b in seg_blocks if b.mapped)
    assert reserved == a.stats().reserved_bytes


@pytest.mark.parametrize("kwargs", [
    {},
    {"expandable_segments": True},
    {"max_split_size_bytes": 64 * MiB, "capacity_bytes": 2048 * MiB},
    {"expandable_segments": True, "capacity_bytes": 1024 * MiB},
])
def test_random_sequences_keep_invariants(kwargs: dict) -> None:
    rng = random.Random(1234)
    a = CachingAllocator(**kwargs)
    live: dict[int, int] = {}  # handle -> requested size
    peak_alloc = peak_res = 0
    for step in range(4000):
        if live and rng.random() < 0.45:
            h = rng.choice(list(live))
            del live[h]
            a.free(h)
        else:
            r = rng.random()
            size = (rng.randint(0, 4096) if r < 0.5 else rng.randint(4097, 2 * MiB) if r < 0.8
                    else rng.randint(2 * MiB, 80 * MiB))
            try:
                live[a.malloc(size, stream=rng.randint(0, 1))] = size
            except AllocatorOOM:
                pass
        if step % 500 == 0:
            a.empty_cache()
        s = a.stats()
        assert s.reserved_bytes >= s.allocated_bytes
        total = 0
        for h, size in live.items():
            b = a._live[h]
            if size == 0:
                assert b is None
                continue
            rounded = round_size(size)
            assert b.size >= rounded
            if rounded <= MiB or kwargs.get("expandable_segments"):
                assert b.size == rounded  # small pool / expandable: always split down to the request
            elif b.size < kwargs.get("max_split_size_bytes", 1 << 62):
                assert b.size - rounded <= MiB  # large pool: only a remainder <= kSmallSize is kept
            total += b.size
        assert s.allocated_bytes == total
        peak_alloc = max(peak_alloc, s.allocated_bytes)
        peak_res = max(peak_res, s.reserved_bytes)
        assert s.peak_allocated_bytes >= peak_alloc and s.peak_reserved_bytes >= peak_res
        if "capacity_bytes" in kwargs:
            assert s.peak_reserved_bytes <= kwargs["capacity_bytes"]
        if step % 97 == 0:
            _check_structure(a)
    # Peaks are maxima of what was observed (reserved can also peak inside a malloc that then OOMs).
    assert a.stats().peak_allocated_bytes == peak_alloc
    _check_structure(a)
    for h in list(live):
        a.free(h)
    a.empty_cache()
    assert a.stats().allocated_bytes == 0
    assert a.stats().reserved_bytes == 0
