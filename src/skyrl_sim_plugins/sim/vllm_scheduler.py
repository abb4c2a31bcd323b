"""One vLLM V1 engine in simulated time: its scheduler, its KV blocks and its steps, as vLLM runs them.

The scheduler is vLLM V1's (``vllm/v1/core/sched/scheduler.py``: ``Scheduler.schedule``, FCFS policy), for the
requests SkyRL sends (one per sample, ``n = 1``, no speculative decoding, no KV connector):

- **Running first**, in order: each running sequence gets what it still has to compute (the rest of a prompt chunk,
  or one decode token), capped by the step's token budget (``max_num_batched_tokens``). Its new KV blocks come from
  the pool; when there are not enough, the last running sequence is **preempted** (its blocks freed, its computed
  tokens reset to 0, put back at the front of the waiting queue: recompute), again and again until the blocks fit
  or the sequence itself was the one preempted (then scheduling the running ones stops).
- **Then waiting**, only when nothing was preempted in this step, in order, while there is budget and fewer than
  ``max_num_seqs`` are running: a sequence whose LoRA adapter would exceed ``max_loras`` distinct adapters in the
  step is skipped (and keeps its place); otherwise its prefix-cache hit is looked up (full blocks only, never the
  last token), its first chunk is what is left of the budget (chunked prefill; without it, a prompt longer than the
  budget stops admission), and it is admitted when the pool has the blocks for that chunk (hits on free cached
  blocks count against the pool too); otherwise admission stops.
- **After the step**: every sequence whose computed tokens reach its length samples a token (the first one is its
  time to first token); a sequence with ``max_tokens`` outputs finishes and frees its blocks.

KV blocks (``kv_blocks.BlockPool``): a sequence of ``T`` computed tokens holds ``ceil(T / block_size)`` blocks. The
``num_samples`` sequences of one request share their prompt's full blocks (prefix caching: vLLM registers a block's
hash when it is allocated, so the siblings scheduled in the same step already hit the first one's blocks); the
blocks are freed when the last sibling lets go of them and stay cached until reused.

Speed: a run of steps where every running sequence decodes, nothing can be admitted and nothing finishes or needs a
block it cannot get is one **segment**: sequences admitted together advance in lockstep as one ``Cohort``, the
step at which the pool first runs short is found from each cohort's block boundaries in closed form, and all the
segment's step times are priced at once (``vllm_step_cost.StepProgram``). Only steps with prefill, admission or
preemption are stepped one by one. An arrival cuts a segment at the first step that starts after it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from skyrl_sim_plugins.sim.kv_blocks import BlockPool, Owner


class PromptGroup(Owner):
    """A request's prompt on one engine: the full blocks its samples can share (all but the one holding the
    prompt's last token, which a hit never covers), how many are cached, and how many sequences hold them."""

    __slots__ = ("shareable", "refs")

    def __init__(self, prompt_tokens: int, block_size: int) -> None:
        super().__init__()
        self.shareable = (prompt_tokens - 1) // block_size
        self.refs = 0


class Seq(Owner):
    """One vLLM request (one sample). While preempted, ``cached`` counts its own full blocks still in the cache."""

    __slots__ = (
        "index",
        "request",
        "group",
        "prompt",
        "max_tokens",
        "lora",
        "arrival_s",
        "output",
        "computed",
        "shared",
        "own",
        "preemptions",
        "scheduled_s",
        "first_token_s",
        "finished_s",
    )

    def __init__(
        self, index: int, request: int, group: PromptGroup, prompt: int, max_tokens: int, lora: str | None, at: float
    ) -> None:
        super().__init__()
        self.index = index
        self.request = request
        self.group = group
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.lora = lora
        self.arrival_s = at
        self.output = 0
        self.computed = 0
        self.shared = 0  # blocks of the group's prompt it holds
        self.own = 0  # blocks of its own it holds (while prefilling; a decoding cohort's members derive it)
        self.preemptions = 0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None

    @property
    def length(self) -> int:
        """Tokens of the sequence: its prompt and what it has generated (what a resumed one recomputes)."""
        return self.prompt + self.output


