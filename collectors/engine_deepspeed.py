"""DeepSpeed's engine on the rank side: one ``engine.step()`` is one optimizer step (issue 47).

A rank-side part (collectors/parts.py), made only when the job imports DeepSpeed. ZeRO steps the torch optimizer
once per parameter group: ZeRO-1/2 (``stage_1_and_2.py`` ``_optimizer_step(group_no)``, ``param_groups`` swapped to
that one group) and ZeRO-3 (``stage3.py`` ``_optimizer_step(sub_group_id)``, once per sub-group of
``sub_group_size`` elements), every group each step, building each group's fp32 gradients just before its step and
freeing them after. One optimizer step is all of them (an HF Trainer's two weight-decay groups were recorded as two
steps): this part says "not over yet" (``optimizer_step_pending``) at every group's torch step but the last, so the
step clock closes the optimizer step (its span, ``on_optimizer_step``) at the last and the other parts hear the
earlier ones through ``on_optimizer_group``.

How: from the torch optimizer's post-hook, a walk of a few frames up to DeepSpeed's ``_optimizer_step`` reads its
group index and the number of groups (``bit16_groups`` under ZeRO-1/2, ``fp16_groups``, one per sub-group, under
ZeRO-3). Cost: that walk at each torch optimizer step of a DeepSpeed job; nothing in any other job.

The step ends when the engine's own step call returns, not at the torch optimizer's step inside it: what the engine
does after that step is the step's (ZeRO-1/2's all-gather of the updated partitions, the PipelineEngine's loss
all-reduce and broadcast), as it is in the job's own step time. The calls: ``engine.step()`` (at the accumulation
boundary: a micro-batch's ``engine.step()`` before it steps no optimizer, so ends no step) and the PipelineEngine's
``train_batch()`` (it steps the optimizer inside its schedule, never through ``engine.step()``). This part raises
``RankContext.hold_step_end`` while one runs and calls ``ctx.end_held_step()`` as it returns.

ZeRO-1/2's gradient buckets: each engine's ZeRO config that shapes its gradient reduction (``stage``,
``reduce_bucket_size``, ``overlap_comm``, ``contiguous_gradients``, ``gradient_accumulation_steps``: ZeRO-2 reduces
after every micro-batch's backward, ZeRO-1 once at the boundary) is written once per engine, at its first step
call, as a ``deepspeed_zero`` meta row; and each bucket flush (``DeepSpeedZeroOptimizer.reduce_ipg_grads``, on the
training thread, inside ``loss.backward()`` as a bucket fills and once after it) is a ``zero_bucket`` span on
detailed steps: the collectives inside it are that bucket's reduction, and the span less them is the engine's own
work per bucket (analyzers/zero_bucket.py). Cost: two clock reads and a row per flush. At exit (``on_exit``) the
engines' own methods are put back.
"""
from __future__ import annotations

import functools
import sys
from types import FrameType

from dtprof.collectors.parts import RankPart, now

FRAMES = 12     # the post-hook's callers up to DeepSpeed's _optimizer_step: torch's step wrappers, Parts.pending


