"""The run-directory format: table names, columns and their types (the contract between all layers).

Documented for users in docs/run-format.md; keep the two in step. Stdlib only: the rank side imports this.

Conventions
- Times are int64 nanoseconds of the host's CLOCK_MONOTONIC (``time.monotonic_ns()``), shared by every process on
  one host. ``clock`` rows pair it with wall-clock time; hosts are aligned later by the analyzers.
- Sizes are bytes, rates are bytes/s, power W, temperature °C, clocks MHz, utilisation percent 0..100.
- A nullable integer is written as JSON null and read as pandas ``Int64``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1      # major: a reader refuses a newer one
SCHEMA_MINOR = 8        # minor: additions only (1: the ``meta`` table, 2: node summaries, 3: steps.cpu_wait_ns,
                        # 4: the ``evaluation`` span kind, 5: steps.detail and the ``sampling`` meta kind,
                        # 6: JSON-lines files written gzip-compressed, 7: ``sampling.block_cost_ns``, 8: the
                        # ``memory`` table, the ``memory_ledger`` and ``oom`` meta kinds, the ``health`` table and the
                        # ``numerics`` meta kind); every older minor opens
RUN_SCHEMA = f"dtprof.run/{SCHEMA_VERSION}.{SCHEMA_MINOR}"

# dtype names: "int" (int64), "Int" (nullable Int64), "float" (float64), "str" (string, categorical on read for
# low-cardinality columns listed in CATEGORICAL), "bool", "json" (any JSON value, kept as Python objects).
TABLES: dict[str, list[tuple[str, str]]] = {
    # One row per rank, written when the rank starts (rank.json holds the same plus free-form extras).
    "ranks": [
        ("rank", "int"), ("local_rank", "int"), ("world_size", "int"), ("node_rank", "Int"),
        ("host", "str"), ("pid", "int"), ("node", "str"),
        ("device_type", "str"),            # "cuda" or "cpu"
        ("device_index", "Int"), ("device_name", "str"), ("device_uuid", "str"),
        ("device_mem_total_bytes", "Int"),
        ("backend", "str"),                # "gloo", "nccl", ... ("" before init_process_group)
    ],
    # One row per rank and training step. A step runs from the end of the previous step (or the rank's first
    # forward) to the end of its optimizer step (or a dtprof.step() call).
    "steps": [
        ("rank", "int"), ("step", "int"), ("start_ns", "int"), ("end_ns", "int"),
        ("peak_mem_bytes", "Int"),        # CUDA allocator peak on GPU, process RSS high-water on CPU
        ("tokens", "Int"), ("samples", "Int"),   # from dtprof.annotate(tokens=..., samples=...)
        # FLOPs are float64 (null = unknown): a large model's step exceeds int64's 9.2e18 (1e27 still fits).
        ("model_flops", "float"),    # model FLOPs of this step on this rank, from dtprof.annotate(model_flops=...)
        ("executed_flops", "float"),  # FLOPs counted by FlopCounterMode on this step (--count-flops), else null
        # ns the training thread was runnable but waiting for a CPU during the step (Linux schedstat's run delay:
        # other processes or threads held the cores); null where the kernel does not report it
        ("cpu_wait_ns", "Int"),
        # 1: recorded in full detail; 0: only the step's boundary was recorded (sampling, docs/run-format.md);
        # null: full detail (runs before schema minor 5)
        ("detail", "Int"),
    ],
    # Compute and other intervals on a rank.
    "spans": [
        ("rank", "int"), ("step", "Int"),
        ("kind", "str"),   # SPAN_KINDS below
        ("name", "str"),   # e.g. "forward", a module or kernel name, the user's span name
        ("start_ns", "int"), ("end_ns", "int"),
        ("stage", "Int"), ("microbatch", "Int"),
        ("lane", "str"),   # "main", "cuda:<stream>", a thread name: the timeline lane
        ("source", "str"),  # "hook", "cuda_event", "kineto"
        ("launch_ns", "Int"),  # kernel spans from a trace: the CPU launch call's start (HTA's "host wait")
    ],
    # One row per collective or point-to-point operation as seen on one rank.
    "collectives": [
        ("rank", "int"), ("step", "Int"),
        ("op", "str"),       # canonical: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all,
                             # barrier, gather, scatter, send, recv
        ("api", "str"),      # what was called: "all_gather_into_tensor", "ddp_bucket", "isend", ...
        ("source", "str"),   # "user", "ddp", "fsdp", "pipeline", "functional", "kineto", "flight_recorder"
        ("group", "str"),    # process-group name (see the groups table)
        ("group_size", "int"),
        ("seq", "int"),      # per (group) call sequence on this rank for collectives; per (group, src, dst) for p2p
        ("in_bytes", "int"), ("out_bytes", "int"),   # this rank's input and output tensor bytes
        ("dtype", "str"),
        ("peer", "Int"),     # global rank of the other side for send/recv
        ("async_op", "bool"),
        ("issue_ns", "int"),     # call entered
        ("return_ns", "int"),    # call returned (== end_ns for blocking calls)
        ("end_ns", "Int"),       # completion (future callback or wait() returned); null if never seen complete
        ("gpu_duration_ns", "Int"),  # device-side duration where the backend gives it (NCCL timing, kernels)
        ("bucket", "Int"),       # DDP bucket index
        ("stage", "Int"), ("microbatch", "Int"),
    ],
    # Process groups as each rank saw them. mesh_dim names a DeviceMesh dimension ("dp", "tp", ...) if any.
    "groups": [
        ("rank", "int"), ("group", "str"), ("ranks", "str"),  # ranks: comma-separated global ranks, "0,1,2,3"
        ("size", "int"), ("backend", "str"), ("desc", "str"), ("mesh_dim", "str"),
    ],
    # GPU samples from the node's NVML sampler.
    "nvml": [
        ("host", "str"), ("node", "str"), ("gpu", "int"), ("uuid", "str"), ("t_ns", "int"),
        ("sm_util_pct", "float"), ("mem_bw_util_pct", "float"),
        ("mem_used_bytes", "float"), ("mem_total_bytes", "float"),
        ("power_w", "float"), ("temp_c", "float"),
        ("sm_clock_mhz", "float"), ("mem_clock_mhz", "float"),
        ("pcie_tx_bytes_s", "float"), ("pcie_rx_bytes_s", "float"),
        ("nvlink_tx_bytes_s", "float"), ("nvlink_rx_bytes_s", "float"),
        ("throttle_reasons", "Int"),     # NVML clocksEventReasons bitmask
        ("ecc_errors", "Int"),           # volatile uncorrected ECC errors
    ],
    # Pairs of monotonic and wall-clock readings, for aligning ranks and hosts.
    "clock": [("rank", "int"), ("host", "str"), ("mono_ns", "int"), ("wall_ns", "int")],
    # Things dtprof wants the reader to know: its own faults, missing NVML, warnings. rank -1 = the launcher.
    "events": [
        ("rank", "int"), ("host", "str"), ("t_ns", "int"),
        ("level", "str"),     # "info", "warning", "error"
        ("source", "str"),    # "rank", "nvml", "launcher", "import", ...
        ("message", "str"),
    ],
    # Structured facts about the run, one JSON object per row; ``kind`` is one of META_KINDS (docs/run-format.md).
    "meta": [("rank", "int"), ("host", "str"), ("t_ns", "int"), ("kind", "str"), ("value", "json")],
    # The memory ledger (collectors/memory.py): one row per rank and sampled step, written at its optimizer step.
    # Tensor bytes are counted from the optimizers' tensors, each storage once (a DTensor: its local shard).
    "memory": [
        ("rank", "int"), ("step", "int"), ("t_ns", "int"),
        ("params_bytes", "Int"), ("grads_bytes", "Int"), ("optimizer_state_bytes", "Int"),
        ("bwd_allocated_bytes", "Int"),   # the allocator's in-use bytes at the step's first backward's start
        ("bwd_grads_bytes", "Int"),       # grads present then
        ("allocated_bytes", "Int"),       # the allocator's in-use bytes at the optimizer step
        # CUDA only (torch.cuda.memory_stats; null on a CPU): peaks since the previous step's end
        ("forward_peak_bytes", "Int"), ("peak_bytes", "Int"), ("reserved_peak_bytes", "Int"),
        ("alloc_retries", "Int"), ("ooms", "Int"),   # cumulative counts of the caching allocator
        ("rss_peak_bytes", "Int"),        # the process's resident high-water mark (monotone)
        ("params_full_bytes", "Int"),     # the trained parameters' bytes unsharded (DTensor: global; ZeRO-3: ds_numel)
        ("optimizer_shard_frac", "float"),  # the optimizers' parameters' local elements / the parameters' full ones
        ("backward_peak_bytes", "Int"),   # CUDA: the allocator's peak at the optimizer step's start
        ("kept_unsharded_bytes", "Int"),  # FSDP2 groups not resharded after forward: their unsharded bytes
        ("kept_unsharded_max_bytes", "Int"),  # ... and the largest such group's
    ],
    # Numerics health (collectors/numerics.py): one row per rank and optimizer step, read from the device a step
    # later (never a host-device sync). Non-finite values are null in their column and named in ``nonfinite``.
    "health": [
        ("rank", "int"), ("step", "int"),
        ("loss", "float"),        # mean of the step's local losses (the scalars backward was called on, before any
                                  # cross-rank reduction); null: not read (a step recorded by its boundary only)
        ("grad_norm", "float"),   # the total norm the step's last clip_grad_norm_ returned; null: not clipped
        ("lr", "float"),          # the first optimizer param group's learning rate after the step
        ("lrs", "json"),          # every param group's learning rate, when there is more than one group
        ("nonfinite", "str"),     # the names of the step's values that were NaN or +-Inf ("loss grad_norm"), or ""
        ("param_fp", "Int"),      # fingerprint of the optimizer's parameters after the step: the int64 sum of their
                                  # bits read as integers (replicas hold equal ones); null: not taken on this step
        ("grad_norm_source", "str"),  # where grad_norm came from: "deepspeed", "clip" (the job's clip) or "dtprof"
                                      # (computed by dtprof on a step that did not clip); "" when there is none
        ("loss_scale", "float"),  # torch.amp.GradScaler's scale of the step's applied iteration; null: no scaler
        ("scaler_skips", "Int"),  # optimizer steps the GradScaler skipped (an inf/NaN gradient) within the step
    ],
}

# meta kinds and the keys of their ``value`` objects
META_KINDS = {
    "pipeline_schedule": ("schedule", "stages", "microbatches", "stage_indices"),
    "mesh": ("shape", "dims"),
    "trace_capture": ("steps", "start_ns", "end_ns"),   # monotonic ns the profiler capture disturbed the rank
    "fault": ("where", "error"),                        # dtprof disabled itself on this rank
    "step_inputs": ("samples", "tokens"),               # how steps.samples/tokens were obtained when inferred
    "dtprof_threads_cpu": ("threads", "at_step0_end", "steps"),  # at exit: CPU s of each of dtprof's threads
    "model": ("parameters", "modules"),                 # end of step 0: parameters of the root modules
    "flops_skipped": ("reason",),                       # --count-flops could not count on this rank, and why
    # step sampling on this rank (collectors/runtime.py): detailed blocks of ``block`` steps every ``period`` steps
    # from ``from_step`` (period 0: every step in detail), and what the decision was measured on
    "sampling": ("period", "block", "from_step", "calibration", "detail_cost_ns", "block_cost_ns", "step_ns", "budget",
                 "reason"),
    # the memory ledger at exit (collectors/memory.py): rows written, its own time on the training thread
    "memory_ledger": ("rows", "cost_ns", "cpu_allocator"),
    # an uncaught out-of-memory error (collectors/memory.py): the request, where, and what the rank held
    "oom": ("step", "requested_bytes", "phase", "module", "message", "type", "allocated_bytes", "reserved_bytes",
            "device_total_bytes", "device_free_bytes", "params_bytes", "grads_bytes", "optimizer_state_bytes",
            "snapshot"),
    # the parameter fingerprint's price on this rank (collectors/numerics.py): taken every ``interval`` optimizer
    # steps (a power of two) from ``from_step``; ``cost_ns`` one fingerprint of ``parameters`` elements, ``step_ns``
    # the median step, ``budget`` the share of the step it may cost; ``interval`` null with ``reason``: not taken
    "numerics": ("interval", "from_step", "cost_ns", "step_ns", "budget", "parameters", "reason"),
    # the numerics part's reads (loss, norm, lr) priced on this rank: made from ``from_step`` on the detailed steps
    # that are multiples of ``every``; ``cost_ns`` their own CPU per step, ``step_ns`` the median pricing step,
    # ``budget`` the share they may cost; ``full_detail``: --full-detail asked for every step (``every`` 1)
    "numerics_reads": ("every", "from_step", "cost_ns", "step_ns", "budget", "full_detail"),
    # a DeepSpeed engine's ZeRO config that shapes its gradient reduction, once per engine at its first step call
    # (``step``; collectors/engine_deepspeed.py); ``reduce_bucket_size`` in elements
    "deepspeed_zero": ("stage", "reduce_bucket_size", "overlap_comm", "contiguous_gradients",
                       "gradient_accumulation_steps", "step"),
}

SPAN_KINDS = (
    "forward", "backward", "optimizer",  # the training step's phases
    "data_wait",         # time in the DataLoader iterator's __next__ (collectors/runtime.py)
    "comm_wait",         # the rank is blocked on communication (a sync collective, Work.wait, DDP's final wait)
    "pp_forward", "pp_backward",  # pipeline stage work for one microbatch (stage, microbatch set)
    "user",              # dtprof.span(name)
    "kernel",            # a GPU kernel from an imported or captured trace (lane = stream)
    "flops_count",       # the step measured under FlopCounterMode (excluded from timing statistics)
    "evaluation",        # forwards of the trained model without gradients between steps (outside every step)
    "zero_bucket",       # one DeepSpeed ZeRO-1/2 gradient bucket flush (reduce_ipg_grads): its collectives and the
                         # engine's own work around them (collectors/engine_deepspeed.py)
)
COMPUTE_KINDS = ("forward", "backward", "optimizer", "pp_forward", "pp_backward")

CATEGORICAL = {"kind", "name", "lane", "source", "op", "api", "group", "dtype", "host", "node", "level"}

COLLECTIVE_OPS = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
    "barrier", "gather", "scatter", "send", "recv",
)
# point-to-point ops among them: the rest are collectives of a whole group
P2P_OPS = ("send", "recv")
# Step sampling (docs/cli-run.md, "Sampling"): the ranks record full detail in blocks of this many consecutive steps
# starting at multiples of their period; a long run's analysis reads every k-th block (analyzers/steps.py)
DETAIL_BLOCK = 4


def columns(table: str) -> list[str]:
    return [c for c, _ in TABLES[table]]


# Node summaries (run format 1.2, docs/scale.md): ``node-*/summary/<table>.parquet``, written by the node's launcher
# after compaction or by ``dtprof summarize``; computed by analyzers/nodesummary.py from that node's tables alone.
# ``summary/_complete`` (written last) is a JSON object: schema_version, schema_minor, pipeline_ranks, stage
# (pipeline rank -> stage), unassigned, n_collectives.
WORK_PARTS = ("forward", "backward", "optimizer", "data_wait", "other", "exposed_comm")   # analyzers/whatif.py
BREAKDOWN_PARTS = ("forward", "backward", "optimizer", "gpu_wait", "exposed_comm", "data_wait", "bubble",
                   "other")   # analyzers/breakdown.py PARTS, in its order
SUMMARY_TABLES: dict[str, list[tuple[str, str]]] = {
    # per rank-step: the step window, the overlap figures (analyzers/overlap.py) and the breakdown parts
    "rank_steps": [
        ("rank", "int"), ("step", "int"), ("start_ns", "int"), ("end_ns", "int"),
        # the steps table's per-step numbers (analyzers/steps.py STEP_NUMBERS; NaN: not reported)
        ("peak_mem_bytes", "float"), ("tokens", "float"), ("samples", "float"), ("model_flops", "float"),
        ("executed_flops", "float"), ("cpu_wait_s", "float"), ("detail", "float"),
        ("compute_s", "float"), ("comm_s", "float"), ("exposed_comm_s", "float"), ("comm_wait_s", "float"),
        ("overlap_ratio", "float"), ("overlap_s", "float"),
        ("level", "str"),   # "hook" or "kernel" (the rank-step has GPU kernel spans)
    ] + [(f"bd_{p}_s", "float") for p in BREAKDOWN_PARTS]
    # the what-if items' work per part (analyzers/whatif.py work_totals)
    + [(f"work_{p}_ns", "int") for p in WORK_PARTS],
    # per rank-step and channel: exposed communication (analyzers/breakdown.py)
    "exposed": [("rank", "int"), ("step", "int"), ("dim", "str"), ("op", "str"), ("issued", "str"),
                ("exposed_s", "float")],
    # the what-if model's rank-local items (analyzers/whatif.py rank_items); arrivals and waits name their
    # collective's instance (c_group, c_seq, c_sender, c_receiver) and carry its op, bytes and group size
    "whatif_items": [("rank", "int"), ("step", "int"), ("t", "int"), ("kind", "int"), ("part", "int"),
                     ("dur", "int"), ("release", "int"), ("c_group", "str"), ("c_seq", "int"), ("c_sender", "int"),
                     ("c_receiver", "int"), ("c_op", "str"), ("c_bytes", "int"), ("c_group_size", "int")],
    # per collective instance (group, sender, receiver, seq) and window step (-1: outside every step) of the
    # node's own records: analyzers/collectives.py instance_rows
    "instance_rows": [("group", "str"), ("sender", "int"), ("receiver", "int"), ("seq", "int"), ("wstep", "int"),
                      ("op", "str"), ("n", "int"), ("dur_min_ns", "int"), ("dur_sum_ns", "int"), ("bytes_max", "int"),
                      ("group_size_max", "int")],
    # per collective instance (group, seq) and part (one host on one node): the arrivals reduced
    # (analyzers/stragglers.py arrival_parts); per rank and step (-1: none), its collectives rows
    "arrival_parts": [("group", "str"), ("seq", "int"), ("host", "str"), ("node", "str"), ("n", "int"),
                      ("issue_min_ns", "int"), ("issue_dsum_ns", "int"), ("issue_max_ns", "int"), ("rank_max", "int"),
                      ("step_max", "int"), ("op_max", "str"), ("issue_2nd_ns", "int"), ("kinds", "int"),
                      ("kind", "str")],
    "arrival_counts": [("rank", "int"), ("step", "int"), ("n", "int")],
    # per rank, step (-1: none) and group: communication time and bytes (analyzers/mesh.py rank_group_comm)
    "rank_group_comm": [("rank", "int"), ("step", "int"), ("group", "str"), ("comm_ns", "int"), ("bytes", "int")],
    # per collective instance (group, seq) and host: the exits of its rows reduced for the clock fit
    # (analyzers/clock.py exit_sums; blocking 1: blocking rows, 0: asynchronous rows whose end was seen)
    "clock_exits": [("group", "str"), ("seq", "int"), ("host", "str"), ("blocking", "int"), ("n", "int"),
                    ("exit_min_ns", "int"), ("exit_dsum_ns", "int")],
}
# the summary tables' layout: a stored summary of another layout is stale (remade in memory by the analysis, and
# by `dtprof summarize`). 2: what-if work per part in rank_steps; items name their collective's instance.
# 3: per-instance reductions of the collectives (instance_rows). 4: the clock fit's exits per (instance, host)
# (clock_exits) and the arrivals per instance and part (arrival_parts, arrival_counts). 5: the communication per
# rank, step and group (rank_group_comm). 6: the steps table's per-step numbers in rank_steps (the run model's steps
# come from the summaries, not the steps table); the overlap's data wait dropped (the breakdown's is read); the
# what-if items stored step by step in row groups of 4,096 rows. 7: the
# breakdown's gpu_wait part (a GPU rank's host blocked while its GPU runs earlier work); on a GPU rank a one-rank
# group's collectives and host waits with the GPU idle are not communication (analyzers/runmodel.py device_comm);
# rank_steps carries the steps' ``detail`` (sampling). 8: communication issued outside forward/backward is exposed
# communication (the ``comm_outside_fwd_bwd`` part dropped); the exposed table says where each was issued.
# 9: the what-if items' file ordered by ITEM_LEVEL (highest first), its row groups cut where the level changes
SUMMARY_LAYOUT = 9
# the layouts read as they are: 8 holds the same tables as 9 but its items by step without ITEM_LEVEL, so a read of
# the replay's sample of steps reads row groups of ~20 steps for each sampled one (slower, the same rows)
SUMMARY_LAYOUTS_READ = (8, SUMMARY_LAYOUT)
# A column of the what-if items' file (summary layout 9) beside SUMMARY_TABLES' (not read back): each item's step's
# level, its number of trailing zero bits (step_level). The file is ordered by it, highest
# first, and a row group holds one level, so a read of steps that are all multiples of 2**k (the what-if replay's
# sample, analyzers/whatif.py replay_steps) reads only the row groups of levels >= k: at 16,384 x 1,000 the 31
# steps that are multiples of 32, not the ~20-step row groups around each of 16 evenly spaced steps.
ITEM_LEVEL = "step_level"
ITEM_LEVEL_MAX = 62   # step 0's level (every bit is zero)


def step_level(steps) -> Any:
    """Each step's level (ITEM_LEVEL): its number of trailing zero bits; ITEM_LEVEL_MAX for 0."""
    import numpy as np

    s = np.asarray(steps, np.int64)
    low = (s & -s).astype(np.float64)   # the lowest set bit: a power of two, exact in a float
    return np.where(s == 0, ITEM_LEVEL_MAX, np.log2(np.maximum(low, 1.0))).astype(np.int64)


