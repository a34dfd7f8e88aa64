"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.x defaults).

Replays the tensor allocations and frees of a training step and reports what
``torch.cuda.memory_allocated / max_memory_allocated / memory_reserved / max_memory_reserved``
would show. Modelled from the C++ (names in comments are the C++ names):

* ``round_size``: requests round up to kMinBlockSize (512 B); anything under 512 B becomes 512 B.
  (``roundup_power2_divisions`` is not modelled: it is off by default.)
* Pools (``get_pool``): requests <= kSmallSize (1 MiB) go to the small pool, the rest to the large
  pool; the pools never share segments.
* ``get_allocation_size``: a small request that misses the cache cudaMallocs a kSmallBuffer (2 MiB)
  segment, a large one under kMinLargeAlloc (10 MiB) a kLargeBuffer (20 MiB) segment, anything
  bigger its size rounded up to kRoundLarge (2 MiB).
* ``get_free_block``: best fit, i.e. ``lower_bound`` on (stream, size, address) among the pool's
  free blocks, with the ``max_split_size`` rules for oversize blocks.
* ``should_split``: small pool (or expandable segments) split when the remainder is >= 512 B; the
  large pool only when the request is < max_split_size and the remainder is > kSmallSize (1 MiB).
  An unsplit block is handed out whole and ``memory_allocated`` counts its whole size.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment.
* On a failed cudaMalloc (only possible with ``capacity_bytes``): ``release_available_cached_blocks``
  (only with max_split_size set), retry, then ``release_cached_blocks`` (= empty_cache), retry,
  then OOM (``AllocatorOOM``).
* Expandable segments (``expandable_segments=True``): one segment per pool and stream, a virtual
  address range of 1 1/8 x device memory mapped page by page, the page (``segment_size``) being
  kSmallBuffer (2 MiB) for the small pool and kLargeBuffer (20 MiB) for the large pool
  (``try_allocate_expandable_block``, ``find_expandable_block``, ``map_block``,
  ``unmap_block``). Pages are unmapped only by empty_cache (or the OOM retry), and only pages that
  lie wholly inside a free block.

Simplified: one device; streams only separate free blocks (no cross-stream events or record_stream);
CUDA graphs / private pools, ``garbage_collection_threshold``, ``set_per_process_memory_fraction``
and the free-memory callbacks are not modelled. Segment addresses are a bump pointer, so ties
between equal-size free blocks break by segment age (real cudaMalloc addresses are unknown).
Zero-byte requests never reach the allocator (``CUDACachingAllocator::allocate`` skips size 0).

A change here is a change to ``native_replay.c`` too: its twin of this class runs the estimator's replays
(llmem.memory.phase_replay; tests/memory/test_native_replay.py holds the two to the same answers).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass

from llmem.errors import LlmemError

# Constants of CUDACachingAllocator.cpp
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 << 20  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 << 20  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 << 20  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 << 20  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 << 20  # round up large allocations to 2 MiB

_SIZE_MAX = (1 << 64) - 1  # CUDAAllocatorConfig::max_split_size() default: numeric_limits<size_t>::max()
_ADDR_MASK = (1 << 64) - 1
# Free blocks are kept in a sorted list of int keys (stream << 128 | size << 64 | address), which
# orders like BlockComparatorSize; unmapped blocks by (stream << 64 | address), like
# BlockComparatorAddress. Int keys compare faster than tuples.
_NO_CAPACITY_ADDRESS_SPACE = 1 << 48  # expandable address space when no capacity is given


class AllocatorOOM(RuntimeError):
    """The modelled device has no room for a new segment even after releasing the cache."""

    def __init__(self, requested_bytes: int, alloc_bytes: int, reserved_bytes: int, allocated_bytes: int,
                 capacity_bytes: int | None) -> None:
        self.requested_bytes = requested_bytes
        self.alloc_bytes = alloc_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"CUDA out of memory (modelled): tried to allocate {requested_bytes} bytes "
            f"(device allocation {alloc_bytes} bytes); capacity {capacity_bytes} bytes, "
            f"{reserved_bytes} reserved, {allocated_bytes} allocated")