def group_pending(depth: int = FRAMES) -> bool:
    """Inside DeepSpeed ZeRO's optimizer step, before its last (sub-)group."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        code = f.f_code
        if code.co_name == "_optimizer_step" and "deepspeed" in code.co_filename:
            loc = f.f_locals
            i = loc.get("group_no", loc.get("sub_group_id"))
            owner = loc.get("self")
            groups = getattr(owner, "bit16_groups", None) or getattr(owner, "fp16_groups", None)
            return isinstance(i, int) and groups is not None and i < len(groups) - 1
        f = f.f_back
    return False


def called_from_deepspeed(depth: int = FRAMES) -> bool:
    """The optimizer step in progress was called from DeepSpeed's code (the numerics part: ZeRO's gradients are
    partitions, so a norm of them is not the total)."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if "deepspeed" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def engine_steps_optimizer(depth: int = FRAMES) -> bool:
    """The optimizer step in progress was called by DeepSpeed's engine itself (``_take_model_step``, first of
    DeepSpeed's frames above): ZeRO stage 0 without an fp16/bf16 optimizer wrapper, whose gradients are whole (the
    engine all-reduced them over the data-parallel group at the boundary), not a wrapper's partitions."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if "deepspeed" in f.f_code.co_filename:
            return f.f_code.co_name == "_take_model_step"
        f = f.f_back
    return False


# The clip DeepSpeed's engine calls at ZeRO stage 0 in fp32 (``clip_fp32_gradients``, a module global of its engine
# looked up at each call): it returns the total norm, which the engine drops (``get_global_grad_norm()`` is None)
FP32_CLIP = ("deepspeed.runtime.engine", "clip_grad_norm_")


# DeepSpeed's optimizer wrappers' methods that call the torch optimizer's step, each after setting its
# ``_global_grad_norm`` for the step (ZeRO-1/2 and ZeRO-3's ``_optimizer_step``, FP16/BF16_Optimizer's ``step``)
NORM_STEPPERS = ("_optimizer_step", "step", "step_fused_adam", "step_fused_lamb")


def global_grad_norm(depth: int = FRAMES):
    """The global gradient norm DeepSpeed computed for the optimizer step in progress (called from a torch
    optimizer's post-hook): the ``_global_grad_norm`` of the DeepSpeed optimizer wrapper that stepped it, set
    before its first group's step (a tensor, or a float: ``inf`` on an overflow), the value the engine copies to
    ``get_global_grad_norm()`` once the step returns. None when the first DeepSpeed frame above is not such a
    wrapper (the engine steps a torch optimizer itself at ZeRO stage 0 in fp32: its clip's norm, if any, is kept
    nowhere: ``FP32_CLIP``)."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return None
        code = f.f_code
        if "deepspeed" in code.co_filename:
            if code.co_name not in NORM_STEPPERS:
                if code.co_name == "step_with_gradscaler":    # ZeRO-3's closure inside _optimizer_step
                    f = f.f_back
                    continue
                return None
            return getattr(f.f_locals.get("self"), "_global_grad_norm", None)
        f = f.f_back
    return None


class DeepSpeedGroups(RankPart):
    name = "deepspeed"

    def install(self, ctx) -> None:
        self.ctx = ctx
        self.patched: list = []     # (class, name, its own attribute) of the methods wrapped, put back at exit
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.engines_seen: set[int] = set()     # id() of the engines whose ZeRO config is written
        for cls, name in ((DeepSpeedEngine, "step"), (PipelineEngine, "train_batch")):
            self.patched.append((cls, name, cls.__dict__.get(name)))
            setattr(cls, name, self.holding_step_end(getattr(cls, name)))
        try:
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        except Exception:      # a DeepSpeed without ZeRO-1/2's optimizer: no bucket spans
            return
        self.patched.append((DeepSpeedZeroOptimizer, "reduce_ipg_grads",
                             DeepSpeedZeroOptimizer.__dict__.get("reduce_ipg_grads")))
        DeepSpeedZeroOptimizer.reduce_ipg_grads = self.bucket_span(DeepSpeedZeroOptimizer.reduce_ipg_grads)

    def on_exit(self) -> None:
        """The engines' methods back as DeepSpeed defined them (one a class inherited is deleted again)."""
        for cls, name, own in reversed(self.patched):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        self.patched = []

    def holding_step_end(self, orig):
        """``orig`` (an engine's step call) with the step's end held until it returns (module docstring)."""
        ctx = self.ctx

        @functools.wraps(orig)
        def call(engine, *args, **kwargs):
            if ctx.disabled or ctx.hold_step_end:      # (the outermost call of a nested one ends the step)
                return orig(engine, *args, **kwargs)
            if id(engine) not in self.engines_seen:
                self.engines_seen.add(id(engine))
                self.zero_config(engine)
            ctx.hold_step_end = True
            try:
                return orig(engine, *args, **kwargs)
            finally:
                ctx.hold_step_end = False
                try:
                    ctx.end_held_step()
                except Exception:
                    ctx.fault("DeepSpeed engine step end")

        return call

    def zero_config(self, engine) -> None:
        """The engine's ZeRO config that shapes its gradient reduction, one ``deepspeed_zero`` meta row."""
        try:
            self.ctx.meta("deepspeed_zero", {
                "stage": int(engine.zero_optimization_stage()),
                "reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
                "overlap_comm": bool(engine.zero_overlap_comm()),
                "contiguous_gradients": bool(engine.zero_contiguous_gradients()),
                "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
                "step": int(self.ctx.step)})
        except Exception:
            self.ctx.fault("DeepSpeed ZeRO config")

    def bucket_span(self, orig):
        """``orig`` (ZeRO-1/2's ``reduce_ipg_grads``) under a ``zero_bucket`` span on detailed steps."""
        ctx = self.ctx
        clock = now

        @functools.wraps(orig)
        def call(zero_opt, *args, **kwargs):
            if ctx.disabled or not ctx.active or not ctx.detail:
                return orig(zero_opt, *args, **kwargs)
            t0 = clock()
            try:
                return orig(zero_opt, *args, **kwargs)
            finally:
                try:
                    ctx.span("zero_bucket", "reduce_ipg_grads", t0, clock())
                except Exception:
                    ctx.fault("DeepSpeed ZeRO bucket span")

        return call

    def optimizer_step_pending(self, optimizer) -> bool:
        return group_pending()


def make(options: dict):
    return DeepSpeedGroups()
