"""One vLLM V1 engine in simulated time, fast: the reference's decisions (``reference.vllm_scheduler``), taken with
decoding sequences in cohorts and runs of decode steps planned at once.

The decoding sequences are kept as **cohorts** (sequences that became decoding in one step with the same length and
budget advance in lockstep) over one step counter, so a decode step costs the same whatever their number: the tokens
it schedules, the KV context it reads and the blocks it needs (members per block phase) are running sums. A run of
steps where every running sequence decodes, nothing can be admitted, nothing finishes and every block is there is
planned at once (``PlannedSteps``): its step times are summed in closed form (``vllm_step_program.DecodeRun``), and
the most steps whose blocks fit are found from the block phases. Only steps with a prompt, an admission or a
preemption are stepped one by one. An arrival cuts such a plan at the first step that starts after it.

Every decision is the reference's: the scheduler's order, its preemptions, its admissions and its block pool are
those of ``reference.vllm_scheduler.VllmEngine`` (whose module doc states the rule), and a run gives every sequence
the reference's steps, counters and times to float rounding (the closed form sums a run's step times in another
order): ``tests/test_vllm_skipping.py`` holds whole runs, ``tests/test_vllm_model.py`` random cases, step by step.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable
from itertools import accumulate
from typing import Protocol

from skyrl_sim_plugins.sim.fast.vllm_step_program import DecodeRun
from skyrl_sim_plugins.sim.reference.kv_blocks import BlockPool
from skyrl_sim_plugins.sim.reference.vllm_scheduler import EngineSettings, EngineStats, Seq, StepPrice


class Cohort:
    """Decoding sequences that advance in lockstep: at step counter ``epoch`` they had ``tokens0`` tokens
    (``tokens0 - 1`` computed) and ``left0`` still to generate; ``phase`` is the step counter modulo the block size
    at which they need a new block."""

    __slots__ = ("members", "tokens0", "left0", "epoch", "phase", "alive")

    def __init__(self, members: list[Seq], tokens: int, left: int, epoch: int, block_size: int) -> None:
        self.members = members
        self.tokens0 = tokens
        self.left0 = left
        self.epoch = epoch
        self.phase = (epoch + 1 - tokens) % block_size
        self.alive = True

    def tokens(self, epoch: int) -> int:
        return self.tokens0 + epoch - self.epoch

    @property
    def finish_epoch(self) -> int:
        return self.epoch + self.left0


class DecodePrice(StepPrice, Protocol):
    """Prices steps (``vllm_step_program.StepPrices``): one step at its variables and the extra seconds of loading
    a step's adapters (``StepPrice``), and a run of decode steps in closed form."""

    def decode(self, seqs: int, context: float) -> DecodeRun: ...


class PlannedSteps:
    """Planned steps from ``start_s``: one detailed step (decided, and committed, at its start), or ``steps`` decode
    steps whose times ``run`` gives; ``end_s`` is when the last planned step ends (a detailed step: its start, when
    it is decided)."""

    __slots__ = ("start_s", "detailed", "steps", "run", "end_s")

    def __init__(self, start_s: float, detailed: bool, steps: int = 1, run: DecodeRun | None = None) -> None:
        self.start_s = start_s
        self.detailed = detailed
        self.steps = steps
        self.run = run
        self.end_s = start_s if run is None else start_s + run.elapsed(steps)

    def started_before(self, at: float) -> int:
        """How many of the planned steps start before ``at`` (step ``j`` starts ``run.elapsed(j)`` after the first)."""
        assert self.run is not None
        if self.start_s >= at:
            return 0
        lo, hi = 0, self.steps - 1  # the last step that starts before ``at``: step 0 does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.start_s + self.run.elapsed(mid) < at:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1


