"""The functions the numerics part (collectors/numerics.py) wraps to read what the job computes itself: the gradient
norm its clip returns (torch's ``clip_grad_norm_``, ``clip_grads_with_norm_``'s given norm, FSDP1's module method,
the clip DeepSpeed's engine calls at ZeRO stage 0 in fp32) and torch.amp.GradScaler's scale and skipped steps.
Each wrapper passes the job's call through unchanged; on a read step it keeps device values for the part's ring,
never reading them on the host. A wrapper that faults stops reading and keeps passing through. The part puts the
originals back at exit (``part.patched``)."""
from __future__ import annotations

import sys
import time
from typing import Any

from dtprof.collectors.engine_deepspeed import FP32_CLIP as DEEPSPEED_FP32_CLIP
from dtprof.collectors.parts import _on_import

CLIP_NAMES = ("clip_grad_norm_", "clip_grad_norm")
# torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm): the clip of a norm the job computed
# itself (torch.nn.utils.get_total_norm; torchtitan's form), read from its argument
WITH_NORM = "clip_grads_with_norm_"
# torch.amp.GradScaler's method that steps the optimizer unless the gradients held an inf/NaN (its found_inf flags
# are final there; FSDP's ShardedGradScaler inherits it)
SCALER_STEP = "_maybe_opt_step"
# FullyShardedDataParallel.clip_grad_norm_ (FSDP1's module method: what Accelerate, the HF Trainer and Lightning
# call under FSDP1), read as a torch clip is once the job has imported FSDP
FSDP1_MODULE = "torch.distributed.fsdp"


def install_wraps(part) -> None:
    """torch's clips and GradScaler wrapped now; FSDP1's and DeepSpeed's clips now or when the job imports them."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    from torch.amp.grad_scaler import GradScaler

    for mod in (clip_grad, nn_utils):
        for name in CLIP_NAMES:
            _wrap(part, mod, name, getattr(mod, name, None), lambda f: wrap_clip(part, f))
    _wrap(part, nn_utils, WITH_NORM, getattr(nn_utils, WITH_NORM, None),      # torch >= 2.6
          lambda f: wrap_clip(part, f, norm_arg=2))
    _wrap(part, GradScaler, SCALER_STEP, GradScaler.__dict__.get(SCALER_STEP), lambda f: wrap_scaler(part, f))
    _on_import(FSDP1_MODULE, lambda: patch_fsdp1(part))
    _on_import("deepspeed", lambda: patch_deepspeed(part))      # (DeepSpeed's __init__ imports its engine)


def _wrap(part, owner, name: str, f, wrapper) -> None:
    if owner is not None and f is not None and not part.exited and not getattr(f, "dtprof_numerics", False):
        part.patched.append((owner, name, f))
        setattr(owner, name, wrapper(f))


def patch_fsdp1(part) -> None:
    """FSDP1's own ``FullyShardedDataParallel.clip_grad_norm_`` wrapped as the torch clips are: the method
    all-reduces its shards' norms and returns the total (a torch clip of FSDP1's sharded parameters would norm one
    rank's shard)."""
    fsdp: Any = getattr(sys.modules.get(FSDP1_MODULE), "FullyShardedDataParallel", None)
    _wrap(part, fsdp, "clip_grad_norm_", getattr(fsdp, "__dict__", {}).get("clip_grad_norm_"),
          lambda f: wrap_clip(part, f))


def patch_deepspeed(part) -> None:
    """The clip DeepSpeed's engine calls at ZeRO stage 0 in fp32 wrapped as the torch clips are: the engine drops
    the total norm it returns, and the gradients dtprof would norm at the optimizer step are clipped."""
    mod, name = DEEPSPEED_FP32_CLIP
    engine = sys.modules.get(mod)
    _wrap(part, engine, name, getattr(engine, name, None), lambda f: wrap_clip(part, f))


def _reads(part) -> bool:
    """Whether this call is read: a read step's, and never while Dynamo traces (is_compiling first: nothing of
    dtprof's state is read then, so no guard is put on it)."""
    ctx = part.ctx
    return not part.is_compiling() and ctx.detail and ctx.active and not ctx.step % part.read_every


def wrap_scaler(part, orig):
    """GradScaler's ``_maybe_opt_step`` passing through; on a read step its scale (the factor this iteration's loss
    was multiplied by: a copy, ``update`` changes it in place) and whether it found an inf/NaN (the optimizer step
    is then skipped) are kept as device values. A skipped iteration has no optimizer step, so dtprof's step goes on
    through the next one: a step holds every skip before its optimizer step."""
    def _maybe_opt_step(scaler, optimizer, optimizer_state, *args, **kwargs):
        if _reads(part) and not part.scaler_off:
            try:
                t0 = time.thread_time_ns() if part.pricing else 0
                scale = scaler._scale
                found = list(optimizer_state["found_inf_per_device"].values())
                if isinstance(scale, part.torch.Tensor) and found and len({f.device for f in found}) == 1:
                    torch = part.torch
                    inf = found[0] if len(found) == 1 else torch.stack([f.reshape(()) for f in found]).amax()
                    part.scales.append((scale.detach().reshape(()).double().clone(), (inf.reshape(()) > 0).double()))
                if t0:
                    part.own_ns += time.thread_time_ns() - t0
            except Exception:
                part.scaler_off = True
                part.ctx.event("error", "dtprof part numerics: GradScaler not read after a fault")
        return orig(scaler, optimizer, optimizer_state, *args, **kwargs)

    _maybe_opt_step.__wrapped__ = orig
    _maybe_opt_step.dtprof_numerics = True
    return _maybe_opt_step


def wrap_clip(part, orig, norm_arg=None):
    """The clip passing the job's result through; on a read step the total norm is kept: the result, or with
    ``norm_arg`` the argument at that position (``clip_grads_with_norm_``'s ``total_norm``)."""
    def clip_grad_norm_(*args, **kwargs):
        result = orig(*args, **kwargs)
        if _reads(part) and not part.clip_off:
            try:
                t0 = time.thread_time_ns() if part.pricing else 0
                norm = result if norm_arg is None else (
                    args[norm_arg] if len(args) > norm_arg else kwargs.get("total_norm"))
                part.norm, part.norm_source = part.local(norm), "clip"
                if t0:
                    part.own_ns += time.thread_time_ns() - t0
            except Exception:
                part.clip_off = True     # the wrapper keeps passing the job's result through
                part.ctx.event("error", "dtprof part numerics: clip_grad_norm_ not read after a fault")
        return result

    clip_grad_norm_.__wrapped__ = orig
    clip_grad_norm_.__name__ = orig.__name__
    clip_grad_norm_.__doc__ = orig.__doc__
    clip_grad_norm_.dtprof_numerics = True
    return clip_grad_norm_
