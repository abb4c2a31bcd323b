"""One vLLM V1 engine in simulated time, the reference: its scheduler, its KV blocks and its steps, one step at a time.

The scheduler is vLLM V1's (``vllm/v1/core/sched/scheduler.py``: ``Scheduler.schedule``, FCFS policy), for the
requests SkyRL sends (one per sample, ``n = 1``, no speculative decoding, no KV connector):

- **Running first**, in order: each running sequence gets what it still has to compute (the rest of its prompt, or
  one decode token), capped by the step's token budget (``max_num_batched_tokens``). Its new KV blocks come from
  the pool; when there are not enough, the last running sequence is **preempted** (its blocks freed, its computed
  tokens reset to 0, put back at the front of the waiting queue: recompute), again and again until the blocks fit
  or the sequence itself was the one preempted (then scheduling the running ones stops).
- **Then waiting**, only when nothing was preempted in this step, in order, while there is budget and fewer than
  ``max_num_seqs`` are running: a sequence whose LoRA adapter would exceed ``max_loras`` distinct adapters in the
  step is skipped (and keeps its place); otherwise its prefix-cache hit is looked up (full blocks only, never the
  last token), its first chunk is what is left of the budget (chunked prefill; without it, a prompt longer than the
  budget stops admission), and it is admitted when the pool has the blocks for its whole sequence, not only that
  chunk (``scheduler_reserve_full_isl``, vLLM's default; hits on free cached blocks count against the pool too);
  otherwise admission stops.
- **After the step**: every sequence whose computed tokens reach its length samples a token (the first one is its
  time to first token); a sequence with ``max_tokens`` outputs finishes and frees its blocks.

A chunked prompt takes all the budget the sequences before it left, so nothing is admitted after it while it is
chunked: the running order is always the decoding sequences, then at most the prompts of this step. So a step
schedules the decoding sequences first, then the prompts in order, exactly as vLLM's single pass does.

KV blocks (``kv_blocks.BlockPool``): a sequence of ``T`` computed tokens holds ``ceil(T / block_size)`` blocks. The
``num_samples`` sequences of one request share their prompt's full blocks (prefix caching: vLLM registers a block's
hash when it is allocated, so the siblings scheduled in the same step already hit the first one's blocks); the
blocks are freed when the last sibling lets go of them and stay cached until reused. A hybrid model's sequence also
holds ``state_blocks`` (one per linear-attention cache group: vLLM's ``MambaManager``), taken when it is admitted
(its admission gate counts them) and freed first when it leaves or is preempted; they hold no prefix. With prefix
caching vLLM's ``align`` mode briefly holds a second state block while a state crosses a block boundary: not
modelled.

This module is the rule: every step is scheduled as vLLM schedules it, one sequence at a time in running order
(``VllmEngine``), and priced by a ``StepPrice``. The engine a run uses takes the same decisions faster
(``fast.vllm_cohorts.CohortEngine``: decoding sequences in cohorts, runs of decode steps in closed form) and is held
to this one by ``tests/test_vllm_skipping.py`` (whole runs) and ``tests/test_vllm_model.py`` (random cases); this
one is held to vLLM's own scheduler by ``tests/real/test_vllm_scheduler_oracle.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from skyrl_sim_plugins.sim.reference.kv_blocks import BlockPool, Owner


class PromptGroup(Owner):
    """A request's prompt on one engine: the full blocks its samples can share (all but the one holding the
    prompt's last token, which a hit never covers), how many are cached, and how many sequences hold them."""

    __slots__ = ("shareable", "refs")

    def __init__(self, prompt_tokens: int, block_size: int) -> None:
        self.cached = 0  # ``Owner``'s fields, set here (a run makes one of these per request)
        self.run = None
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
        "scores_prompt",
    )

    def __init__(
        self,
        index: int,
        request: int,
        group: PromptGroup,
        prompt: int,
        max_tokens: int,
        lora: str | None,
        at: float,
        scores_prompt: bool = False,
    ) -> None:
        self.cached = 0  # ``Owner``'s fields, set here (a run makes one of these per sample)
        self.run = None
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
        self.own = 0  # blocks of its own it holds (kept while prefilling; a decoding member's follow from its length)
        self.preemptions = 0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.scores_prompt = scores_prompt  # prompt_logprobs: every prompt position's logits are computed

    @property
    def length(self) -> int:
        """Tokens of the sequence: its prompt and what it has generated (what a resumed one recomputes)."""
        return self.prompt + self.output


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
    state_blocks: int = 0
    """Blocks every running sequence holds whatever its length: one per linear-attention cache group of a hybrid
    model (``kv_specs.CacheLayout.state_blocks_per_sequence``), taken at admission, freed when it leaves."""


