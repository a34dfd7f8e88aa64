/* The replay loop of llmem.memory.phase_replay, compiled: a step schedule's allocation events through the model of
 * PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), per-phase peaks and the tensor bytes per
 * component at chosen events.
 *
 * A line-for-line twin of llmem/memory/allocator.py's CachingAllocator (malloc, free, release_cached_blocks and the
 * expandable segments; names as there, which are the C++ names) and of phase_replay.py's `_phase_peaks_py` /
 * `_components_at_py`, which stay the reference: tests/memory/test_native_replay.py replays random schedules
 * through both and requires equal answers. Not modelled here, as the estimator never asks for it:
 * max_split_size (CUDAAllocatorConfig's default, SIZE_MAX, is taken).
 *
 * Anything the twin does not handle the way the Python does (a size or address past 64 bits, a negative size or
 * stream, a free of a key not live, an event that is not a tuple of ints) makes a function return None: the caller
 * then runs the Python reference, which raises the reference's error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Constants of CUDACachingAllocator.cpp, as in allocator.py */
#define kMinBlockSize 512ULL
#define kSmallSize (1ULL << 20)
#define kSmallBuffer (2ULL << 20)
#define kLargeBuffer (20ULL << 20)
#define kMinLargeAlloc (10ULL << 20)
#define kRoundLarge (2ULL << 20)
#define NO_CAPACITY_ADDRESS_SPACE (1ULL << 48)
#define MAX_KEY (1LL << 31)          /* event keys index a table: larger ones go to the Python reference */

typedef struct Segment {
    uint64_t base, size, page, mapped_bytes;
    int expandable;
    struct Segment *next_alloc;      /* every segment made, freed at the end */
} Segment;

struct Pool;

typedef struct Block {
    uint64_t addr, size, stream;
    uint64_t seq;                    /* insertion order into the pool's free blocks (allocator.py's `free` dict) */
    struct Pool *pool;
    Segment *seg;
    struct Block *prev, *next;
    int allocated, mapped;
    struct Block *next_free_struct;  /* the struct free list */
} Block;

/* the free blocks are kept as pointers sorted by (stream, size, addr), BlockComparatorSize's order: a block's fields
 * never change while it is in a pool (allocator.py relies on the same: its keys are computed at insertion) */
typedef struct { uint64_t stream, addr; Block *b; } UEntry;          /* BlockComparatorAddress order */

typedef struct Pool {
    int is_small;
    Block **blocks; size_t n, cap;
    UEntry *unmapped; size_t un, ucap;
} Pool;

typedef struct {
    int expandable_segments;
    int has_capacity;
    uint64_t capacity;
    Pool small, large;
    uint64_t next_addr, allocated, reserved, peak_allocated, peak_reserved;
    uint64_t num_segments, num_alloc_calls, num_device_allocs, num_alloc_retries, num_ooms;
    uint64_t next_seq;
    Segment *segments;
    Block **chunks; size_t nchunks, chunk_cap;
    Block *free_structs;
    Block **live; size_t live_cap;   /* event key -> its block; ZERO_BLOCK for a 0-byte request */
    int failed;                      /* out of C memory */
} Alloc;

static Block zero_block_storage;
#define ZERO_BLOCK (&zero_block_storage)
#define CHUNK 4096

/* ------------------------------------------------------------------ C memory */

static Block *new_block(Alloc *a, uint64_t addr, uint64_t size, uint64_t stream, Pool *pool, Segment *seg,
                        int mapped) {
    if (a->free_structs == NULL) {
        if (a->nchunks == a->chunk_cap) {
            size_t cap = a->chunk_cap ? 2 * a->chunk_cap : 16;
            Block **c = realloc(a->chunks, cap * sizeof(Block *));
            if (c == NULL) { a->failed = 1; return NULL; }
            a->chunks = c; a->chunk_cap = cap;
        }
        Block *chunk = malloc(CHUNK * sizeof(Block));
        if (chunk == NULL) { a->failed = 1; return NULL; }
        a->chunks[a->nchunks++] = chunk;
        for (size_t i = 0; i < CHUNK; i++) { chunk[i].next_free_struct = a->free_structs; a->free_structs = &chunk[i]; }
    }
    Block *b = a->free_structs;
    a->free_structs = b->next_free_struct;
    b->addr = addr; b->size = size; b->stream = stream; b->seq = 0; b->pool = pool; b->seg = seg;
    b->prev = NULL; b->next = NULL; b->allocated = 0; b->mapped = mapped;
    return b;
}