@dataclass
class AllocatorStats:
    allocated_bytes: int  # memory_allocated(): sum of live block sizes (after rounding / unsplit)
    reserved_bytes: int  # memory_reserved(): cudaMalloc'd segments + mapped expandable pages
    peak_allocated_bytes: int  # max_memory_allocated()
    peak_reserved_bytes: int  # max_memory_reserved()
    num_segments: int  # live segments (an expandable segment counts while it has mapped pages)
    num_alloc_calls: int  # malloc() calls that reached the allocator (memory_stats "allocation.all.allocated")
    num_device_allocs: int = 0  # cudaMalloc calls, or page mappings (cuMemCreate) with expandable segments
    num_alloc_retries: int = 0  # memory_stats "num_alloc_retries": cudaMalloc retried after emptying the cache
    num_ooms: int = 0  # memory_stats "num_ooms"


class _Segment:
    """One cudaMalloc'd segment, or one expandable segment (ExpandableSegment)."""

    __slots__ = ("base", "size", "page", "expandable", "mapped_bytes")

    def __init__(self, base: int, size: int, page: int, expandable: bool) -> None:
        self.base = base
        self.size = size
        self.page = page  # ExpandableSegment::segment_size_ (unused for plain segments)
        self.expandable = expandable
        self.mapped_bytes = 0