class CohortEngine:
    """One engine's state and its steps (see the module doc): the reference engine's decisions
    (``reference.vllm_scheduler.VllmEngine``), with decoding sequences in cohorts and runs of decode steps planned
    at once. ``now_s`` is when its next step can start."""

    def __init__(self, index: int, settings: EngineSettings, price: DecodePrice) -> None:
        self.index = index
        self.settings = settings
        self.price = price
        self.pool = BlockPool(settings.usable_blocks)
        self.cohorts: dict[int, Cohort] = {}  # decoding, in running order
        self.prefilling: list[Seq] = []  # computing their prompt, after every decoding one in running order
        self.waiting: deque[Seq] = deque()
        self.epoch = 0  # decode steps taken: every decoding sequence advances one token a step
        self.decoding = 0  # decoding sequences
        self.context0 = 0  # sum over decoding sequences of (tokens0 - epoch): their tokens now are this + decoding x epoch
        self.phases = [0] * settings.block_size  # decoding sequences per block phase
        self.finishes: list[tuple[int, int, Cohort]] = []  # (finish epoch, order, cohort), lazily cleaned
        self.loras: dict[str, int] = {}  # running sequences per adapter
        self._cohort_ids = 0
        self.planned: PlannedSteps | None = None
        self.now_s = 0.0
        self.stats = EngineStats()
        self.finished: list[Seq] = []  # sequences finished since the owner last collected them
        self.on_step: Callable[[CohortEngine, float], None] | None = None

    # ------------------------------------------------------------------ state

    def busy(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    def running_count(self) -> int:
        return self.decoding + len(self.prefilling)

    def arrive(self, seqs: list[Seq], at: float) -> None:
        """``seqs`` reach the engine at ``at``: steps that started before it are committed first; they wait for the
        next step's schedule, in order."""
        self.advance(at, cut=True)
        if not self.busy():
            self.now_s = max(self.now_s, at)
        self.waiting.extend(seqs)
        self.planned = None

    def due(self, until: float) -> bool:
        """Whether ``advance(until)`` would commit or plan anything: the engine is busy and its planned steps are
        not decided yet, or end by ``until`` (a detailed step ends, for this purpose, at its start)."""
        if not (self.decoding or self.prefilling or self.waiting):
            return False
        planned = self.planned
        return planned is None or planned.end_s <= until

    def next_event_s(self) -> float | None:
        """When the engine next acts (None when idle): the end of its planned decode steps, or the start of its next
        detailed step (decided and committed at its start)."""
        if not self.busy():
            return None
        if self.planned is None:
            self.planned = self._plan()
        return self.planned.end_s

    def advance(self, until: float, cut: bool = False, joining: bool = False) -> None:
        """Commit every planned step that ends by ``until``; with ``cut`` also the steps under way at ``until`` (a
        new arrival joins at the next step boundary). A step that starts at ``until`` is decided then, unless
        ``joining`` (or ``cut``): arrivals at ``until`` are still to come, and an arrival at the very moment a step
        starts joins it."""
        joining = joining or cut
        while self.decoding or self.prefilling or self.waiting:
            planned = self.planned
            if planned is None:
                if cut and self.now_s > until:
                    # the next step starts after ``until``: nothing more is committed, and the arrival replans
                    return
                planned = self.planned = self._plan()
            if planned.detailed:
                # a detailed step is decided (and committed) at its start; an arrival at that very moment joins it
                start = planned.start_s
                if start < until or (start == until and not joining):
                    self.planned = None
                    self._detailed_step(start)
                    continue
                return
            if planned.end_s <= until:
                self.planned = None
                self._decode_steps(planned, planned.steps)
                continue
            if cut and planned.start_s < until:
                self.planned = None
                self._decode_steps(planned, planned.started_before(until))
                continue
            return

    # ------------------------------------------------------------------ decoding cohorts

    def _add_cohort(self, members: list[Seq], tokens: int, left: int) -> None:
        cohort = Cohort(members, tokens, left, self.epoch, self.settings.block_size)
        self._cohort_ids += 1
        self.cohorts[self._cohort_ids] = cohort
        count = len(members)
        self.decoding += count
        self.context0 += count * (tokens - self.epoch)
        self.phases[cohort.phase] += count
        heapq.heappush(self.finishes, (cohort.finish_epoch, self._cohort_ids, cohort))

    def _drop_member(self, cohort: Cohort, index: int) -> Seq:
        """Take one member out of a decoding cohort (a preemption), keeping the running sums."""
        seq = cohort.members.pop(index)
        self.decoding -= 1
        self.context0 -= cohort.tokens0 - cohort.epoch
        self.phases[cohort.phase] -= 1
        if not cohort.members:
            cohort.alive = False
        return seq

    def _blocks_for(self, steps: int) -> int:
        """Blocks the next ``steps`` decode steps need: the members whose block phase comes up, at each step."""
        bs = self.settings.block_size
        full, rest = divmod(steps, bs)
        start = self.epoch % bs
        phases = self.phases
        stop = start + rest
        partial = sum(phases[start:stop]) + (sum(phases[: stop - bs]) if stop > bs else 0)
        return full * self.decoding + partial

    def _most_steps(self, free: int) -> int:
        """The most decode steps whose blocks fit in ``free`` (every decoding member holds its blocks till then)."""
        if not self.decoding:
            return 0
        full, left = divmod(free, self.decoding)
        start = self.epoch % self.settings.block_size
        phases = self.phases
        prefix = list(accumulate(phases[start:] + phases[:start], initial=0))
        # the largest k < bs with prefix[k] <= left (prefix[bs] is every member, more than ``left``)
        return full * len(phases) + bisect.bisect_right(prefix, left) - 1

    def _next_finish_epoch(self) -> int | None:
        finishes = self.finishes
        while finishes and not finishes[0][2].alive:
            heapq.heappop(finishes)
        return finishes[0][0] if finishes else None

    # ------------------------------------------------------------------ planning

    def _plan(self) -> PlannedSteps:
        """The next steps from ``now_s``: a run of decode steps when only decoding sequences run and nothing can be
        admitted, else one detailed step."""
        decoding = self.decoding
        if self.prefilling or not decoding:
            return PlannedSteps(self.now_s, True)
        s = self.settings
        free = self.pool.free
        epoch = self.epoch
        first_step = self.phases[epoch % s.block_size]
        if first_step > free:
            return PlannedSteps(self.now_s, True)
        if self.waiting and self._can_admit(free - first_step, s.max_num_batched_tokens - decoding):
            return PlannedSteps(self.now_s, True)
        finish = self._next_finish_epoch()
        assert finish is not None
        steps = finish - epoch
        # in ``steps`` steps a member needs at most one block per ``block_size`` steps: when that fits, so do they
        if -(-steps // s.block_size) * decoding > free:
            steps = min(steps, self._most_steps(free))
        run = self.price.decode(decoding, float(self.context0 + decoding * epoch))
        return PlannedSteps(self.now_s, False, steps, run)

    def _lora_blocked(self, seq: Seq) -> bool:
        limit = self.settings.max_loras
        return limit is not None and seq.lora is not None and len(self.loras) >= limit and seq.lora not in self.loras

    def _can_admit(self, free: int, budget: int) -> bool:
        """Whether the schedule would admit a waiting sequence now (given the blocks and budget the running ones left):
        the first one whose adapter fits is the one that is tried."""
        s = self.settings
        if budget <= 0 or self.decoding + len(self.prefilling) >= s.max_num_seqs:
            return False
        bs = s.block_size
        for seq in self.waiting:
            if self._lora_blocked(seq):
                continue
            hit_blocks, evictable = self._hit(seq)
            length = seq.prompt + seq.output
            if not s.enable_chunked_prefill and length - hit_blocks * bs > budget:
                return False
            # vLLM's admission gate (``scheduler_reserve_full_isl``, on by default): the whole sequence must fit
            return -(-length // bs) - hit_blocks + evictable + s.state_blocks <= free
        return False

    def _hit(self, seq: Seq) -> tuple[int, int]:
        """A waiting sequence's prefix-cache hit in blocks (its prompt's shared blocks, then, when all of those are
        cached, its own blocks from before a preemption; never the block of its last token), and how many of them
        sit in the free queue."""
        if not self.settings.enable_prefix_caching:
            return 0, 0
        group = seq.group
        hit = group.cached
        run = group.run
        evictable = run.count if run is not None and group.refs == 0 else 0  # ``BlockPool.evictable``
        if hit == group.shareable and seq.cached:
            hit += seq.cached
            run = seq.run
            if run is not None:
                evictable += run.count
        return hit, evictable

    # ------------------------------------------------------------------ steps

    def _decode_steps(self, planned: PlannedSteps, steps: int) -> None:
        """``steps`` decode steps of a plan: every decoding sequence one token a step, the blocks crossed taken."""
        assert planned.run is not None
        blocks = self._blocks_for(steps)
        if blocks:
            self.pool.take(blocks)
        self.epoch += steps
        end = planned.end_s if steps == planned.steps else planned.start_s + planned.run.elapsed(steps)
        self.stats.steps += steps
        self.stats.generation_tokens += steps * self.decoding
        self.stats.busy_s += end - planned.start_s
        if self.loras:
            # each step uses its adapters (the least recently used one is the first evicted): the plan's are the
            # ones the step before it loaded, so this only refreshes their place (it costs nothing)
            self.price.lora_seconds(self.index, set(self.loras))
        self.now_s = end
        self._finish_decoded(end)
        if self.on_step is not None:
            self.on_step(self, end)

    def _detailed_step(self, start: float) -> None:
        s = self.settings
        bs = s.block_size
        budget = s.max_num_batched_tokens
        pool = self.pool
        phases = self.phases
        preempted = False
        # the decoding sequences: one token each; preempt from the end while their new blocks do not fit
        while self.decoding and pool.free < phases[self.epoch % bs]:
            self._preempt_last()
            preempted = True
        decode = self.decoding
        context = self.context0 + decode * self.epoch
        crossing = phases[self.epoch % bs]
        if crossing:
            pool.take(crossing)
        budget -= decode
        # the prompts under way, in order (at most one is chunked, and it is the last)
        chunks: list[tuple[Seq, int]] = []
        index = 0
        while index < len(self.prefilling) and budget > 0:
            seq = self.prefilling[index]
            n = min(seq.prompt + seq.output - seq.computed, budget)
            need = -(-(seq.computed + n) // bs) - seq.shared - seq.own  # ceil
            gone = False
            while pool.free < need:
                victim = self._preempt_last()
                preempted = True
                if victim is seq:
                    gone = True
                    break
            if gone:
                break
            self._allocate(seq, need, n)
            budget -= n
            chunks.append((seq, n))
            index += 1
        if not preempted and budget > 0 and self.waiting:
            chunks += self._admit(start, budget)
        if not decode and not chunks:
            self.now_s = start
            if not preempted and not self.prefilling and self.waiting:
                # nothing runs and the waiting head does not fit an empty cache: it never will
                self._reject_unschedulable()
            return
        # the step's variables: prefill tokens and (query, key) pairs, the rows that sample a token, and the prompt
        # positions whose logits are computed (prompt_logprobs: vLLM computes the logits of each scheduled prompt
        # token, not only the last; the last samples)
        prefill = 0
        pairs = 0.0  # whole numbers: exact in any order
        sampled = decode
        scored = 0
        for seq, n in chunks:
            computed = seq.computed
            prefill += n
            pairs += n * computed + n * (n + 1) / 2
            last = computed + n >= seq.prompt + seq.output
            if last:
                sampled += 1
            if seq.scores_prompt and computed < seq.prompt:
                scored += max(0, min(n, seq.prompt - computed)) - last
        rows = sampled + scored
        seconds = self.price.seconds(decode + prefill, prefill, pairs, decode, float(context), rows)
        if self.loras:
            seconds += self.price.lora_seconds(self.index, set(self.loras))
        end = start + seconds
        stats = self.stats
        stats.steps += 1
        stats.busy_s += seconds
        stats.prompt_tokens += prefill
        stats.generation_tokens += sampled
        if decode:
            self.epoch += 1
        self._after_chunks(chunks, end)
        self.now_s = end
        self._finish_decoded(end)
        if self.on_step is not None:
            self.on_step(self, end)

    def _allocate(self, seq: Seq, blocks: int, tokens: int) -> None:
        """A prefilling sequence's new blocks for ``tokens`` more computed tokens; the full prompt blocks it fills
        become its prompt's shared blocks (their hashes are registered as they are allocated)."""
        if blocks:
            self.pool.take(blocks)
        seq.own += blocks
        group = seq.group
        cached = group.cached
        if seq.shared == cached and self.settings.enable_prefix_caching:
            filled = min(group.shareable, (seq.computed + tokens) // self.settings.block_size)
            if filled > cached:
                gained = filled - cached
                if seq.shared == 0:
                    group.refs += 1
                group.cached = filled
                seq.shared += gained
                seq.own -= gained

    def _admit(self, now: float, budget: int) -> list[tuple[Seq, int]]:
        s = self.settings
        bs = s.block_size
        admitted: list[tuple[Seq, int]] = []
        skipped: list[Seq] = []
        count = self.decoding + len(self.prefilling)
        waiting = self.waiting
        max_num_seqs = s.max_num_seqs
        chunked = s.enable_chunked_prefill
        caching = s.enable_prefix_caching
        max_loras = s.max_loras
        loras = self.loras
        pool = self.pool
        take = pool.take
        prefilling = self.prefilling
        stats = self.stats
        state = s.state_blocks
        while budget > 0 and waiting and count < max_num_seqs:
            seq = waiting[0]
            lora = seq.lora
            if max_loras is not None and lora is not None and len(loras) >= max_loras and lora not in loras:
                skipped.append(waiting.popleft())  # its adapter would exceed ``max_loras`` in this step
                continue
            group = seq.group
            # ``_hit(seq)``, written out (this runs for every sequence admitted)
            if caching:
                hit = group.cached
                run = group.run
                evictable = run.count if run is not None and group.refs == 0 else 0
                if hit == group.shareable and seq.cached:
                    hit += seq.cached
                    run = seq.run
                    if run is not None:
                        evictable += run.count
            else:
                hit = evictable = 0
            length = seq.prompt + seq.output
            n = length - hit * bs
            if not chunked and n > budget:
                break
            if n > budget:
                n = budget
            need = -(-(hit * bs + n) // bs) - hit  # ceil: blocks for the hit and the first chunk
            # vLLM's admission gate (``scheduler_reserve_full_isl``, on by default): the whole sequence must fit,
            # not only its first chunk
            if -(-length // bs) - hit + evictable + state > pool.free:
                break
            waiting.popleft()
            if state:
                take(state)  # a hybrid's per-sequence state blocks (``reference.vllm_scheduler``)
            group_hit = min(hit, group.cached)
            if group_hit:
                if group.refs == 0:
                    pool.touch(group)
                group.refs += 1
            own_hit = hit - group_hit
            if own_hit:
                pool.touch(seq)
            elif seq.cached:
                seq.cached = 0  # its blocks stay in the queue unowned: a hit can no longer reach them
                if seq.run is not None:
                    seq.run.owner = None
                    seq.run = None
            computed = hit * bs
            seq.computed = computed
            if hit:
                stats.prefix_hit_tokens += computed
            # ``_allocate(seq, need, n)``, written out
            if need:
                take(need)
            own = own_hit + need
            if caching and group_hit == group.cached:
                filled = min(group.shareable, (computed + n) // bs)
                if filled > group_hit:
                    gained = filled - group_hit
                    if group_hit == 0:
                        group.refs += 1
                    group.cached = filled
                    group_hit += gained
                    own -= gained
            seq.shared = group_hit
            seq.own = own
            if seq.scheduled_s is None:
                seq.scheduled_s = now
            if lora is not None:
                loras[lora] = loras.get(lora, 0) + 1
            prefilling.append(seq)
            admitted.append((seq, n))
            budget -= n
            count += 1
        if skipped:
            waiting.extendleft(reversed(skipped))
        return admitted

    def _after_chunks(self, chunks: list[tuple[Seq, int]], end: float) -> None:
        """The prompts' computed tokens; a complete one samples its first token (or its next, for a resumed
        sequence) and starts decoding (those of one step in the same state become one cohort), or finishes."""
        done: list[Seq] = []
        for seq, n in chunks:
            computed = seq.computed + n
            seq.computed = computed
            if computed < seq.prompt + seq.output:
                continue
            seq.output += 1
            if seq.first_token_s is None:
                seq.first_token_s = end
            done.append(seq)
        if not done:
            return
        if len(done) == len(self.prefilling):  # every prompt under way is complete (the usual step)
            self.prefilling = []
        else:
            finished = set(map(id, done))
            self.prefilling = [seq for seq in self.prefilling if id(seq) not in finished]
        run: list[Seq] = []
        tokens = left = 0  # the state of ``run``'s members
        for seq in done:
            output = seq.output
            if output >= seq.max_tokens:
                self._release(seq, seq.computed, seq.own, keep_cache=False)
                self._leave(seq, end)
                continue
            length = seq.prompt + output
            remaining = seq.max_tokens - output
            if run and (tokens != length or left != remaining):
                self._add_cohort(run, tokens, left)
                run = []
            if not run:
                tokens, left = length, remaining
            run.append(seq)
        if run:
            self._add_cohort(run, tokens, left)

    # ------------------------------------------------------------------ leaving

    def _held(self, cohort: Cohort) -> tuple[int, int]:
        """(computed tokens, own blocks less the shared ones) of a member of a decoding cohort, now; the caller
        subtracts the member's shared blocks."""
        computed = cohort.tokens(self.epoch) - 1
        return computed, math.ceil(computed / self.settings.block_size)

    def _release(self, seq: Seq, computed: int, own: int, keep_cache: bool) -> None:
        """Free ``seq``'s blocks, tail first: its partial block, its own full blocks (still cached for its own
        resumption when ``keep_cache``), then its prompt's shared blocks when it was the last holder."""
        self.pool.give(None, self.settings.state_blocks)  # a hybrid's state blocks first: they hold no prefix
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

    def _leave(self, seq: Seq, end: float) -> None:
        if seq.lora is not None:
            left = self.loras[seq.lora] - 1
            if left:
                self.loras[seq.lora] = left
            else:
                del self.loras[seq.lora]
        seq.finished_s = end
        self.finished.append(seq)

    def _preempt_last(self) -> Seq:
        """vLLM's recompute preemption of the last running sequence: its blocks are freed, its computed tokens reset,
        and it goes back to the front of the waiting queue (what it generated is kept and recomputed)."""
        if self.prefilling:
            seq = self.prefilling.pop()
            self._release(seq, seq.computed, seq.own, keep_cache=True)
        else:
            key = next(reversed(self.cohorts))
            cohort = self.cohorts[key]
            computed, blocks = self._held(cohort)
            seq = self._drop_member(cohort, len(cohort.members) - 1)
            if not cohort.members:
                del self.cohorts[key]
            seq.output = seq.max_tokens - (cohort.left0 - (self.epoch - cohort.epoch))
            self._release(seq, computed, blocks - seq.shared, keep_cache=True)
        if seq.lora is not None:
            self.loras[seq.lora] -= 1
            if not self.loras[seq.lora]:
                del self.loras[seq.lora]
        seq.computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def _finish_decoded(self, end: float) -> None:
        """Cohorts whose last token this step generated finish: their blocks are freed."""
        finishes = self.finishes
        epoch = self.epoch
        while finishes and (finishes[0][0] <= epoch or not finishes[0][2].alive):
            _, key, cohort = heapq.heappop(finishes)
            if not cohort.alive:
                continue
            computed, blocks = self._held(cohort)
            members = cohort.members
            count = len(members)
            self.decoding -= count
            self.context0 -= count * (cohort.tokens0 - cohort.epoch)
            self.phases[cohort.phase] -= count
            pool = self.pool
            state = self.settings.state_blocks
            loras = self.loras
            finished = self.finished
            for seq in members:
                seq.output = seq.max_tokens
                # ``_release(seq, computed, blocks - seq.shared, keep_cache=False)`` and ``_leave(seq, end)``
                shared = seq.shared
                pool.give(None, blocks - shared + state)
                if shared:
                    group = seq.group
                    group.refs -= 1
                    if group.refs == 0:
                        pool.give(group, group.cached)
                seq.shared = 0
                seq.own = 0
                lora = seq.lora
                if lora is not None:
                    left = loras[lora] - 1
                    if left:
                        loras[lora] = left
                    else:
                        del loras[lora]
                seq.finished_s = end
                finished.append(seq)
            cohort.alive = False
            del self.cohorts[key]

    def _reject_unschedulable(self) -> None:
        """A waiting head that cannot be admitted with nothing running never will be: it leaves with no output (the
        sampler refuses such prompts before they arrive; this keeps the engine from spinning)."""
        seq = self.waiting.popleft()
        seq.finished_s = None
        self.finished.append(seq)