class Cohort:
    """Running sequences that advance in lockstep: all decoding with ``tokens`` tokens (``tokens - 1`` computed), and
    ``left`` still to generate, the same adapter; or one sequence still computing its prompt (``prefill``)."""

    __slots__ = ("members", "tokens", "left", "lora", "prefill")

    def __init__(self, members: list[Seq], tokens: int, left: int, lora: str | None, prefill: bool) -> None:
        self.members = members
        self.tokens = tokens
        self.left = left
        self.lora = lora
        self.prefill = prefill


@dataclass
class EngineSettings:
    """What one engine's scheduler reads of the endpoint."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    usable_blocks: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    max_loras: int | None  # None: vLLM serves no adapters


@dataclass
class StepPrice:
    """Prices steps: ``seconds(variables)`` for ``[steps, 6]`` step variables (``vllm_step_cost.VARIABLES``), and
    the extra seconds of loading adapters into the step (``lora_seconds(engine, loras)``)."""

    seconds: Callable[[np.ndarray], np.ndarray]
    lora_seconds: Callable[[int, set[str]], float] = field(default=lambda engine, loras: 0.0)


@dataclass
class Segment:
    """Planned steps from ``start_s``: their end times, and what they are (one detailed step, or decode steps)."""

    start_s: float
    ends: np.ndarray
    detailed: bool
    demand: np.ndarray | None = None  # decode: blocks needed up to and including each step


@dataclass
class EngineStats:
    """Counters vLLM exports (``/metrics``): preemptions, prompt tokens computed, prefix-cache hits."""

    preemptions: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    busy_s: float = 0.0


class VllmEngine:
    """One engine's state and its steps (see the module doc). ``now_s`` is when its next step can start."""

    def __init__(self, index: int, settings: EngineSettings, price: StepPrice) -> None:
        self.index = index
        self.settings = settings
        self.price = price
        self.pool = BlockPool(settings.usable_blocks)
        self.running: list[Cohort] = []
        self.waiting: deque[Seq] = deque()
        self.segment: Segment | None = None
        self.now_s = 0.0
        self.stats = EngineStats()
        self.finished: list[Seq] = []  # sequences finished since the owner last collected them
        self.on_step: Callable[[VllmEngine, float], None] | None = None

    # ------------------------------------------------------------------ state

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def running_count(self) -> int:
        return sum(len(c.members) for c in self.running)

    def arrive(self, seq: Seq, at: float) -> None:
        """``seq`` reaches the engine at ``at``: steps that started before it are committed first; it waits for the
        next step's schedule."""
        self.advance(at, cut=True)
        if not self.busy():
            self.now_s = max(self.now_s, at)
        self.waiting.append(seq)
        self.segment = None

    def next_event_s(self) -> float | None:
        """When the engine next acts (None when idle): the end of its planned decode steps, or the start of its next
    detailed step (decided and committed at its start)."""
        if not self.busy():
            return None
        if self.segment is None:
            self.segment = self._plan()
        return float(self.segment.ends[-1])

    def advance(self, until: float, cut: bool = False) -> None:
        """Commit every planned step that ends by ``until``; with ``cut`` also the steps under way at ``until`` (a
        new arrival joins at the next step boundary)."""
        while self.busy():
            if self.segment is None:
                self.segment = self._plan()
            segment = self.segment
            if segment.detailed:
                # a detailed step is decided (and committed) at its start; an arrival at that very moment joins it
                if segment.start_s < until or (segment.start_s == until and not cut):
                    self._commit(segment, 1)
                    continue
                return
            if segment.ends[-1] <= until:
                self._commit(segment, len(segment.ends))
                continue
            if cut and segment.start_s < until:
                # the steps that started before ``until``: the first, and each after an end before ``until``
                started = 1 + int(np.searchsorted(segment.ends[:-1], until, side="left"))
                self._commit(segment, started)
                continue
            return

    # ------------------------------------------------------------------ planning

    def _plan(self) -> Segment:
        """The next steps from ``now_s``: a decode segment when the running set only decodes and nothing can be
        admitted, else one detailed step."""
        decode = self._decode_segment()
        if decode is not None:
            return decode
        return Segment(self.now_s, np.array([self.now_s]), detailed=True)

    def _decode_segment(self) -> Segment | None:
        s = self.settings
        running = self.running
        if not running or any(c.prefill for c in running):
            return None
        counts = np.array([len(c.members) for c in running], dtype=np.int64)
        total = int(counts.sum())
        if total > s.max_num_batched_tokens:
            return None
        lefts = np.array([c.left for c in running], dtype=np.int64)
        steps = int(lefts.min())
        tokens = np.array([c.tokens for c in running], dtype=np.int64)
        bs = s.block_size
        first = (1 - tokens) % bs
        js = np.arange(steps, dtype=np.int64)
        crossings = np.clip((js[None, :] - first[:, None]) // bs + 1, 0, None)
        demand = counts @ crossings
        if self.waiting and self._can_admit(self.pool.free - int(demand[0]), s.max_num_batched_tokens - total, total):
            return None
        short = np.nonzero(demand > self.pool.free)[0]
        if len(short):
            steps = int(short[0])
            if steps == 0:
                return None
        js = js[:steps]
        context = float((counts * tokens).sum()) + total * js.astype(float)
        variables = np.zeros((steps, 6))
        variables[:, 0] = total
        variables[:, 3] = total
        variables[:, 4] = context
        variables[:, 5] = total
        seconds = self.price.seconds(variables)
        ends = self.now_s + np.cumsum(seconds)
        return Segment(self.now_s, ends, detailed=False, demand=demand[:steps])

    def _can_admit(self, free: int, budget: int, running: int) -> bool:
        """Whether the schedule would admit a waiting sequence now (given the blocks and budget the running ones left):
        the first one whose adapter fits is the one that is tried."""
        s = self.settings
        if budget <= 0 or running >= s.max_num_seqs:
            return False
        loras = {c.lora for c in self.running if c.lora is not None}
        for seq in self.waiting:
            if s.max_loras is not None and seq.lora is not None and len(loras) >= s.max_loras and seq.lora not in loras:
                continue
            hit_blocks, evictable = self._hit(seq)
            chunk = seq.length - hit_blocks * s.block_size
            if not s.enable_chunked_prefill and chunk > budget:
                return False
            chunk = min(chunk, budget)
            needed = math.ceil((hit_blocks * s.block_size + chunk) / s.block_size) - hit_blocks
            return needed + evictable <= free
        return False

    def _hit(self, seq: Seq) -> tuple[int, int]:
        """A waiting sequence's prefix-cache hit in blocks (its prompt's shared blocks, then, when all of those are
        cached, its own blocks from before a preemption; never the block of its last token), and how many of them
        sit in the free queue."""
        if not self.settings.enable_prefix_caching:
            return 0, 0
        group = seq.group
        hit = group.cached
        evictable = self.pool.evictable(group) if group.refs == 0 else 0
        if hit == group.shareable and seq.cached:
            hit += seq.cached
            evictable += self.pool.evictable(seq)
        limit = (seq.length - 1) // self.settings.block_size
        if hit > limit:  # cannot happen for what this model caches; kept as vLLM's own cap
            return limit, min(evictable, limit)
        return hit, evictable

    # ------------------------------------------------------------------ committing

    def _commit(self, segment: Segment, steps: int) -> None:
        if segment.detailed:
            self._detailed_step(segment.start_s)
        else:
            self._decode_steps(segment, steps)
        self.segment = None

    def _decode_steps(self, segment: Segment, steps: int) -> None:
        """``steps`` decode steps of the segment: every cohort one token per step, the blocks crossed taken."""
        assert segment.demand is not None
        self.pool.take(int(segment.demand[steps - 1]))
        for cohort in self.running:
            cohort.tokens += steps
            cohort.left -= steps
        end = float(segment.ends[steps - 1])
        self.stats.steps += steps
        self.stats.generation_tokens += steps * self.running_count()
        self.stats.busy_s += end - segment.start_s
        self.now_s = end
        self._finish_done(end)
        if self.on_step is not None:
            self.on_step(self, end)

    def _detailed_step(self, start: float) -> None:
        s = self.settings
        bs = s.block_size
        budget = s.max_num_batched_tokens
        running = self.running
        scheduled: list[tuple[Cohort, int]] = []  # decode cohorts: members scheduled; prefill: tokens scheduled
        preempted = False
        prefill_tokens = 0
        pairs = 0.0
        decode_seqs = 0
        context = 0.0
        rows = 0
        i = 0
        while i < len(running) and budget > 0:
            cohort = running[i]
            if not cohort.prefill:
                take = min(len(cohort.members), budget)
                if take < len(cohort.members):
                    rest = Cohort(cohort.members[take:], cohort.tokens, cohort.left, cohort.lora, False)
                    cohort.members = cohort.members[:take]
                    running.insert(i + 1, rest)
                need = take if (cohort.tokens - 1) % bs == 0 else 0
                while self.pool.free < need:
                    last = running[-1]
                    self._preempt(last.members.pop(), last)
                    preempted = True
                    if not last.members:
                        running.pop()
                    if last is cohort:
                        take -= 1
                        need -= 1
                if take == 0:
                    break
                self.pool.take(need)
                budget -= take
                decode_seqs += take
                context += take * cohort.tokens
                rows += take
                scheduled.append((cohort, take))
            else:
                seq = cohort.members[0]
                n = min(seq.length - seq.computed, budget)
                need = math.ceil((seq.computed + n) / bs) - seq.shared - seq.own
                gone = False
                while self.pool.free < need:
                    last = running[-1]
                    victim = last.members.pop()
                    self._preempt(victim, last)
                    preempted = True
                    if not last.members:
                        running.pop()
                    if victim is seq:
                        gone = True
                        break
                if gone:
                    break
                self._allocate(seq, need, n)
                budget -= n
                prefill_tokens += n
                pairs += n * seq.computed + n * (n + 1) / 2
                rows += seq.computed + n >= seq.length
                scheduled.append((cohort, n))
            i += 1
        if not preempted:
            admitted = self._admit(start, budget)
            for cohort, n in admitted:
                seq = cohort.members[0]
                budget -= n
                prefill_tokens += n
                pairs += n * seq.computed + n * (n + 1) / 2
                rows += seq.computed + n >= seq.length
            scheduled += admitted
        if not scheduled:
            self.now_s = start
            if not preempted and not self.running:
                # nothing runs and the waiting head does not fit an empty cache: it never will
                self._reject_unschedulable()
            return
        tokens = decode_seqs + prefill_tokens
        variables = np.array([[tokens, prefill_tokens, pairs, decode_seqs, context, rows]], dtype=float)
        seconds = float(self.price.seconds(variables)[0])
        loras = {c.lora for c, _ in scheduled if c.lora is not None}
        if loras:
            seconds += self.price.lora_seconds(self.index, loras)
        end = start + seconds
        self.stats.steps += 1
        self.stats.busy_s += seconds
        self.stats.prompt_tokens += prefill_tokens
        self.stats.generation_tokens += rows
        self._after_step(scheduled, end)
        self.now_s = end
        self._finish_done(end)
        self._merge_cohorts()
        if self.on_step is not None:
            self.on_step(self, end)

    def _allocate(self, seq: Seq, blocks: int, tokens: int) -> None:
        """A prefilling sequence's new blocks for ``tokens`` more computed tokens; the full prompt blocks it fills
        become its prompt's shared blocks (their hashes are registered as they are allocated)."""
        self.pool.take(blocks)
        seq.own += blocks
        group = seq.group
        if self.settings.enable_prefix_caching and seq.shared == group.cached:
            filled = min(group.shareable, (seq.computed + tokens) // self.settings.block_size)
            if filled > group.cached:
                gained = filled - group.cached
                if seq.shared == 0:
                    group.refs += 1
                group.cached = filled
                seq.shared += gained
                seq.own -= gained

    def _admit(self, now: float, budget: int) -> list[tuple[Cohort, int]]:
        s = self.settings
        bs = s.block_size
        admitted: list[tuple[Cohort, int]] = []
        skipped: list[Seq] = []
        loras = {c.lora for c in self.running if c.lora is not None}
        count = self.running_count()
        waiting = self.waiting
        while budget > 0 and waiting and count < s.max_num_seqs:
            seq = waiting[0]
            if s.max_loras is not None and seq.lora is not None and len(loras) >= s.max_loras and seq.lora not in loras:
                skipped.append(waiting.popleft())
                continue
            hit, evictable = self._hit(seq)
            n = seq.length - hit * bs
            if not s.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            need = math.ceil((hit * bs + n) / bs) - hit
            if need + evictable > self.pool.free:
                break
            waiting.popleft()
            group = seq.group
            group_hit = min(hit, group.cached)
            if group_hit:
                if group.refs == 0:
                    self.pool.touch(group)
                group.refs += 1
            own_hit = hit - group_hit
            if own_hit:
                self.pool.touch(seq)
            elif seq.cached:
                seq.cached = 0  # its blocks stay in the queue unowned: a hit can no longer reach them
                if seq.run is not None:
                    seq.run.owner = None
                    seq.run = None
            seq.shared = group_hit
            seq.own = own_hit
            seq.computed = hit * bs
            self.stats.prefix_hit_tokens += hit * bs
            self._allocate(seq, need, n)
            if seq.scheduled_s is None:
                seq.scheduled_s = now
            if seq.lora is not None:
                loras.add(seq.lora)
            cohort = Cohort([seq], seq.length, seq.max_tokens - seq.output, seq.lora, True)
            self.running.append(cohort)
            admitted.append((cohort, n))
            budget -= n
            count += 1
        waiting.extendleft(reversed(skipped))
        return admitted

    def _after_step(self, scheduled: list[tuple[Cohort, int]], end: float) -> None:
        """Advance what the step computed: decode cohorts one token; prefill chunks their tokens, and a prompt that
        is complete samples its first token (or its next, for a resumed sequence) and becomes a decode cohort."""
        for cohort, n in scheduled:
            if not cohort.prefill:
                cohort.tokens += 1
                cohort.left -= 1
                continue
            seq = cohort.members[0]
            seq.computed += n
            if seq.computed < seq.length:
                continue
            seq.output += 1
            if seq.first_token_s is None:
                seq.first_token_s = end
            cohort.prefill = False
            cohort.tokens = seq.length
            cohort.left = seq.max_tokens - seq.output

    def _merge_cohorts(self) -> None:
        """Neighbouring decode cohorts in the same state become one (sequences admitted in one step)."""
        running = self.running
        merged: list[Cohort] = []
        for cohort in running:
            last = merged[-1] if merged else None
            if (
                last is not None
                and not cohort.prefill
                and not last.prefill
                and last.tokens == cohort.tokens
                and last.left == cohort.left
                and last.lora == cohort.lora
            ):
                last.members.extend(cohort.members)
            else:
                merged.append(cohort)
        self.running = merged

    # ------------------------------------------------------------------ leaving

    def _held(self, seq: Seq, cohort: Cohort) -> tuple[int, int]:
        """(computed tokens, own blocks) of a running sequence."""
        if cohort.prefill:
            return seq.computed, seq.own
        computed = cohort.tokens - 1
        return computed, math.ceil(computed / self.settings.block_size) - seq.shared

    def _release(self, seq: Seq, cohort: Cohort, keep_cache: bool) -> int:
        """Free ``seq``'s blocks, tail first: its partial block, its own full blocks (still cached for its own
        resumption when ``keep_cache``), then its prompt's shared blocks when it was the last holder. Returns its
        computed tokens."""
        computed, own = self._held(seq, cohort)
        full = max(0, min(own, computed // self.settings.block_size - seq.shared))
        if keep_cache and self.settings.enable_prefix_caching:
            self.pool.give(None, own - full)
            seq.cached = full
            self.pool.give(seq, full)
        else:
            self.pool.give(None, own)
        group = seq.group
        if seq.shared:
            group.refs -= 1
            if group.refs == 0:
                self.pool.give(group, group.cached)
        seq.shared = 0
        seq.own = 0
        return computed

    def _preempt(self, seq: Seq, cohort: Cohort) -> None:
        """vLLM's recompute preemption: the blocks are freed, the computed tokens reset, and the sequence goes back
        to the front of the waiting queue (what it generated is kept and recomputed)."""
        if not cohort.prefill:
            seq.output = seq.max_tokens - cohort.left
        self._release(seq, cohort, keep_cache=True)
        seq.computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _finish_done(self, end: float) -> None:
        kept: list[Cohort] = []
        for cohort in self.running:
            if cohort.prefill or cohort.left > 0:
                kept.append(cohort)
                continue
            for seq in cohort.members:
                seq.output = seq.max_tokens
                self._release(seq, cohort, keep_cache=False)
                seq.finished_s = end
                self.finished.append(seq)
        self.running = kept

    def _reject_unschedulable(self) -> None:
        """A waiting head that cannot be admitted with nothing running never will be: it is dropped as finished with
        no output (the cluster rejects such prompts before they arrive; this keeps the engine from spinning)."""
        seq = self.waiting.popleft()
        seq.finished_s = None
        self.finished.append(seq)