# ---- the run directory's layout (docs/run-format.md): its files' and folders' names
RUN_MANIFEST = "run.json"
NODE_MANIFEST = "node.json"
SUMMARY_FILE = "summary.json"     # the analysis's summary (docs/summary-schema.md), writer.save_summary
NODE_PREFIX = "node-"
RANK_PREFIX = "rank-"
# events of a process that has no rank writer: it could not be recorded as a rank (collectors/identity.py) or
# dtprof failed in it before recording began (process_event); one file per process
UNIDENTIFIED_PREFIX = "unidentified-"
UNIDENTIFIED_EVENT = "unidentified process"    # how those events' messages begin
# how the events of dtprof's own faults begin (a rank or a process that dtprof switched itself off in): they are
# recorded, never printed into the job's output; the launcher names them in one line at the end
FAULT_EVENT = "dtprof disabled"
TABLES_DIR = "tables"
TABLES_COMPLETE = "_complete"

SUMMARY_DIR = "summary"          # node-*/summary/: the node summary (dtprof/rundir/schema.py SUMMARY_TABLES)
SUMMARY_COMPLETE = "_complete"   # written last: a JSON object of the summary's facts


# A JSON-lines table file: ``<stem>.jsonl.gz`` (1.6: one gzip stream, flushed to a complete deflate block every
# second, so a killed process's file reads up to its last flush), then ``<stem>.<n>.jsonl.gz`` (n = 1, 2, ...) for
# each later process that wrote the same table there (a restarted rank); ``<stem>.jsonl`` (before 1.6: plain text).
JSONL_SUFFIX = ".jsonl"
JSONL_GZ_SUFFIX = ".jsonl.gz"