static void drop_block(Alloc *a, Block *b) { b->next_free_struct = a->free_structs; a->free_structs = b; }

static Segment *new_segment(Alloc *a, uint64_t base, uint64_t size, uint64_t page, int expandable) {
    Segment *s = malloc(sizeof(Segment));
    if (s == NULL) { a->failed = 1; return NULL; }
    s->base = base; s->size = size; s->page = page; s->mapped_bytes = 0; s->expandable = expandable;
    s->next_alloc = a->segments; a->segments = s;
    return s;
}

static void alloc_init(Alloc *a, int expandable, int has_capacity, uint64_t capacity) {
    memset(a, 0, sizeof(Alloc));
    a->expandable_segments = expandable;
    a->has_capacity = has_capacity;
    a->capacity = capacity;
    a->small.is_small = 1;
    a->next_addr = 1ULL << 32;
}

static void alloc_free(Alloc *a) {
    for (size_t i = 0; i < a->nchunks; i++) free(a->chunks[i]);
    free(a->chunks);
    while (a->segments) { Segment *s = a->segments; a->segments = s->next_alloc; free(s); }
    free(a->small.blocks); free(a->small.unmapped); free(a->large.blocks); free(a->large.unmapped);
    free(a->live);
}

/* ------------------------------------------------------------------ BlockPool: sorted free and unmapped blocks */

static int entry_less(uint64_t s1, uint64_t z1, uint64_t a1, uint64_t s2, uint64_t z2, uint64_t a2) {
    if (s1 != s2) return s1 < s2;
    if (z1 != z2) return z1 < z2;
    return a1 < a2;
}

static size_t lower_bound(Pool *p, uint64_t stream, uint64_t size, uint64_t addr) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        Block *e = p->blocks[mid];
        if (entry_less(e->stream, e->size, e->addr, stream, size, addr)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void pool_insert(Alloc *a, Pool *p, Block *b) {   /* insert_into_blocks */
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 64;
        Block **e = realloc(p->blocks, cap * sizeof(Block *));
        if (e == NULL) { a->failed = 1; return; }
        p->blocks = e; p->cap = cap;
    }
    size_t i = lower_bound(p, b->stream, b->size, b->addr);
    memmove(&p->blocks[i + 1], &p->blocks[i], (p->n - i) * sizeof(Block *));
    p->blocks[i] = b;
    p->n++;
    b->seq = a->next_seq++;
}

static void pool_erase_at(Pool *p, size_t i) {
    memmove(&p->blocks[i], &p->blocks[i + 1], (p->n - i - 1) * sizeof(Block *));
    p->n--;
}

static void pool_erase(Pool *p, Block *b) { pool_erase_at(p, lower_bound(p, b->stream, b->size, b->addr)); }