class _Block:
    """Block: a contiguous range of a segment, linked to its neighbours (prev/next)."""

    __slots__ = ("addr", "size", "stream", "pool", "seg", "prev", "next", "allocated", "mapped")

    def __init__(self, addr: int, size: int, stream: int, pool: _Pool, seg: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.seg = seg
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = mapped


class _Pool:
    """BlockPool: the free blocks of one pool (sorted keys + address -> block) and its unmapped blocks."""

    __slots__ = ("is_small", "blocks", "free", "unmapped", "unmapped_blocks")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.blocks: list[int] = []  # sorted size keys of free mapped blocks
        self.free: dict[int, _Block] = {}  # address -> free mapped block
        self.unmapped: list[int] = []  # sorted address keys of unmapped blocks (expandable segments)
        self.unmapped_blocks: dict[int, _Block] = {}

    def insert(self, b: _Block) -> None:  # insert_into_blocks
        insort(self.blocks, (b.stream << 128) | (b.size << 64) | b.addr)
        self.free[b.addr] = b

    def erase(self, b: _Block) -> None:
        keys = self.blocks
        del keys[bisect_left(keys, (b.stream << 128) | (b.size << 64) | b.addr)]
        del self.free[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        insort(self.unmapped, (b.stream << 64) | b.addr)
        self.unmapped_blocks[b.addr] = b

    def erase_unmapped(self, b: _Block) -> None:
        keys = self.unmapped
        del keys[bisect_left(keys, (b.stream << 64) | b.addr)]
        del self.unmapped_blocks[b.addr]


def round_size(size_bytes: int) -> int:
    """round_size: up to a multiple of kMinBlockSize (512 B); under 512 B (including 0) -> 512 B."""
    if size_bytes < kMinBlockSize:
        return kMinBlockSize
    return -(-size_bytes // kMinBlockSize) * kMinBlockSize


def allocation_size(size_bytes: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a request (rounded first) that misses the cache."""
    size = round_size(size_bytes)
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return -(-size // kRoundLarge) * kRoundLarge


class CachingAllocator:
    """DeviceCachingAllocator for one device: malloc / free / empty_cache and the memory statistics."""

    def __init__(self, expandable_segments: bool = False, max_split_size_bytes: int | None = None,
                 capacity_bytes: int | None = None) -> None:
        if max_split_size_bytes is not None and max_split_size_bytes <= kLargeBuffer:
            # CUDAAllocatorConfig: "max_split_size_mb too small, must be > 20"
            raise ValueError(f"max_split_size_bytes must be > kLargeBuffer ({kLargeBuffer}), got {max_split_size_bytes}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.expandable_segments = expandable_segments
        self.max_split_size_bytes = max_split_size_bytes
        self.capacity_bytes = capacity_bytes
        self._max_split = _SIZE_MAX if max_split_size_bytes is None else max_split_size_bytes
        self._small = _Pool(is_small=True)
        self._large = _Pool(is_small=False)
        self._live: dict[int, _Block | None] = {}  # handle -> allocated block (None for 0-byte requests)
        self._next_handle = 0
        self._next_addr = 1 << 32  # bump pointer for segment base addresses
        self._expandable: list[_Segment] = []  # expandable_segments_
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._num_segments = 0
        self._num_alloc_calls = 0
        self._num_device_allocs = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0

    # ------------------------------------------------------------------ public API

    def malloc(self, size_bytes: int, stream: int = 0) -> int:
        """DeviceCachingAllocator::malloc; returns a handle to pass to free()."""
        if size_bytes < 0 or stream < 0:
            raise ValueError(f"size and stream must be >= 0, got size={size_bytes} stream={stream}")
        handle = self._next_handle
        self._next_handle = handle + 1
        if size_bytes == 0:  # CUDACachingAllocator::allocate: size 0 returns nullptr, no block
            self._live[handle] = None
            return handle
        self._num_alloc_calls += 1
        size = round_size(size_bytes)
        if self._next_addr + size > _ADDR_MASK:  # sizes and addresses are 64-bit (size_t), as in CUDA
            raise LlmemError(f"the step's tensors pass 2**64 bytes ({size_bytes:,} more asked): no device holds "
                             "them; make --batch-size or --seq-len smaller")
        pool = self._small if size <= kSmallSize else self._large  # get_pool
        block = self._get_free_block(pool, size, stream)
        if block is None:
            alloc_size = allocation_size(size)
            block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                # release_cached_blocks() && alloc_block(params, isRetry=true)
                self._release_cached_blocks()
                self._num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self._num_ooms += 1
                raise AllocatorOOM(size_bytes, alloc_size, self._reserved, self._allocated, self.capacity_bytes)
        self._alloc_found_block(pool, block, size)
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free -> free_block: merge with free neighbours, back to the pool."""
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise ValueError(f"free of unknown or already freed handle {handle}") from None
        if block is None:
            return
        block.allocated = False
        self._allocated -= block.size
        pool = block.pool
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and prev.mapped:
            self._try_merge_blocks(block, prev, pool)
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._try_merge_blocks(block, nxt, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """emptyCache -> release_cached_blocks: free every fully free segment, unmap free expandable pages."""
        self._release_cached_blocks()

    @property
    def allocated_bytes(self) -> int:
        """memory_allocated(), without building a stats object (hot path of replays)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_bytes=self._allocated,
            reserved_bytes=self._reserved,
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
            num_segments=self._num_segments,
            num_alloc_calls=self._num_alloc_calls,
            num_device_allocs=self._num_device_allocs,
            num_alloc_retries=self._num_alloc_retries,
            num_ooms=self._num_ooms,
        )

    def reset_peak(self) -> None:
        """reset_peak_memory_stats: peaks restart from the current values."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    # ------------------------------------------------------------------ malloc internals

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """get_free_block: best fit (lower_bound on (stream, size, ptr)) plus the max_split_size rules."""
        keys = pool.blocks
        i = bisect_left(keys, (stream << 128) | (size << 64))
        if i == len(keys):
            return None
        key = keys[i]
        if key >> 128 != stream:
            return None
        free = pool.free
        block = free[key & _ADDR_MASK]
        if block.seg.expandable:
            # For best fit, a free block followed by unmapped space counts as the size it can grow to.
            n = len(keys)
            while block.seg.expandable and i + 1 < n:
                key = keys[i + 1]
                if key >> 128 != stream:
                    break
                nxt = free[key & _ADDR_MASK]
                if _expandable_size(nxt) >= _expandable_size(block):
                    break
                i += 1
                block = nxt
        max_split = self._max_split
        # Do not return an oversized block for a large request
        if size < max_split and block.size >= max_split:
            return None
        # Allow oversized block size to be rounded up but within a limit
        if size >= max_split and block.size >= size + kLargeBuffer:
            return None
        del keys[i]
        del free[block.addr]
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int) -> _Block | None:
        """alloc_block: cudaMalloc a new segment of alloc_size (or map expandable pages); None if no room."""
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity_bytes is not None and self._reserved + alloc_size > self.capacity_bytes:
            return None  # cudaErrorMemoryAllocation
        seg = _Segment(self._next_addr, alloc_size, alloc_size, expandable=False)
        self._next_addr += -(-alloc_size // kRoundLarge) * kRoundLarge
        self._num_segments += 1
        self._num_device_allocs += 1
        self._add_reserved(alloc_size)
        return _Block(seg.base, alloc_size, stream, pool, seg)

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int) -> None:
        """alloc_found_block: split per should_split, mark allocated, count the block's size."""
        remaining = block.size - size
        if pool.is_small or self.expandable_segments:  # should_split
            split = remaining >= kMinBlockSize
        else:
            split = size < self._max_split and remaining > kSmallSize
        if split:
            rest = _Block(block.addr + size, remaining, block.stream, pool, block.seg)
            _link_after(block, rest)
            block.size = size
            pool.insert(rest)
        block.allocated = True
        allocated = self._allocated + block.size
        self._allocated = allocated
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        """try_merge_blocks: absorb free neighbour src (same mapped state) into dst (not in any set)."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _add_reserved(self, nbytes: int) -> None:
        reserved = self._reserved + nbytes
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved

    # ------------------------------------------------------------------ releasing cached memory

    def _release_block(self, block: _Block) -> None:
        """release_block: cudaFree a fully free segment (block spans the whole segment)."""
        block.pool.erase(block)
        self._num_segments -= 1
        self._reserved -= block.seg.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """release_available_cached_blocks: with max_split_size set, free oversize cached segments."""
        max_split = self._max_split
        if max_split == _SIZE_MAX:
            return False
        key_size = max(size, max_split)
        keys = pool.blocks
        i = bisect_left(keys, (stream << 128) | (key_size << 64))
        if i == len(keys) or keys[i] >> 128 != stream or pool.free[keys[i] & _ADDR_MASK].seg.expandable:
            # No single block is large enough; free multiple oversize blocks, starting with the largest
            if i == 0:
                return False
            released = 0
            to_release = []
            j = i - 1
            while released < key_size and j >= 0:
                block = pool.free[keys[j] & _ADDR_MASK]
                if block.size < max_split or block.stream != stream:
                    break
                if not block.seg.expandable and block.prev is None and block.next is None:
                    to_release.append(block)
                    released += block.size
                j -= 1
            for block in to_release:
                self._release_block(block)
            return released >= key_size
        block = pool.free[keys[i] & _ADDR_MASK]
        if block.prev is not None or block.next is not None:
            return False  # cannot happen with max_split_size > kLargeBuffer; real code would assert
        self._release_block(block)
        return True

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks -> release_blocks(large), release_blocks(small)."""
        for pool in (self._large, self._small):
            to_unmap = []
            for block in list(pool.free.values()):
                if block.seg.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)

    # ------------------------------------------------------------------ expandable segments

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """try_allocate_expandable_block: map pages until a free block of >= size exists; take it."""
        candidate = self._find_expandable_block(pool, size, stream)
        # candidate: unmapped -> null | unmapped -> free -> * | free -> unmapped -> *
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # invariant: free -> unmapped -> *; map_block maps some of unmapped and merges with free
            remaining = size - candidate.size
            new_candidate = candidate.next
            assert new_candidate is not None
            if not self._map_block(new_candidate, min(remaining, new_candidate.size)):
                return None
            candidate = new_candidate
        pool.erase(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        """find_expandable_block: lowest-address unmapped range (with a free block before it) of room >= size."""
        keys = pool.unmapped
        i = bisect_left(keys, stream << 64)
        while i < len(keys) and keys[i] >> 64 == stream:
            c = pool.unmapped_blocks[keys[i] & _ADDR_MASK]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c  # has_available_address_space
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        # New ExpandableSegment: address space of 1 1/8 the device memory, pages of segment_size.
        page = kSmallBuffer if pool.is_small else kLargeBuffer
        if self.capacity_bytes is None:
            space = _NO_CAPACITY_ADDRESS_SPACE
        else:
            space = self.capacity_bytes + self.capacity_bytes // 8
        space = -(-space // page) * page
        seg = _Segment(self._next_addr, space, page, expandable=True)
        self._next_addr += -(-space // kLargeBuffer) * kLargeBuffer
        self._expandable.append(seg)
        candidate = _Block(seg.base, space, stream, pool, seg, mapped=False)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """map_block: map the pages covering [to_map.addr, +size) of an unmapped block, merge, insert."""
        seg = to_map.seg
        page = seg.page
        mapped = -(-size // page) * page  # ExpandableSegment::map: segmentRight(ptr + size)
        if self.capacity_bytes is not None and self._reserved + mapped > self.capacity_bytes:
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY, pages of this call released
        pool = to_map.pool
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:  # to_map -> remaining (unmapped) -> to_map.next
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.stream, pool, seg, mapped=False)
            _link_after(to_map, rest)
            to_map.size = mapped
            pool.insert_unmapped(rest)
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        if seg.mapped_bytes == 0:
            self._num_segments += 1
        seg.mapped_bytes += mapped
        self._num_device_allocs += mapped // page
        self._add_reserved(mapped)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block: unmap the whole pages inside a free block; the partial pages stay free blocks."""
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.base
        begin = -(-offset // page)  # segmentRight(ptr)
        end = (offset + block.size) // page  # segmentLeft(ptr + size)
        if begin >= end:
            return
        pool = block.pool
        pool.erase(block)
        start = seg.base + begin * page
        unmapped = (end - begin) * page
        before = start - block.addr
        if before > 0:  # prev? -> before_free -> block
            bf = _Block(block.addr, before, block.stream, pool, seg)
            bf.prev = block.prev
            if bf.prev is not None:
                bf.prev.next = bf
            bf.next = block
            block.prev = bf
            pool.insert(bf)
        after = block.size - before - unmapped
        if after > 0:  # block -> after_free -> next?
            af = _Block(start + unmapped, after, block.stream, pool, seg)
            _link_after(block, af)
            pool.insert(af)
        block.addr = start
        block.size = unmapped
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        seg.mapped_bytes -= unmapped
        if seg.mapped_bytes == 0:
            self._num_segments -= 1
        self._reserved -= unmapped


def _expandable_size(b: _Block) -> int:
    """get_free_block's expandable_size: the size plus the unmapped space right after it."""
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def replay(events: Iterable[tuple[str, int, int]], **allocator_kwargs: object) -> AllocatorStats:
    """Replay ("alloc", key, size_bytes) / ("free", key, 0) events through a fresh CachingAllocator.

    ``key`` is the caller's id (e.g. a storage id). Keyword arguments go to CachingAllocator. An alloc of
    a live key or a free of an unknown key raises ValueError; AllocatorOOM propagates.
    """
    allocator = CachingAllocator(**allocator_kwargs)  # type: ignore[arg-type]
    malloc, free = allocator.malloc, allocator.free
    handles: dict[int, int] = {}
    for kind, key, size in events:
        if kind == "alloc":
            if key in handles:
                raise ValueError(f"alloc of key {key} that is still live")
            handles[key] = malloc(size)
        elif kind == "free":
            handle = handles.pop(key, None)
            if handle is None:
                raise ValueError(f"free of key {key} that is not live")
            free(handle)
        else:
            raise ValueError(f"unknown event kind {kind!r} (expected 'alloc' or 'free')")
    return allocator.stats()


def _link_after(block: _Block, rest: _Block) -> None:
    """Insert `rest` right after `block` in the segment's address-ordered list (a split)."""
    nxt = block.next
    rest.prev = block
    rest.next = nxt
    if nxt is not None:
        nxt.prev = rest
    block.next = rest