def table_files(directory, stem: str) -> list[Path]:
    """The files of one JSON-lines table ``stem`` in ``directory``, in the order they were written."""
    directory = Path(directory)
    numbered = []
    for p in directory.glob(f"{stem}.*{JSONL_GZ_SUFFIX}"):
        n = p.name[len(stem) + 1:-len(JSONL_GZ_SUFFIX)]
        if n.isdigit():
            numbered.append((int(n), p))
    first = [directory / f"{stem}{JSONL_SUFFIX}", directory / f"{stem}{JSONL_GZ_SUFFIX}"]
    # a link that cannot be followed (a loop, a dangling link) is listed: reading it names the problem
    return [p for p in first if p.exists() or p.is_symlink()] + [p for _, p in sorted(numbered)]


def unidentified_files(node_dir) -> list[Path]:
    """A node's event files of processes never recorded as a rank (``unidentified-<pid>``)."""
    return sorted(p for p in Path(node_dir).glob(f"{UNIDENTIFIED_PREFIX}*")
                  if p.name.endswith((JSONL_SUFFIX, JSONL_GZ_SUFFIX)))


def new_table_file(directory, stem: str) -> Path:
    """Where a process starts writing table ``stem``: the first of its files' names not yet taken."""
    directory = Path(directory)
    path, n = directory / f"{stem}{JSONL_GZ_SUFFIX}", 0
    while path.exists():
        n += 1
        path = directory / f"{stem}.{n}{JSONL_GZ_SUFFIX}"
    return path


def summary_file(node_dir, table: str) -> Path:
    """Where a node summary's ``table`` lies."""
    return Path(node_dir) / SUMMARY_DIR / f"{table}.parquet"