class StepPrice(Protocol):
    """Prices steps: one step at its variables (``vllm_step_cost.VARIABLES``), and the extra seconds of loading a
    step's adapters."""

    def seconds(self, tokens: float, prefill: float, pairs: float, seqs: float, context: float, rows: float) -> float: ...

    def lora_seconds(self, engine: int, loras: set[str]) -> float: ...


@dataclass
class EngineStats:
    """Counters vLLM exports (``/metrics``): preemptions, steps, tokens, prefix-cache hits, busy time."""

    preemptions: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    busy_s: float = 0.0


Scheduled = list[tuple[Seq, int]]
"""Sequences a step computes, in running order, each with its number of tokens."""


class VllmEngine:
    """One engine's state and its steps, one step at a time (see the module doc). ``now_s`` is when its next step
    can start; a step is decided, and committed, at its start.

    The running sequences are ``decoding`` then ``prefilling``, in running order (vLLM's ``running`` list: a chunked
    prompt takes all the budget the sequences before it left, so every prompt still under way comes after every
    decoding sequence), ``waiting`` in order. ``planned`` is always None: nothing is planned ahead (the engine a run
    uses plans runs of decode steps; the sampler reads it of either)."""

    planned = None

    def __init__(self, index: int, settings: EngineSettings, price: StepPrice) -> None:
        self.index = index
        self.settings = settings
        self.price = price
        self.pool = BlockPool(settings.usable_blocks)
        self.decoding: list[Seq] = []  # have their prompt computed and sample a token a step
        self.prefilling: list[Seq] = []  # computing their prompt (or, resumed, their prompt and what they generated)
        self.waiting: deque[Seq] = deque()
        self.loras: dict[str, int] = {}  # running sequences per adapter
        self.now_s = 0.0
        self.stats = EngineStats()
        self.finished: list[Seq] = []  # sequences finished since the owner last collected them
        self.on_step: Callable[[VllmEngine, float], None] | None = None

    # ------------------------------------------------------------------ state and time

    def busy(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    def running_count(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    def arrive(self, seqs: list[Seq], at: float) -> None:
        """``seqs`` reach the engine at ``at``: steps that started before it are committed first; they wait for the
        next step's schedule, in order."""
        self.advance(at, cut=True)
        if not self.busy():
            self.now_s = max(self.now_s, at)
        self.waiting.extend(seqs)

    def due(self, until: float) -> bool:
        """Whether ``advance(until)`` may commit anything: the engine is busy and its next step starts by ``until``."""
        return self.busy() and self.now_s <= until

    def next_event_s(self) -> float | None:
        """When the engine next acts (None when idle): the start of its next step."""
        return self.now_s if self.busy() else None

    def advance(self, until: float, cut: bool = False, joining: bool = False) -> None:
        """Take every step that starts before ``until``. A step that starts at ``until`` is taken too, unless
        ``joining`` (or ``cut``: an arrival at ``until`` is handed over next): arrivals at ``until`` are still to
        come, and an arrival at the very moment a step starts joins it."""
        joining = joining or cut
        while self.busy():
            start = self.now_s
            if start < until or (start == until and not joining):
                self.step(start)
                continue
            return

    # ------------------------------------------------------------------ one step

    def step(self, start: float) -> None:
        """One scheduler step at ``start``: the running sequences in order, then the waiting ones; priced, then its
        tokens computed and sampled."""
        budget = self.settings.max_num_batched_tokens
        decoding, preempted = self._schedule_decoding()
        budget -= len(decoding)
        chunks, stopped = self._schedule_prefilling(budget)
        preempted = preempted or stopped
        budget -= sum(n for _, n in chunks)
        if not preempted and budget > 0 and self.waiting:
            chunks += self._admit(start, budget)
        if not decoding and not chunks:
            self.now_s = start
            if not preempted and not self.prefilling and self.waiting:
                # nothing runs and the waiting head does not fit an empty cache: it never will
                self._reject_unschedulable()
            return
        end = start + self._price(decoding, chunks)
        for seq in decoding:  # each computed its last token and sampled the next
            seq.computed += 1
            seq.output += 1
        self._after_chunks(chunks, end)
        self._finish_decoded(decoding, end)
        self.now_s = end
        if self.on_step is not None:
            self.on_step(self, end)

    def _schedule_decoding(self) -> tuple[list[Seq], bool]:
        """Each decoding sequence, in order, gets one token and the block it needs for it; while the pool does not
        have it, the last running sequence is preempted (a prompt under way first), until the block fits or the
        sequence itself was preempted. Returns the scheduled ones and whether any was preempted."""
        bs = self.settings.block_size
        preempted = False
        index = 0
        while index < len(self.decoding):
            seq = self.decoding[index]
            need = -(-(seq.computed + 1) // bs) - seq.shared - seq.own  # ceil
            while self.pool.free < need:
                preempted = True
                if self._preempt_last() is seq:
                    return self.decoding[:index], True
            if need:
                self.pool.take(need)
                seq.own += need
            index += 1
        return list(self.decoding), preempted

    def _schedule_prefilling(self, budget: int) -> tuple[Scheduled, bool]:
        """The prompts under way, in order, each what it has left to compute within the budget, and their blocks
        (preempting from the end as for a decoding sequence). Returns the chunks and whether any was preempted."""
        bs = self.settings.block_size
        chunks: Scheduled = []
        preempted = False
        index = 0
        while index < len(self.prefilling) and budget > 0:
            seq = self.prefilling[index]
            n = min(seq.length - seq.computed, budget)
            need = -(-(seq.computed + n) // bs) - seq.shared - seq.own  # ceil
            while self.pool.free < need:
                preempted = True
                if self._preempt_last() is seq:
                    return chunks, True
            self._allocate(seq, need, n)
            budget -= n
            chunks.append((seq, n))
            index += 1
        return chunks, preempted

    def _admit(self, now: float, budget: int) -> Scheduled:
        """Waiting sequences, in order, while there is budget and room: one whose adapter would exceed ``max_loras``
        is skipped (and keeps its place); otherwise its prefix-cache hit is taken, its first chunk is what is left of
        the budget (without chunked prefill a longer prompt stops admission), and it is admitted when the pool has
        the blocks of its whole sequence (``scheduler_reserve_full_isl``), else admission stops."""
        s = self.settings
        bs = s.block_size
        admitted: Scheduled = []
        skipped: list[Seq] = []
        while budget > 0 and self.waiting and self.running_count() < s.max_num_seqs:
            seq = self.waiting[0]
            if self._lora_blocked(seq):
                skipped.append(self.waiting.popleft())
                continue
            hit, evictable = self._hit(seq)
            length = seq.length
            n = length - hit * bs
            if not s.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if -(-length // bs) - hit + evictable + s.state_blocks > self.pool.free:  # the whole sequence must fit
                break
            self.waiting.popleft()
            if s.state_blocks:
                self.pool.take(s.state_blocks)  # a hybrid's state blocks (mamba groups come first in vLLM's allocation)
            self._take_hit(seq, hit)
            self._allocate(seq, -(-(hit * bs + n) // bs) - hit, n)  # blocks for the hit and the first chunk
            if seq.scheduled_s is None:
                seq.scheduled_s = now
            if seq.lora is not None:
                self.loras[seq.lora] = self.loras.get(seq.lora, 0) + 1
            self.prefilling.append(seq)
            admitted.append((seq, n))
            budget -= n
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        return admitted

    def _price(self, decoding: list[Seq], chunks: Scheduled) -> float:
        """The step's seconds (and its counters): its variables are the prefill tokens and (query, key) pairs, the
        decoding sequences and the KV context they read, and the rows whose logits are computed (those that sample,
        and with prompt_logprobs every scheduled prompt position: vLLM computes the logits of each, the last
        samples)."""
        decode = len(decoding)
        context = sum(seq.length for seq in decoding)
        prefill = 0
        pairs = 0.0  # whole numbers: exact in any order
        sampled = decode
        scored = 0
        for seq, n in chunks:
            computed = seq.computed
            prefill += n
            pairs += n * computed + n * (n + 1) / 2
            last = computed + n >= seq.length
            if last:
                sampled += 1
            if seq.scores_prompt and computed < seq.prompt:
                scored += max(0, min(n, seq.prompt - computed)) - last
        seconds = self.price.seconds(decode + prefill, prefill, pairs, decode, float(context), sampled + scored)
        if self.loras:
            seconds += self.price.lora_seconds(self.index, set(self.loras))
        stats = self.stats
        stats.steps += 1
        stats.busy_s += seconds
        stats.prompt_tokens += prefill
        stats.generation_tokens += sampled
        return seconds

    # ------------------------------------------------------------------ blocks

    def _lora_blocked(self, seq: Seq) -> bool:
        limit = self.settings.max_loras
        return limit is not None and seq.lora is not None and len(self.loras) >= limit and seq.lora not in self.loras

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
        return hit, evictable

    def _take_hit(self, seq: Seq, hit: int) -> None:
        """An admitted sequence takes its hit: its prompt's cached blocks (held with the group's other holders), then
        its own cached blocks; own cached blocks it cannot reach any more stay in the free queue, unowned."""
        group = seq.group
        shared = min(hit, group.cached)
        if shared:
            if group.refs == 0:
                self.pool.touch(group)
            group.refs += 1
        own = hit - shared
        if own:
            self.pool.touch(seq)
        elif seq.cached:
            seq.cached = 0
            if seq.run is not None:
                seq.run.owner = None
                seq.run = None
        seq.shared = shared
        seq.own = own
        seq.computed = hit * self.settings.block_size
        if hit:
            self.stats.prefix_hit_tokens += seq.computed

    def _allocate(self, seq: Seq, blocks: int, tokens: int) -> None:
        """A prompt's new blocks for ``tokens`` more computed tokens; the full prompt blocks it fills become its
        prompt's shared blocks (their hashes are registered as they are allocated) when it holds all of those
        cached so far."""
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

    def _release(self, seq: Seq, keep_cache: bool) -> None:
        """Free ``seq``'s blocks, tail first: its partial block, its own full blocks (still cached for its own
        resumption when ``keep_cache``), then its prompt's shared blocks when it was the last holder; a hybrid's state
        blocks first (they hold no prefix)."""
        self.pool.give(None, self.settings.state_blocks)
        own = seq.own
        full = max(0, min(own, seq.computed // self.settings.block_size - seq.shared))
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

    # ------------------------------------------------------------------ after a step, and leaving

    def _after_chunks(self, chunks: Scheduled, end: float) -> None:
        """The prompts' computed tokens; a complete one samples its first token (or its next, for a resumed
        sequence) and starts decoding, or finishes."""
        done: list[Seq] = []
        for seq, n in chunks:
            seq.computed += n
            if seq.computed < seq.length:
                continue
            seq.output += 1
            if seq.first_token_s is None:
                seq.first_token_s = end
            done.append(seq)
        if not done:
            return
        complete = set(map(id, done))
        self.prefilling = [seq for seq in self.prefilling if id(seq) not in complete]
        for seq in done:
            if seq.output >= seq.max_tokens:
                self._release(seq, keep_cache=False)
                self._leave(seq, end)
            else:
                self.decoding.append(seq)

    def _finish_decoded(self, decoding: list[Seq], end: float) -> None:
        """Decoding sequences whose last token this step generated finish, in running order: their blocks are
        freed."""
        finished = [seq for seq in decoding if seq.output >= seq.max_tokens]
        if not finished:
            return
        self.decoding = [seq for seq in self.decoding if seq.output < seq.max_tokens]
        for seq in finished:
            self._release(seq, keep_cache=False)
            self._leave(seq, end)

    def _leave(self, seq: Seq, end: float) -> None:
        if seq.lora is not None:
            self._drop_lora(seq.lora)
        seq.finished_s = end
        self.finished.append(seq)

    def _drop_lora(self, lora: str) -> None:
        left = self.loras[lora] - 1
        if left:
            self.loras[lora] = left
        else:
            del self.loras[lora]

    def _preempt_last(self) -> Seq:
        """vLLM's recompute preemption of the last running sequence: its blocks are freed, its computed tokens reset,
        and it goes back to the front of the waiting queue (what it generated is kept and recomputed)."""
        seq = self.prefilling.pop() if self.prefilling else self.decoding.pop()
        self._release(seq, keep_cache=True)
        if seq.lora is not None:
            self._drop_lora(seq.lora)
        seq.computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def _reject_unschedulable(self) -> None:
        """A waiting head that cannot be admitted with nothing running never will be: it leaves with no output (the
        sampler refuses such prompts before they arrive; this keeps the engine from spinning)."""
        seq = self.waiting.popleft()
        seq.finished_s = None
        self.finished.append(seq)
