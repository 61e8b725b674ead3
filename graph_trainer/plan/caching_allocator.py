"""A simulator of PyTorch's CUDA caching allocator: the reserved bytes a sequence of allocations needs.

`torch.cuda.memory_stats()["reserved_bytes.all.peak"]` (what torchtitan logs as "memory") counts the segments
the allocator holds (each one cudaMalloc), not the live tensors. Replaying a step's ordered allocations and
frees through the allocator's rules turns our exact active peak into the reserved peak, with no constant.

What is modelled: one device, one stream, torch 2.x's default configuration (`PYTORCH_CUDA_ALLOC_CONF` unset:
no max_split_size, no roundup_power2_divisions, no garbage collection threshold, no expandable segments).
The rules, as c10/cuda/CUDACachingAllocator.cpp documents and implements them (read at pytorch/pytorch
commit 001074d2: its header comment, `malloc`, `alloc_found_block`, `free_block`, `try_merge_blocks`,
`should_split`, `get_allocation_size`, `get_free_block`, `alloc_block`, `release_available_cached_blocks`,
`release_cached_blocks`; the defaults from c10/cuda/CUDAAllocatorConfig.cpp; and the "CUDA semantics ->
Memory management" page, https://pytorch.org/docs/stable/notes/cuda.html#memory-management):
- a request is rounded up to a multiple of 512 bytes (at least 512); a 0-byte request takes no block;
- rounded requests of at most 1 MiB use the small pool, larger ones the large pool;
- a new segment (cudaMalloc) is 2 MiB for the small pool, 20 MiB for large requests under 10 MiB, and the
  request rounded up to 2 MiB for requests of 10 MiB or more;
- a request first takes the best fitting free block of its pool: the smallest that is big enough, the lowest
  address among equal sizes (the pool is ordered by size, then address);
- the block found (or the new segment) is split when the remainder may be reused: in the small pool when it
  is at least 512 bytes, in the large pool when it is over 1 MiB; the request takes the front, the remainder
  stays free in the pool. Unsplit, the request holds the whole block (its allocated bytes count all of it);
- a freed block merges with the free blocks next to it in its segment and goes back to its pool;
- segments are never returned to CUDA, except when a cudaMalloc would fail: then every cached segment that is
  wholly free is released (both pools) and the cudaMalloc is tried once more (`num_alloc_retries`); if that
  fails too, it is an out-of-memory error. (The step between, `release_available_cached_blocks`, frees only
  blocks of at least max_split_size, so it does nothing by default.)

A cudaMalloc fails here when the reserved bytes would exceed `device_bytes` (the card's memory, e.g. the
cluster table's `memory_gib`); without it, never. Segment addresses are handed out in increasing order (CUDA
does not promise that; it only decides ties between free blocks of equal size).

What is NOT modelled, so the simulated reserved peak is still a lower bound of what a real run reserves:
- other streams: FSDP2 all-gathers (and reduce-scatters) on their own streams, whose blocks come from pools
  kept per stream, so they fragment separately and are held until the stream's work is recorded done;
- memory outside the caching allocator: NCCL's buffers, the CUDA context (~0.5 GiB, which reserved does not
  count anyway), kernels' own workspaces;
- cuBLAS/cuBLASLt workspaces, which do go through the allocator (32 MiB per stream on Hopper), unless the
  event stream contains them;
- expandable segments, roundup_power2_divisions, max_split_size, garbage collection (all off by default);
- scratch a kernel allocates inside one op, unless the event stream contains it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Iterable

from graph_trainer.observability.memory import ALLOC, FREE, MemoryEvent
from graph_trainer.observability.units import MIB

MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_REQUEST = 1 * MIB  # the largest request of the small pool
SMALL_SEGMENT = 2 * MIB  # the small pool's segment
LARGE_SEGMENT = 20 * MIB  # the large pool's segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # from here a request gets a segment of its own
LARGE_ROUNDING = 2 * MIB  # ... rounded up to this


def round_request(nbytes: int) -> int:
    """The block size the allocator serves a request of `nbytes` (> 0) with, before any split decision."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """The cudaMalloc the allocator makes when no cached block fits a rounded request of `size`."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // LARGE_ROUNDING) * LARGE_ROUNDING


def _keeps_remainder(small: bool, remainder: int) -> bool:
    """Whether a free remainder this large is split off (and stays reusable) rather than handed out."""
    return remainder >= MIN_BLOCK if small else remainder > SMALL_REQUEST


@dataclasses.dataclass(eq=False)
class _Block:
    """A contiguous piece of one segment, free or allocated; blocks of a segment are linked in address order."""

    addr: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0  # the request it serves while allocated
    prev: _Block | None = None
    next: _Block | None = None

    def whole_segment(self) -> bool:
        return self.prev is None and self.next is None


