"""The numerics sentinel (a rank-side part, collectors/parts.py): each optimizer step's local loss, gradient norm,
learning rate and, at a priced interval, a fingerprint of the parameters, as ``health`` rows (dtprof/rundir/schema.py).

What it reads, and when (docs/metrics.md, "Numerics health"): on the steps recorded in full detail only (the
step sampling's, collectors/sampling.py, which prices what they cost; an A/B "off" block reads nothing); a
boundary-only step costs this part one call that returns at once (its clip wrapper; ``every_step`` False: its
step callbacks are not called there).
- the local loss: from the scalar tensors ``backward`` is called on (``on_backward``; the rank's own loss, before
  any cross-rank reduction): their sum, or their mean inside a torch pipelining schedule that scales its
  gradients (``step_loss``: what jobs log under gradient accumulation);
- the gradient norm: DeepSpeed's own (its optimizer wrapper's ``_global_grad_norm``, read at the torch optimizer
  step it makes: collectors/engine_deepspeed.py), else the tensor ``torch.nn.utils.clip_grad_norm_`` (or its
  alias ``clip_grad_norm``, or FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``, which all-reduces its
  shards' norms) returned or ``clip_grads_with_norm_`` was given, the last call of the step; the
  wrappers are in place on every step, pass the job's result through, and do nothing while Dynamo traces (a
  clip inside a compiled region is traced as the bare job's and not read).
  When the step has not clipped by its optimizer step, dtprof computes the norm itself (``on_optimizer_pre_step``:
  the optimizer's gradients are final there, after DDP's all-reduce): the 2-norm of the optimizer's gradients as
  ``clip_grad_norm_`` computes it (``torch._foreach_norm``, on the device, no collective), on the read steps only,
  its CPU among the reads' priced cost. Not for sharded gradients (DTensor, FSDP1's flat parameters, DeepSpeed's
  optimizer wrappers: a local shard's norm is not the total, and the cross-rank sum would be a collective); at
  DeepSpeed's ZeRO stage 0 in fp32 the engine steps the torch optimizer itself on whole gradients (normed here),
  and its own clip's total norm, which it drops, is read as a torch clip's (``patch_deepspeed``);
- the learning rate of each param group, a host-side read after the optimizer step (``on_optimizer_step``);
- a ``torch.amp.GradScaler``'s scale and whether it skipped the optimizer step (an inf/NaN gradient), read as
  device values in its ``_maybe_opt_step`` (``wrap_scaler``);
- the fingerprint: the int64 sum of every parameter's bits read as integers, computed on the parameters' device
  after the optimizer step. Data-parallel replicas hold bit-identical parameters, so their fingerprints are equal;
  one flipped bit changes it by a power of two. Its interval is priced from its measured cost: it is taken at
  step 0 and at FP_TIMED_STEPS (timed: the training thread's CPU, plus the device's time on a GPU; the cheaper
  counts, so one preempted or cold measurement does not price a rank apart from its replicas), then at the
  detailed steps that are multiples of ``interval``, the smallest power of two that keeps it under FP_BUDGET of
  the median pricing step (ranks that priced or sampled differently still share the steps of the largest
  interval and period: both are powers of two, and detailed blocks start at multiples of the period).

No host-device sync: device values are copied ``non_blocking`` into a ring of host buffers (pinned on CUDA) with
an event recorded after the copies, and read at a later detailed step's end once the event has completed (a
detailed block's last step: at the next block's first, or at exit; on CPU the copy is done when it returns, and the
value is still read a step later: one code path). A step whose slot is still in
flight RING steps later is recorded without its device values. The cross-rank comparisons (which rank went
non-finite first, which replica's fingerprint differs) are the analysis' (analyzers/health.py), never a
collective on the training thread.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from types import FrameType
from typing import Any

from dtprof.collectors.engine_deepspeed import called_from_deepspeed as _called_from_deepspeed
from dtprof.collectors.engine_deepspeed import engine_steps_optimizer as _deepspeed_engine_steps
from dtprof.collectors.engine_deepspeed import global_grad_norm as _deepspeed_norm
from dtprof.collectors.numerics_wraps import install_wraps
from dtprof.collectors.parts import RankContext, RankPart
from dtprof.collectors.records import Health

RING = 16                 # steps whose device values may be in flight at once
# the share of a step the parameter fingerprint may cost: a quarter of the 1 % dtprof may cost (the detail's
# sampling keeps the rest of a detailed step's cost, this part's loss/norm/lr reads among it, under half of it)
FP_BUDGET = 0.0025
# steps FP_PRICE_FROM.. (FP_PRICE_STEPS of them) price the fingerprint: past step 0's first calls and step 1's
# FLOP count (dtprof counts step 1's FLOPs under FlopCounterMode, which every op of the step goes through)
FP_PRICE_FROM = 2
FP_PRICE_STEPS = 8
FP_TIMED_STEPS = (4, 8)   # the steps whose fingerprints are timed (one is also taken at step 0)
FP_MAX_INTERVAL = 1024
# the share of a step this part's reads (loss, norm, lr: its callbacks' own CPU, measured on the pricing steps) may
# cost: over it, they are made on every ``read_every``-th detailed step only (a power of two; not with --full-detail)
READ_BUDGET = 0.0025
READ_MAX_EVERY = 1024
PIPELINE_FRAMES = 24      # on_backward's callers up to a torch pipelining schedule's _step_microbatches
FRAMES = 16               # on_optimizer_step's callers up to DeepSpeed's optimizer wrapper's step
MAX_LOSSES = 256          # backward calls of one step whose loss is kept (micro-batches); later ones are not


def make(options: dict) -> NumericsSentinel:
    return NumericsSentinel()


class NumericsSentinel(RankPart):
    name = "numerics"
    every_step = False      # nothing is read on a boundary-only step (a block's last values: at the next block's)

    def install(self, ctx: RankContext) -> None:
        super().install(ctx)
        import torch

        self.torch = torch
        self.is_compiling = _is_compiling(torch)
        self.losses: list = []          # this step's local losses (detached)
        self.norm: Any = None           # this step's norm: the last clip's result (detached), or DeepSpeed's
        self.norm_source = "clip"       # where self.norm came from (health.grad_norm_source)
        self.loss_mean = False          # this step's losses are averaged, not summed (step_loss)
        self.own_norms: list = []       # this step's norms dtprof computed (one per optimizer step; no clip seen)
        self.norm_ok: dict = {}         # id(optimizer) -> its gradients can be normed (checked once)
        self.lr: float | None = None
        self.lrs: list | None = None
        self.fp = None                  # this step's fingerprint (an int64 scalar on the parameters' device)
        self.fp_timing: list = []       # (CPU ns, (start, end) CUDA events or None, elements) of the timed ones
        self.fp_cuda = False            # the parameters are on a GPU (the step is then priced by its wall time)
        self.opt_seen = False           # this step's first optimizer step was read
        self.fp_interval: int | None = 0      # 0: not priced yet; None: never again (why in the meta row)
        self.fp_from = 0
        self.step_cost: list[int] = []      # the pricing steps' cost (ns): the training thread's CPU, or on a
        self.last_end: tuple | None = None  # GPU the wall time; (wall ns, thread CPU ns) at the last step's end
        self.pricing = True             # steps 0..FP_PRICE_FROM + FP_PRICE_STEPS - 1: the callbacks time themselves
        self.own_ns = 0                 # this step's callbacks' own CPU (pricing steps only), and each pricing step's
        self.own_steps: list[int] = []
        self.read_every = 1             # reads on the detailed steps that are multiples of this (priced)
        self.full_detail = bool(ctx.options.get("full_detail"))
        self.pending: deque = deque()   # (step, slot, event, lr, lrs, has loss, norm's source or None, has fp,
                                        # a host norm or None, has a GradScaler read)
        self.slot = 0
        self.dropped = 0
        self.buf_f: Any = None          # the ring: (RING, 4) float64 [loss, grad_norm, loss scale, skips],
                                        # (RING,) int64 fingerprint
        self.buf_i: Any = None
        self.views: list = []
        self.cuda = False
        self.int_of = _int_of(torch)
        self.clip_off = False
        self.scaler_off = False
        self.patched: list = []         # (owner, name, original) of the functions wrapped (numerics_wraps.py)
        self.exited = False
        self.scales: list = []          # this step's GradScaler reads: (its scale, 1.0 when it found an inf/NaN)
        install_wraps(self)

    # ---- the training thread -------------------------------------------------------------------------------

    def local(self, norm):
        """The norm as a plain tensor: a DTensor's local value when it is replicated (FSDP2's clip returns one),
        else None (a partial norm is not the total)."""
        if not isinstance(norm, self.torch.Tensor):
            return None
        if hasattr(norm, "placements"):
            return norm.to_local().detach() if all(p.is_replicate() for p in norm.placements) else None
        return norm.detach()

    def on_backward(self, tensors) -> None:
        if self.is_compiling() or self.ctx.step % self.read_every:
            return
        t0 = time.thread_time_ns() if self.pricing else 0
        t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
        if isinstance(t, self.torch.Tensor) and t.numel() == 1 and len(self.losses) < MAX_LOSSES:
            if not self.losses and "torch.distributed.pipelining" in sys.modules:
                self.loss_mean = _pipeline_scales_grads()
            self.losses.append(t.detach())
        if t0:
            self.own_ns += time.thread_time_ns() - t0

    def on_optimizer_pre_step(self, optimizer) -> None:
        """The step's gradient norm, when the job did not clip: computed on the device, read with the rest."""
        ctx = self.ctx      # (detailed steps only: the pre-hook is installed on them, and not in an A/B "off" block)
        if self.is_compiling() or self.norm is not None or ctx.step % self.read_every or not ctx.active:
            return
        t0 = time.thread_time_ns() if self.pricing else 0
        ok = self.norm_ok.get(id(optimizer))
        if ok is None:
            ok = self.norm_ok[id(optimizer)] = self.can_norm(optimizer)
        if ok:
            torch = self.torch
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                with torch.no_grad():
                    norms = torch._foreach_norm(grads)
                    self.own_norms.append(norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms)))
        if t0:
            self.own_ns += time.thread_time_ns() - t0

    def can_norm(self, optimizer) -> bool:
        """Whether dtprof's norm of this optimizer's gradients is the total: not for sharded ones (an events row
        says why, once per optimizer)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        why = None
        if "deepspeed" in sys.modules and _called_from_deepspeed() and not _deepspeed_engine_steps():
            why = "DeepSpeed's optimizer wrapper steps the optimizer (ZeRO's partitions; it computes its own norm)"
        elif any(hasattr(p, "placements") for p in params):
            why = "sharded parameters (DTensor): a local shard's norm is not the total"
        elif any(getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False) for p in params):
            why = "FSDP1's flat parameters: a local shard's norm is not the total"
        elif len({p.device for p in params}) > 1:
            why = "parameters on several devices"
        elif any(p.is_sparse for p in params):
            why = "sparse parameters"
        if why:
            self.ctx.event("info", f"numerics: no gradient norm computed by dtprof for this optimizer: {why}")
        return why is None

    def on_optimizer_step(self, optimizer) -> None:
        ctx = self.ctx      # detailed steps only (an A/B "off" block is not recorded: ctx.active is False)
        if self.is_compiling() or self.opt_seen or not ctx.detail or not ctx.active:
            return          # the step's first optimizer names the step's rate
        self.opt_seen = True
        if not ctx.step % self.read_every:
            t0 = time.thread_time_ns() if self.pricing else 0
            lrs = [self.host_float(g.get("lr")) for g in optimizer.param_groups]
            self.lr, self.lrs = lrs[0] if lrs else None, lrs if len(lrs) > 1 else None
            if "deepspeed" in sys.modules:
                self.deepspeed_norm()
            if t0:
                self.own_ns += time.thread_time_ns() - t0
        if self.fp_due(ctx.step):
            self.fp = self.fingerprint(optimizer)

    def deepspeed_norm(self) -> None:
        """DeepSpeed's own global gradient norm of this step (what ``engine.get_global_grad_norm()`` returns after
        it), in place of any clip's: DeepSpeed's gradients are partitions (a torch clip inside its step would norm
        one rank's share). A tensor travels as a clip's does; a float is kept as it is."""
        v = _deepspeed_norm(FRAMES)
        if isinstance(v, self.torch.Tensor) and v.numel() == 1:
            self.norm, self.norm_source = v.detach(), "deepspeed"
        elif isinstance(v, (int, float)):
            self.norm, self.norm_source = float(v), "deepspeed"

    def host_float(self, v):
        """A learning rate without a device read: a number, or a CPU tensor's value; None for a device tensor."""
        if isinstance(v, self.torch.Tensor):
            return float(v) if v.device.type == "cpu" and v.numel() == 1 else None
        return float(v) if isinstance(v, (int, float)) else None

    def fp_due(self, step: int) -> bool:
        if step == 0 or step in FP_TIMED_STEPS:
            return True
        i = self.fp_interval
        return i is not None and i > 0 and step >= self.fp_from and step % i == 0

    def fingerprint(self, optimizer):
        torch = self.torch
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            return None
        if any(hasattr(p, "placements") for p in params):
            self.no_fingerprint("the optimizer holds sharded parameters (DTensor): the ranks are not replicas")
            return None
        self.fp_cuda = params[0].is_cuda
        timed = self.ctx.step in FP_TIMED_STEPS
        t0 = time.thread_time_ns()     # the training thread's CPU: a busy machine's preemptions are not its cost
        ev = None
        if timed and params[0].is_cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        with torch.no_grad():       # the views need no detach (one dispatcher call less per parameter)
            sums = [p.view(self.int_of[p.dtype]).sum(dtype=torch.int64) for p in params if p.dtype in self.int_of]
            fp = torch.stack(sums).sum() if sums else None
        if timed:
            if ev is not None:
                ev[1].record()
            self.fp_timing.append((time.thread_time_ns() - t0, ev, sum(p.numel() for p in params)))
        return fp

    def no_fingerprint(self, reason: str) -> None:
        if self.fp_interval is not None:
            self.fp_interval = None
            self.ctx.meta("numerics", {"interval": None, "from_step": None, "cost_ns": None, "step_ns": None,
                                       "budget": FP_BUDGET, "parameters": None, "reason": reason})

    def on_step_end(self, step: int, t_ns: int, detailed: bool) -> None:
        t0 = time.thread_time_ns() if self.pricing else 0
        if self.pending:
            self.read_ready(step)
        if not detailed:        # a boundary-only step: nothing of it was read
            return
        try:
            if self.fp is not None or not step % self.read_every:
                self.launch(step)
        finally:
            self.losses, self.norm, self.fp, self.lr, self.lrs, self.opt_seen = [], None, None, None, None, False
            self.own_norms, self.loss_mean, self.scales = [], False, []
        if t0:
            self.own_ns += time.thread_time_ns() - t0
            self.price_step(step, t_ns)

    def launch(self, step: int) -> None:
        """This step's device values into the next ring slot, non-blocking, and the event that says they landed."""
        torch = self.torch
        loss = step_loss(torch, self.losses, self.loss_mean) if self.losses else None
        norm, fp, source = self.norm, self.fp, self.norm_source if self.norm is not None else None
        scale = skips = None
        if self.scales:     # the scale of the iteration whose optimizer step ended this step; the skips before it
            scale = self.scales[-1][0]
            skips = self.scales[0][1] if len(self.scales) == 1 else torch.stack([x[1] for x in self.scales]).sum()
        host_norm = None
        if isinstance(norm, float):         # a norm the framework keeps as a float (DeepSpeed's FP16_Optimizer)
            host_norm, norm = norm, None
        if norm is None and host_norm is None and self.own_norms:
            own = self.own_norms
            if len(own) == 1:
                norm = own[0]
            elif len({x.device for x in own}) == 1:     # several optimizers: the norm of all their gradients
                norm = torch.linalg.vector_norm(torch.stack([x.reshape(()).double() for x in own]))
            source = "dtprof" if norm is not None else None
        slot = self.slot
        if loss is not None or norm is not None or fp is not None or scale is not None:
            if self.buf_f is None:
                self.cuda = any(v is not None and v.is_cuda for v in (loss, norm, fp, scale))
                self.buf_f = torch.zeros((RING, 4), dtype=torch.float64, pin_memory=self.cuda)
                self.buf_i = torch.zeros((RING,), dtype=torch.int64, pin_memory=self.cuda)
                # each slot's views made once: indexing is a dispatcher call per view per step
                self.views = [(self.buf_f[i], self.buf_f[i, 0], self.buf_f[i, 1], self.buf_i[i], self.buf_f[i, 2],
                               self.buf_f[i, 3]) for i in range(RING)]
            if len(self.pending) >= RING:
                self.dropped += 1
                loss = norm = fp = source = scale = None
            else:
                _, v_loss, v_norm, v_fp, v_scale, v_skips = self.views[slot]
                if loss is not None:
                    v_loss.copy_(loss.reshape(()), non_blocking=True)
                if norm is not None:
                    v_norm.copy_(norm.reshape(()), non_blocking=True)
                if fp is not None:
                    v_fp.copy_(fp, non_blocking=True)
                if scale is not None:
                    v_scale.copy_(scale, non_blocking=True)
                    v_skips.copy_(skips, non_blocking=True)
                self.slot = (slot + 1) % RING
        event = None
        if self.cuda and (loss is not None or norm is not None or fp is not None or scale is not None):
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, slot, event, self.lr, self.lrs, loss is not None,
                             source if norm is not None or host_norm is not None else None, fp is not None,
                             host_norm, scale is not None))

    def read_ready(self, before: int) -> None:
        """Rows of the pending steps before ``before`` whose copies have landed, oldest first."""
        while self.pending and self.pending[0][0] < before:
            step, slot, event, lr, lrs, has_loss, source, has_fp, host_norm, has_scale = self.pending[0]
            has_norm = source is not None and host_norm is None
            if event is not None and not event.query():
                break
            self.pending.popleft()
            loss = norm = fp = scale = skips = None
            if has_loss or has_norm or has_scale:
                f = self.views[slot][0].tolist()     # host memory the copies landed in: no device read
                loss, norm = (f[0] if has_loss else None), (f[1] if has_norm else None)
                if has_scale:
                    scale, skips = f[2], int(f[3])
            if host_norm is not None:
                norm = host_norm
            if has_fp:
                fp = int(self.views[slot][3])
            bad = " ".join(n for n, v in (("loss", loss), ("grad_norm", norm))
                           if v is not None and not math.isfinite(v))
            if bad:
                loss = loss if loss is None or math.isfinite(loss) else None
                norm = norm if norm is None or math.isfinite(norm) else None
            self.ctx.add(Health(self.ctx.rank, step, loss, norm, lr, json.dumps(lrs) if lrs else None, bad, fp,
                                source, scale, skips))

    def price_step(self, step: int, t_ns: int) -> None:
        """The pricing steps' cost, then the fingerprint's interval. A CPU job's step is priced by the training
        thread's CPU, as the fingerprint is (a busy machine's preemptions are neither's cost; a rank waiting on
        its peers uses less CPU than wall time, so the share is the larger one); a GPU job's by its wall time."""
        th = time.thread_time_ns()
        if self.last_end is not None and step >= FP_PRICE_FROM and len(self.step_cost) < FP_PRICE_STEPS:
            wall, cpu = t_ns - self.last_end[0], th - self.last_end[1]
            self.step_cost.append(wall if self.fp_cuda else cpu)
            self.own_steps.append(self.own_ns)
        self.own_ns = 0
        self.last_end = (t_ns, th)
        if len(self.step_cost) < FP_PRICE_STEPS:
            return
        if self.fp_interval == 0:
            self.price_fingerprint(step + 1)
            if self.fp_interval == 0:
                return                  # a GPU fingerprint's time not known yet: priced at a later step's end
        self.pricing = False
        self.price_reads(step + 1)

    def price_reads(self, next_step: int) -> None:
        """Reads on every ``read_every``-th detailed step: the smallest power of two that keeps the callbacks' own
        CPU per read step (median of the pricing steps, the fingerprint's apart) under READ_BUDGET of the median
        pricing step; 1 with --full-detail (every step asked for)."""
        own = sorted(self.own_steps)[len(self.own_steps) // 2]
        step_ns = sorted(self.step_cost)[len(self.step_cost) // 2]
        every = 1
        while not self.full_detail and own > READ_BUDGET * step_ns * every and every < READ_MAX_EVERY:
            every *= 2
        self.read_every = every
        self.ctx.meta("numerics_reads", {"every": every, "from_step": next_step, "cost_ns": own, "step_ns": step_ns,
                                         "budget": READ_BUDGET, "full_detail": self.full_detail})

    def price_fingerprint(self, next_step: int) -> None:
        """The fingerprint's interval from its measured cost (the training thread's CPU time, plus its device time
        on a GPU once the events have completed) and the median of the pricing steps."""
        if not self.fp_timing:
            self.no_fingerprint(f"no optimizer step with parameters to fingerprint at steps {FP_TIMED_STEPS}")
            return
        if any(ev is not None and not ev[1].query() for _, ev, _ in self.fp_timing):
            return                      # priced at a later step's end
        cost = min(host + (int(ev[0].elapsed_time(ev[1]) * 1e6) if ev is not None else 0)
                   for host, ev, _ in self.fp_timing)
        numel = self.fp_timing[-1][2]
        step_ns = sorted(self.step_cost)[len(self.step_cost) // 2]
        interval = 1
        while cost > FP_BUDGET * step_ns * interval and interval < FP_MAX_INTERVAL:
            interval *= 2
        self.fp_interval = interval
        self.fp_from = -(-next_step // interval) * interval
        self.ctx.meta("numerics", {"interval": interval, "from_step": self.fp_from, "cost_ns": cost,
                                   "step_ns": step_ns, "budget": FP_BUDGET, "parameters": numel, "reason": None})

    # ---- exit -----------------------------------------------------------------------------------------------

    def on_exit(self) -> None:
        """The last steps' values: the ones whose copies have landed within a second (never a wait on a hung
        device), then the clip wrappers out."""
        deadline = time.monotonic() + 1.0
        while self.pending:
            self.read_ready(1 << 62)
            if not self.pending or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if self.dropped:
            self.ctx.event("warning", f"numerics: {self.dropped} step(s) recorded without their device values "
                                      f"(their slot was still in flight {RING} steps later)")
        self.exited = True
        for mod, name, f in self.patched:
            setattr(mod, name, f)
        self.patched = []


def step_loss(torch, losses: list, mean: bool):
    """The step's loss from the losses ``backward`` was called on (docs/metrics.md, "Local loss"): their sum, the
    objective whose gradient the step applies (a loop that divides each micro-batch's loss by its accumulation
    steps, as DeepSpeed's engine does itself, so sums to the undivided losses' mean: what such jobs log), or their
    mean (``mean``: a torch pipelining schedule, which backpropagates each micro-batch's loss undivided and divides
    the gradients by their count). In float64, on the first loss's device (others are left out)."""
    dev = losses[0].device
    same = [x for x in losses if x.device == dev]
    if len(same) == 1:
        return same[0]
    total = torch.stack([x.reshape(()).double() for x in same])
    return total.mean() if mean else total.sum()


def _pipeline_scales_grads() -> bool:
    """Inside a torch pipelining schedule whose ``scale_grads`` divides the gradients by the micro-batch count
    (the default): its losses are then averaged (``step_loss``)."""
    f: FrameType | None = sys._getframe(2)
    for _ in range(PIPELINE_FRAMES):
        if f is None:
            return False
        if f.f_code.co_name == "_step_microbatches" and "pipelining" in f.f_code.co_filename:
            return bool(getattr(f.f_locals.get("self"), "scale_grads", True))
        f = f.f_back
    return False


def _is_compiling(torch):
    """``torch.compiler.is_compiling`` at a fraction of its cost (it first calls ``torch.jit.is_scripting``, a
    Python function: two of these run on every step): Dynamo folds ``is_dynamo_compiling`` to True while it traces
    (no guard on what follows), and torch.export's non-strict tracing sets the flag."""
    compiler = torch.compiler
    dynamo = getattr(compiler, "is_dynamo_compiling", None)
    if dynamo is None or not hasattr(compiler, "_is_compiling_flag"):
        return compiler.is_compiling         # an older torch: its own check (the part must not fail to install)

    def is_compiling() -> bool:
        return dynamo() or compiler._is_compiling_flag
    return is_compiling


def _int_of(torch) -> dict:
    """A floating dtype -> the integer dtype of its width (the fingerprint sums the bits)."""
    table = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            table[getattr(torch, name)] = torch.int8
    return table
