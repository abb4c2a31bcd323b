"""The simulator: SkyRL's engine in simulated time, each call priced by a memory model and a time model.

**Tiers**, bottom to top; a module imports only its own tier and the ones below (``tests/test_sim_tiers.py``):

1. ``description/``: what a layer is, op by op: its blocks, linears, shapes, FLOPs, bytes and collectives, and how
   each op's cost scales with the work (``layer_ops.Scaling``); the MoE and prompt-log-prob sizes.
2. ``reference/``: the models op by op, the meaning of every number: time (``time_model``: a roofline over every op,
   no compiled form, no cache); memory (``memory_ops`` builds each segment's graph, ``memory_graph`` derives its
   allocations and frees, ``allocator`` applies them, ``device_memory`` says how the endpoint's device rounds a request
   and words its failure, ``static_memory`` what a rank holds before its first micro-batch, ``segments`` compiles a
   micro-batch's segments and orders them, ``memory_walk`` walks a call step by step); vLLM (``vllm_scheduler``
   schedules every step one at a time over the block pool of ``kv_blocks``, ``vllm_step_cost`` prices a step op by
   op).
3. ``fast/``: the fast paths, each held bit for bit to its reference by a property test: the time model's compiled
   program and width tiles (``time_program``, ``tests/test_timing_fast_path.py``; it refuses any op that is not
   affine, ``tests/test_affine_scaling.py``), the memory walk's width lanes (``memory_lanes``, ``memory_fit``,
   ``tests/test_memory_lanes.py``; their rule binds every builder of ``memory_ops``, ``tests/test_lane_rule.py``), the
   vLLM engine a run uses (``vllm_cohorts``, ``tests/test_vllm_skipping.py``) and its step program
   (``vllm_step_program``, ``tests/test_vllm_model.py``).
4. ``bound/``: the models bound to an endpoint (``timing.RooflineTimeModel``, ``memory.AllocationWalk``): a run binds
   its endpoint once (``cache.EndpointBinding``), and only this tier keeps anything between calls, every cache a
   ``cache.BoundedCache``.
5. ``service/``: the service around the trainer, built on the tiers below: tenancy (the adapter store), placement
   (``colocation``: the trainer and vLLM on one device) and inference (``inference/``: vLLM's KV budget, and the
   sampler that drives the engines).

On top, the plugin's face: ``backend`` (the executor the run driver calls), ``plugin`` (the hooks), ``options``.

**Glossary**: one noun, one meaning inside this package.

- *run*: one simulation of a scenario variant (a ``RunResult``). How many times an op runs in a pass is its *count*
  (``time_model.Listing``). The inference model's ``DecodeRun`` (a run of decode steps) and ``FreeRun`` (a run of free
  KV blocks) keep the names of the code they mirror.
- *pass*: what a call runs over each micro-batch: ``forward``, ``forward_backward`` or a forward_backward on SkyRL's
  RL path (``time_model.pass_kind``).
- *block*: a decoder layer's attention or MLP block. A *KV block* is vLLM's unit of KV cache (``service/inference``);
  the caching allocator's 512-byte unit is its *allocation unit* (``allocator.ALLOCATION_UNIT_BYTES``, PyTorch's
  ``kMinBlockSize``); ``recompute.method: block`` is megatron's setting.
- *tile*: ``WIDTH_TILE`` consecutive multiples of TP, the padded widths a fast path evaluates at once
  (``fast/width_tile.py``); a *lane* is one (width, logits width) of a tile, one int64 of a ``Lanes`` array.
- *segment*: one compiled part of a micro-batch's memory walk: the embedding, a layer kind's forward or backward, the
  LM head's forward or backward, a pipeline stage's send or receive, the held inputs, a routed-expert replay, a
  buffer's growth (``segments.Segment``). A micro-batch shape's segments are its ``ShapeSegments``; consecutive
  positions of its walk that are all body or all LM-head segments are a *stretch* (``memory_lanes.Stretch``).
- *step*: one allocation or free of a segment (``allocator.Step``); a segment's steps compiled into arrays with their
  running totals are a *step array* (``allocator.StepArray``); a graph topology's steps before sizes are its *plan*
  (``memory_graph.CompiledPlan``).
- *effect*: what a sequence of steps does to an allocator, in aggregate (``allocator.Effect``).
- *program*: a cost compiled into arrays: the time model's ``MicroBatchProgram`` (a micro-batch's cost per pass
  kind, in four *parts*: layers, LM-head forward, LM-head backward, embedding) and vLLM's ``StepProgram``.
- *cohort*: decoding sequences of one vLLM engine that advance in lockstep (``vllm_cohorts.Cohort``); the steps an
  engine has decided ahead are its *planned steps* (``vllm_cohorts.PlannedSteps``: one detailed step, or a run of
  decode steps).
- *reference*: the op-by-op model a fast path is held to; *bound model*: a model bound to one endpoint and model.
"""
