"""vLLM's KV block pool with prefix caching, as counts: which blocks are free, and which free ones still hold a cache.

vLLM V1's ``BlockPool`` (``vllm/v1/core/block_pool.py``) keeps every block not held by a running sequence in one
free queue: never-used blocks first, then freed blocks in the order they were freed. Allocation pops from the head,
so the blocks freed longest ago are reused first, and a reused block that held a cached (hashed) full block is
evicted from the prefix cache. A sequence frees its blocks tail first (``reversed(req_blocks)``), so of what an owner
leaves cached, its last blocks are evicted first and its prefix survives longest. A prefix-cache hit on free blocks
takes them back out of the queue (``touch``).

Here a run of consecutive free blocks with the same owner is one ``FreeRun``: an owner is what the cached blocks
belong to, a request's shared prompt (``PromptGroup``) or a preempted sequence's own blocks (``Owner`` with
``cached`` full blocks). Free blocks that hold nothing anyone can hit have no owner. Counting is exact; which
block ids are which is not kept (nothing here depends on it).
"""

from __future__ import annotations

from collections import deque


class Owner:
    """Something whose full blocks the prefix cache holds: ``cached`` of them (held or free), and the run of the free
    queue they sit in while nobody holds them."""

    __slots__ = ("cached", "run")

    def __init__(self) -> None:
        self.cached = 0
        self.run: FreeRun | None = None


class FreeRun:
    """``count`` consecutive free blocks of the free queue, all cached blocks of ``owner`` (or of nobody)."""

    __slots__ = ("owner", "count")

    def __init__(self, owner: Owner | None, count: int) -> None:
        self.owner = owner
        self.count = count


class BlockPool:
    """``total`` usable blocks (the pool less its null block); ``free`` of them in the free queue."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.queue: deque[FreeRun] = deque([FreeRun(None, total)]) if total else deque()

    @property
    def used(self) -> int:
        return self.total - self.free

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the fraction of usable blocks not free."""
        return self.used / self.total if self.total else 0.0

    def take(self, count: int) -> None:
        """Allocate ``count`` blocks from the head of the free queue, evicting the cache of any that held one."""
        if count > self.free:
            raise RuntimeError(f"allocating {count} KV blocks with {self.free} free")
        self.free -= count
        queue = self.queue
        run = queue[0] if queue else None
        if run is not None and run.owner is None and run.count > count:  # the usual case, written out
            run.count -= count
            return
        while count:
            run = queue[0]
            taken = min(run.count, count)
            run.count -= taken
            count -= taken
            owner = run.owner
            if owner is not None:
                owner.cached -= taken
            if run.count == 0:
                queue.popleft()
                if owner is not None and owner.run is run:
                    owner.run = None

    def give(self, owner: Owner | None, count: int) -> None:
        """``count`` blocks freed to the tail of the queue; ``owner``'s cached blocks when given (``owner.cached``)."""
        if count <= 0:
            return
        self.free += count
        queue = self.queue
        if owner is None and queue and queue[-1].owner is None:
            queue[-1].count += count  # blocks nobody can hit: one run with the uncached ones freed just before
            return
        run = FreeRun(owner, count)
        self.queue.append(run)
        if owner is not None:
            owner.run = run

    def touch(self, owner: Owner) -> int:
        """A prefix-cache hit takes ``owner``'s free cached blocks back out of the queue; returns how many."""
        run = owner.run
        if run is None:
            return 0
        taken = run.count
        run.count = 0
        owner.run = None
        self.free -= taken
        return taken

    def evictable(self, owner: Owner) -> int:
        """How many of ``owner``'s cached blocks are in the free queue (a hit on them takes free blocks)."""
        return owner.run.count if owner.run is not None else 0