static size_t lower_bound_unmapped(Pool *p, uint64_t stream, uint64_t addr) {
    size_t lo = 0, hi = p->un;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        UEntry *e = &p->unmapped[mid];
        if (e->stream < stream || (e->stream == stream && e->addr < addr)) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void pool_insert_unmapped(Alloc *a, Pool *p, Block *b) {
    if (p->un == p->ucap) {
        size_t cap = p->ucap ? 2 * p->ucap : 16;
        UEntry *e = realloc(p->unmapped, cap * sizeof(UEntry));
        if (e == NULL) { a->failed = 1; return; }
        p->unmapped = e; p->ucap = cap;
    }
    size_t i = lower_bound_unmapped(p, b->stream, b->addr);
    memmove(&p->unmapped[i + 1], &p->unmapped[i], (p->un - i) * sizeof(UEntry));
    p->unmapped[i].stream = b->stream; p->unmapped[i].addr = b->addr; p->unmapped[i].b = b;
    p->un++;
}

static void pool_erase_unmapped(Pool *p, Block *b) {
    size_t i = lower_bound_unmapped(p, b->stream, b->addr);
    memmove(&p->unmapped[i], &p->unmapped[i + 1], (p->un - i - 1) * sizeof(UEntry));
    p->un--;
}

/* ------------------------------------------------------------------ sizes */

static uint64_t round_size(uint64_t size) {
    if (size < kMinBlockSize) return kMinBlockSize;
    return (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

static uint64_t allocation_size(uint64_t size) {   /* get_allocation_size, of a rounded size */
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

static void link_after(Block *block, Block *rest) {
    Block *nxt = block->next;
    rest->prev = block; rest->next = nxt;
    if (nxt) nxt->prev = rest;
    block->next = rest;
}

static uint64_t expandable_size(Block *b) {
    Block *nxt = b->next;
    return b->size + ((nxt && !nxt->mapped) ? nxt->size : 0);
}

static void add_reserved(Alloc *a, uint64_t n) {
    a->reserved += n;
    if (a->reserved > a->peak_reserved) a->peak_reserved = a->reserved;
}

/* ------------------------------------------------------------------ malloc internals */

static Block *get_free_block(Pool *p, uint64_t size, uint64_t stream) {
    size_t i = lower_bound(p, stream, size, 0);
    if (i == p->n || p->blocks[i]->stream != stream) return NULL;
    Block *block = p->blocks[i];
    if (block->seg->expandable) {
        while (block->seg->expandable && i + 1 < p->n) {
            Block *e = p->blocks[i + 1];
            if (e->stream != stream) break;
            if (expandable_size(e) >= expandable_size(block)) break;
            i++;
            block = e;
        }
    }
    pool_erase_at(p, i);
    return block;
}

/* try_merge_blocks: absorb free neighbour src (same mapped state) into dst (not in any set) */
static void try_merge_blocks(Alloc *a, Block *dst, Block *src, Pool *p) {
    if (src == NULL || src->allocated || dst->mapped != src->mapped) return;
    if (src->mapped) pool_erase(p, src); else pool_erase_unmapped(p, src);
    if (dst->prev == src) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev) dst->prev->next = dst;
    } else {
        dst->next = src->next;
        if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    drop_block(a, src);
}

static int map_block(Alloc *a, Block *to_map, uint64_t size) {
    Segment *seg = to_map->seg;
    uint64_t page = seg->page;
    uint64_t mapped = (size + page - 1) / page * page;
    if (a->has_capacity && a->reserved + mapped > a->capacity) return 0;
    Pool *p = to_map->pool;
    pool_erase_unmapped(p, to_map);
    to_map->mapped = 1;
    if (mapped < to_map->size) {
        Block *rest = new_block(a, to_map->addr + mapped, to_map->size - mapped, to_map->stream, p, seg, 0);
        if (rest == NULL) return 0;
        link_after(to_map, rest);
        to_map->size = mapped;
        pool_insert_unmapped(a, p, rest);
    }
    try_merge_blocks(a, to_map, to_map->prev, p);
    try_merge_blocks(a, to_map, to_map->next, p);
    pool_insert(a, p, to_map);
    if (seg->mapped_bytes == 0) a->num_segments++;
    seg->mapped_bytes += mapped;
    a->num_device_allocs += mapped / page;
    add_reserved(a, mapped);
    return 1;
}

static Block *find_expandable_block(Alloc *a, Pool *p, uint64_t size, uint64_t stream) {
    size_t i = lower_bound_unmapped(p, stream, 0);
    while (i < p->un && p->unmapped[i].stream == stream) {
        Block *c = p->unmapped[i].b;
        if (c->prev && !c->prev->allocated) c = c->prev;
        uint64_t room = 0;
        Block *b = c;
        while (room < size && b && !b->allocated) { room += b->size; b = b->next; }
        if (room >= size) return c;
        i++;
    }
    uint64_t page = p->is_small ? kSmallBuffer : kLargeBuffer;
    uint64_t space = a->has_capacity ? a->capacity + a->capacity / 8 : NO_CAPACITY_ADDRESS_SPACE;
    space = (space + page - 1) / page * page;
    uint64_t step = (space + kLargeBuffer - 1) / kLargeBuffer * kLargeBuffer;
    if (step > UINT64_MAX - a->next_addr) { a->failed = 1; return NULL; }   /* addresses past 64 bits */
    Segment *seg = new_segment(a, a->next_addr, space, page, 1);
    if (seg == NULL) return NULL;
    a->next_addr += step;
    Block *candidate = new_block(a, seg->base, space, stream, p, seg, 0);
    if (candidate == NULL) return NULL;
    pool_insert_unmapped(a, p, candidate);
    return candidate;
}

static Block *try_allocate_expandable_block(Alloc *a, Pool *p, uint64_t size, uint64_t stream) {
    Block *candidate = find_expandable_block(a, p, size, stream);
    if (candidate == NULL) return NULL;
    if (!candidate->mapped && !map_block(a, candidate, candidate->size < size ? candidate->size : size)) return NULL;
    while (candidate->size < size) {
        uint64_t remaining = size - candidate->size;
        Block *new_candidate = candidate->next;
        if (!map_block(a, new_candidate, remaining < new_candidate->size ? remaining : new_candidate->size))
            return NULL;
        candidate = new_candidate;
    }
    pool_erase(p, candidate);
    return candidate;
}

static Block *alloc_block(Alloc *a, Pool *p, uint64_t size, uint64_t alloc_size, uint64_t stream) {
    if (a->expandable_segments) return try_allocate_expandable_block(a, p, size, stream);
    if (a->has_capacity && a->reserved + alloc_size > a->capacity) return NULL;   /* cudaErrorMemoryAllocation */
    uint64_t step = (alloc_size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
    if (step > UINT64_MAX - a->next_addr) { a->failed = 1; return NULL; }   /* addresses past 64 bits */
    Segment *seg = new_segment(a, a->next_addr, alloc_size, alloc_size, 0);
    if (seg == NULL) return NULL;
    a->next_addr += step;
    a->num_segments++;
    a->num_device_allocs++;
    add_reserved(a, alloc_size);
    return new_block(a, seg->base, alloc_size, stream, p, seg, 1);
}

static void alloc_found_block(Alloc *a, Pool *p, Block *block, uint64_t size) {
    uint64_t remaining = block->size - size;
    int split = (p->is_small || a->expandable_segments) ? remaining >= kMinBlockSize : remaining > kSmallSize;
    if (split) {
        Block *rest = new_block(a, block->addr + size, remaining, block->stream, p, block->seg, 1);
        if (rest == NULL) return;
        link_after(block, rest);
        block->size = size;
        pool_insert(a, p, rest);
    }
    block->allocated = 1;
    a->allocated += block->size;
    if (a->allocated > a->peak_allocated) a->peak_allocated = a->allocated;
}

/* ------------------------------------------------------------------ releasing cached memory */

static void release_block(Alloc *a, Block *block) {
    pool_erase(block->pool, block);
    a->num_segments--;
    a->reserved -= block->seg->size;
    drop_block(a, block);
}

static void unmap_block(Alloc *a, Block *block) {
    Segment *seg = block->seg;
    uint64_t page = seg->page;
    uint64_t offset = block->addr - seg->base;
    uint64_t begin = (offset + page - 1) / page, end = (offset + block->size) / page;
    if (begin >= end) return;
    Pool *p = block->pool;
    pool_erase(p, block);
    uint64_t start = seg->base + begin * page, unmapped = (end - begin) * page;
    uint64_t before = start - block->addr;
    if (before > 0) {
        Block *bf = new_block(a, block->addr, before, block->stream, p, seg, 1);
        if (bf == NULL) return;
        bf->prev = block->prev;
        if (bf->prev) bf->prev->next = bf;
        bf->next = block;
        block->prev = bf;
        pool_insert(a, p, bf);
    }
    uint64_t after = block->size - before - unmapped;
    if (after > 0) {
        Block *af = new_block(a, start + unmapped, after, block->stream, p, seg, 1);
        if (af == NULL) return;
        link_after(block, af);
        pool_insert(a, p, af);
    }
    block->addr = start;
    block->size = unmapped;
    block->mapped = 0;
    try_merge_blocks(a, block, block->prev, p);
    try_merge_blocks(a, block, block->next, p);
    pool_insert_unmapped(a, p, block);
    seg->mapped_bytes -= unmapped;
    if (seg->mapped_bytes == 0) a->num_segments--;
    a->reserved -= unmapped;
}

static int by_seq(const void *x, const void *y) {
    uint64_t s = (*(Block *const *)x)->seq, t = (*(Block *const *)y)->seq;
    return (s > t) - (s < t);
}

/* release_cached_blocks -> release_blocks(large), release_blocks(small), in the free blocks' insertion order */
static void release_cached_blocks(Alloc *a) {
    Pool *pools[2] = {&a->large, &a->small};
    for (int k = 0; k < 2; k++) {
        Pool *p = pools[k];
        size_t n = p->n;
        if (n == 0) continue;
        Block **snapshot = malloc(n * sizeof(Block *));
        if (snapshot == NULL) { a->failed = 1; return; }
        memcpy(snapshot, p->blocks, n * sizeof(Block *));
        qsort(snapshot, n, sizeof(Block *), by_seq);
        size_t nu = 0;
        for (size_t i = 0; i < n; i++) {
            Block *b = snapshot[i];
            if (b->seg->expandable) snapshot[nu++] = b;
            else if (b->prev == NULL && b->next == NULL) release_block(a, b);
        }
        for (size_t i = 0; i < nu; i++) unmap_block(a, snapshot[i]);
        free(snapshot);
    }
}

/* ------------------------------------------------------------------ malloc / free */

enum { OK = 0, OOM = 1, FALLBACK = 2 };

static int do_malloc(Alloc *a, uint64_t size_bytes, uint64_t stream, Block **out) {
    if (size_bytes == 0) { *out = ZERO_BLOCK; return OK; }
    a->num_alloc_calls++;
    if (size_bytes > UINT64_MAX - 2 * kRoundLarge) return FALLBACK;
    uint64_t size = round_size(size_bytes);
    if (size > UINT64_MAX - a->next_addr) return FALLBACK;   /* the reference raises LlmemError */
    Pool *p = size <= kSmallSize ? &a->small : &a->large;
    Block *block = get_free_block(p, size, stream);
    if (block == NULL) {
        uint64_t alloc_size = allocation_size(size);
        block = alloc_block(a, p, size, alloc_size, stream);
        /* release_available_cached_blocks: nothing without max_split_size */
        if (block == NULL && !a->failed) {
            release_cached_blocks(a);
            a->num_alloc_retries++;
            block = alloc_block(a, p, size, alloc_size, stream);
        }
        if (a->failed) return FALLBACK;
        if (block == NULL) { a->num_ooms++; return OOM; }
    }
    alloc_found_block(a, p, block, size);
    if (a->failed) return FALLBACK;
    *out = block;
    return OK;
}

static void do_free(Alloc *a, Block *block) {
    if (block == ZERO_BLOCK) return;
    block->allocated = 0;
    a->allocated -= block->size;
    Pool *p = block->pool;
    Block *prev = block->prev, *nxt = block->next;
    if (prev && !prev->allocated && prev->mapped) try_merge_blocks(a, block, prev, p);
    if (nxt && !nxt->allocated && nxt->mapped) try_merge_blocks(a, block, nxt, p);
    pool_insert(a, p, block);
}

static int live_slot(Alloc *a, long long key) {   /* grow the key table to hold `key` */
    if (key < 0 || key >= MAX_KEY) return 0;
    if ((size_t)key < a->live_cap) return 1;
    size_t cap = a->live_cap ? a->live_cap : 1024;
    while (cap <= (size_t)key) cap *= 2;
    Block **t = realloc(a->live, cap * sizeof(Block *));
    if (t == NULL) return 0;
    memset(t + a->live_cap, 0, (cap - a->live_cap) * sizeof(Block *));
    a->live = t; a->live_cap = cap;
    return 1;
}

/* ------------------------------------------------------------------ the Python functions */

static int read_u64(PyObject *o, uint64_t *out) {   /* a non-negative int below 2**64, else 0 (error cleared) */
    if (!PyLong_Check(o)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    *out = v;
    return 1;
}

static PyObject *stats_tuple(Alloc *a) {
    return Py_BuildValue("(KKKKKKKKK)", a->allocated, a->reserved, a->peak_allocated, a->peak_reserved,
                         a->num_segments, a->num_alloc_calls, a->num_device_allocs, a->num_alloc_retries,
                         a->num_ooms);
}

/* phase_peaks(events, starts, expandable_segments, capacity_bytes) -> (runs, oom, stats) or None.
 * starts: each phase's first event index, then len(events). runs: per phase run, (best, reserved at its end,
 * index of the best) -- best starting at the allocated bytes before the run, at index start - 1. oom: None or
 * (event index, requested bytes, allocated, reserved). stats: CachingAllocator.stats()'s fields in order. */
static PyObject *phase_peaks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *events, *starts, *capacity_obj;
    int expandable;
    if (!PyArg_ParseTuple(args, "O!O!pO", &PyList_Type, &events, &PyList_Type, &starts, &expandable, &capacity_obj))
        return NULL;
    uint64_t capacity = 0;
    int has_capacity = capacity_obj != Py_None;
    if (has_capacity && (!read_u64(capacity_obj, &capacity) || capacity == 0 || capacity > (1ULL << 60)))
        Py_RETURN_NONE;
    Alloc a;
    alloc_init(&a, expandable, has_capacity, capacity);
    Py_ssize_t nstarts = PyList_GET_SIZE(starts), nevents = PyList_GET_SIZE(events);
    PyObject *runs = PyList_New(0);
    PyObject *oom = Py_None;
    Py_INCREF(oom);
    int fallback = runs == NULL;
    for (Py_ssize_t k = 0; k + 1 < nstarts && !fallback; k++) {
        uint64_t s, e;
        if (!read_u64(PyList_GET_ITEM(starts, k), &s) || !read_u64(PyList_GET_ITEM(starts, k + 1), &e)
            || e > (uint64_t)nevents || s > e) { fallback = 1; break; }
        uint64_t best = a.allocated;
        long long best_at = (long long)s - 1;
        int ran_out = 0;
        for (uint64_t i = s; i < e; i++) {
            PyObject *ev = PyList_GET_ITEM(events, (Py_ssize_t)i);
            if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) < 4) { fallback = 1; break; }
            long long sign = PyLong_AsLongLong(PyTuple_GET_ITEM(ev, 0));
            long long key = PyLong_AsLongLong(PyTuple_GET_ITEM(ev, 1));
            if (PyErr_Occurred()) { PyErr_Clear(); fallback = 1; break; }
            if (sign > 0) {
                uint64_t size, stream;
                if (!read_u64(PyTuple_GET_ITEM(ev, 2), &size) || !read_u64(PyTuple_GET_ITEM(ev, 3), &stream)
                    || !live_slot(&a, key)) { fallback = 1; break; }
                Block *b = NULL;
                int got = do_malloc(&a, size, stream, &b);
                if (got == FALLBACK) { fallback = 1; break; }
                if (got == OOM) {
                    Py_DECREF(oom);
                    oom = Py_BuildValue("(KKKK)", (unsigned long long)i, size, a.allocated, a.reserved);
                    ran_out = 1;
                    break;
                }
                a.live[key] = b;
                if (a.allocated > best) { best = a.allocated; best_at = (long long)i; }
            } else {
                if (key < 0 || (size_t)key >= a.live_cap || a.live[key] == NULL) { fallback = 1; break; }
                do_free(&a, a.live[key]);
                a.live[key] = NULL;
                if (a.failed) { fallback = 1; break; }
            }
        }
        if (fallback || oom == NULL) break;
        PyObject *run = Py_BuildValue("(KKL)", best, a.reserved, best_at);
        if (run == NULL || PyList_Append(runs, run) < 0) { Py_XDECREF(run); fallback = 1; break; }
        Py_DECREF(run);
        if (ran_out) break;
    }
    PyObject *result = NULL;
    if (!fallback && oom != NULL && !PyErr_Occurred()) {
        PyObject *stats = stats_tuple(&a);
        if (stats != NULL) result = Py_BuildValue("(NON)", runs, oom, stats);
        runs = NULL;
    }
    alloc_free(&a);
    Py_XDECREF(runs);
    Py_XDECREF(oom);
    if (result == NULL) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return result;
}

/* components_at(events, at) -> list of dicts or None: for each event index of `at` (ascending), the tensor bytes
 * per component once events [0, index] have run, components in the order they first appear, zeros left out. */
static PyObject *components_at(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *events, *at;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &events, &PyList_Type, &at)) return NULL;
    PyObject *index = PyDict_New();           /* component -> its slot */
    PyObject *names = PyList_New(0);
    PyObject *out = PyList_New(0);
    long long *sums = NULL;
    size_t nslots = 0, cap = 0;
    int fallback = index == NULL || names == NULL || out == NULL;
    Py_ssize_t done = 0, nevents = PyList_GET_SIZE(events);
    for (Py_ssize_t w = 0; w < PyList_GET_SIZE(at) && !fallback; w++) {
        long long upto = PyLong_AsLongLong(PyList_GET_ITEM(at, w));
        if (PyErr_Occurred() || upto < done - 1 || upto >= nevents) { PyErr_Clear(); fallback = 1; break; }
        for (; done <= upto; done++) {
            PyObject *ev = PyList_GET_ITEM(events, done);
            if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) < 5) { fallback = 1; break; }
            long long sign = PyLong_AsLongLong(PyTuple_GET_ITEM(ev, 0));
            long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(ev, 2));
            if (PyErr_Occurred() || sign < -1 || sign > 1 || size < 0 || size > (1LL << 60)) {
                PyErr_Clear(); fallback = 1; break;
            }
            PyObject *comp = PyTuple_GET_ITEM(ev, 4);
            PyObject *slot = PyDict_GetItemWithError(index, comp);
            size_t k;
            if (slot == NULL) {
                if (PyErr_Occurred()) { PyErr_Clear(); fallback = 1; break; }
                if (nslots == cap) {
                    cap = cap ? 2 * cap : 16;
                    long long *t = realloc(sums, cap * sizeof(long long));
                    if (t == NULL) { fallback = 1; break; }
                    sums = t;
                }
                k = nslots++;
                sums[k] = 0;
                PyObject *kk = PyLong_FromSize_t(k);
                if (kk == NULL || PyDict_SetItem(index, comp, kk) < 0 || PyList_Append(names, comp) < 0) {
                    Py_XDECREF(kk); fallback = 1; break;
                }
                Py_DECREF(kk);
            } else {
                k = PyLong_AsSize_t(slot);
            }
            sums[k] += sign * size;
        }
        if (fallback) break;
        PyObject *d = PyDict_New();
        if (d == NULL) { fallback = 1; break; }
        for (size_t k = 0; k < nslots; k++) {
            if (sums[k] == 0) continue;
            PyObject *v = PyLong_FromLongLong(sums[k]);
            if (v == NULL || PyDict_SetItem(d, PyList_GET_ITEM(names, (Py_ssize_t)k), v) < 0) {
                Py_XDECREF(v); fallback = 1; break;
            }
            Py_DECREF(v);
        }
        if (fallback || PyList_Append(out, d) < 0) { Py_DECREF(d); fallback = 1; break; }
        Py_DECREF(d);
    }
    free(sums);
    Py_XDECREF(index);
    Py_XDECREF(names);
    if (fallback) {
        Py_XDECREF(out);
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"phase_peaks", phase_peaks, METH_VARARGS, "Per-phase peaks of a schedule's replay (llmem.memory.phase_replay)."},
    {"components_at", components_at, METH_VARARGS, "Tensor bytes per component at chosen events."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_replay", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_native_replay(void) { return PyModule_Create(&module); }