class _Pool:
    """Free blocks of one pool, ordered by (size, address): the first at or after (size, 0) is the best fit."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, _Block] = {}  # address -> free block

    def add(self, block: _Block) -> None:
        bisect.insort(self._keys, (block.size, block.addr))
        self._blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self._keys[bisect.bisect_left(self._keys, (block.size, block.addr))]
        del self._blocks[block.addr]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self._keys, (size, 0))
        return self._blocks[self._keys[i][1]] if i < len(self._keys) else None

    def whole_segments(self) -> list[_Block]:
        return [b for b in self._blocks.values() if b.whole_segment()]


class OutOfMemory(Exception):
    """A request the allocator cannot serve even after releasing its cached segments."""


class CachingAllocator:
    """The allocator's state: segments, free blocks per pool, live blocks by key, and its counters.

    `device_bytes`: the memory cudaMalloc may use in all (None: unlimited).
    """

    def __init__(self, device_bytes: int | None = None) -> None:
        self.device_bytes = device_bytes
        self._pools = {True: _Pool(), False: _Pool()}  # small?, pool
        self._live: dict[Hashable, _Block | None] = {}  # key -> its block (None: a 0-byte request)
        self._next_addr = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments = 0  # cudaMalloc calls that succeeded
        self.retries = 0  # cudaMallocs retried after releasing the cached segments
        self.released = 0  # bytes of cached segments released by those retries

    def malloc(self, key: Hashable, nbytes: int) -> None:
        """Serve a request of `nbytes` under `key` (a key already live is an error). Raises `OutOfMemory`."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live")
        if nbytes == 0:
            self._live[key] = None
            return
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        block = self._pools[small].best_fit(size)
        if block is not None:
            self._pools[small].remove(block)
        else:
            block = self._new_segment(segment_bytes(size), small)
        if _keeps_remainder(small, block.size - size):
            block = self._split_front(block, size)
        block.allocated, block.requested = True, nbytes
        self._live[key] = block
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)

    def free(self, key: Hashable) -> None:
        """Free the request made under `key`: its block merges with free neighbours and goes back to its pool."""
        block = self._live.pop(key)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._merge(block, neighbour)
        self._pools[block.small].add(block)

    def _new_segment(self, size: int, small: bool) -> _Block:
        """cudaMalloc a segment; on failure release every wholly free cached segment and try once more."""
        if not self._fits(size):
            self.retries += 1
            for pool in self._pools.values():
                for block in pool.whole_segments():
                    pool.remove(block)
                    self.reserved -= block.size
                    self.released += block.size
            if not self._fits(size):
                raise OutOfMemory(f"cannot reserve a {size} B segment with {self.reserved} B reserved")
        block = _Block(self._next_addr, size, small)
        self._next_addr += size
        self.reserved += size
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _fits(self, size: int) -> bool:
        return self.device_bytes is None or self.reserved + size <= self.device_bytes

    def _split_front(self, block: _Block, size: int) -> _Block:
        """Hand out the front `size` bytes of free `block`; the rest stays free in the pool."""
        front = _Block(block.addr, size, block.small, prev=block.prev, next=block)
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size -= size
        self._pools[block.small].add(block)
        return front

    def _merge(self, block: _Block, neighbour: _Block) -> None:
        """Absorb free `neighbour` (just before or after `block` in its segment) into `block`."""
        self._pools[block.small].remove(neighbour)
        if neighbour is block.prev:
            block.addr, block.prev = neighbour.addr, neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size


@dataclasses.dataclass(frozen=True)
class AllocatorPeaks:
    """What a replay ends with: the allocator's peak figures, as `torch.cuda.memory_stats` names them."""

    reserved_bytes: int  # reserved_bytes.all.peak: segments held
    allocated_bytes: int  # allocated_bytes.all.peak: blocks handed out (rounded, unsplit remainders included)
    requested_bytes: int  # requested_bytes.all.peak: the requests as made (the live-tensor peak)
    segments: int  # cudaMalloc calls
    retries: int  # num_alloc_retries: cudaMallocs retried after releasing cached segments
    oom: bool  # the replay stopped at a request that could not be served


def replay(events: Iterable[MemoryEvent], device_bytes: int | None = None) -> AllocatorPeaks:
    """Run `events` ((ALLOC, key, nbytes) and (FREE, key, 0), in order) through a fresh allocator."""
    allocator = CachingAllocator(device_bytes)
    oom = False
    try:
        for kind, key, nbytes in events:
            if kind == ALLOC:
                allocator.malloc(key, nbytes)
            elif kind == FREE:
                allocator.free(key)
            else:
                raise ValueError(f"unknown memory event {kind!r}")
    except OutOfMemory:
        oom = True
    a = allocator
    return AllocatorPeaks(a.peak_reserved, a.peak_allocated, a.peak_requested, a.segments, a.retries, oom)


__all__ = ["AllocatorPeaks", "CachingAllocator", "OutOfMemory", "replay", "round_request", "segment_bytes"]
