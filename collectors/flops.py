"""FLOP counting (``count_flops``): step 1 (the second) runs under ``FlopCounterMode``; its ``executed_flops`` goes
into that step's row and a ``flops_count`` span marks the step, which is slower. In a compiled job the counted step
runs eager (``torch.compiler.set_stance("force_eager")``): under a dispatch mode Dynamo declines a frame and marks
its code "skip" for the rest of the process, so compiled code stays compiled afterwards.

FlopCounterMode has formulas for the GPU attention kernels only; on a CPU, ``scaled_dot_product_attention`` runs
``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), whose FLOPs it would leave out (7.5 % of a small
GPT's step). ``_cpu_attention_formulas`` gives those two ops the formulas of their GPU counterparts (same shapes).
"""
from __future__ import annotations

import sys
import time

now = time.monotonic_ns


def _cpu_attention_formulas() -> dict:
    """FlopCounterMode's ``custom_mapping`` for the CPU attention ops (module docstring); empty where this torch
    lacks either side."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    pairs = (("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
             ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"))
    registry = getattr(flop_counter, "flop_registry", {})
    mapping = {}
    for cpu_op, gpu_op in pairs:
        cpu, gpu = getattr(aten, cpu_op, None), getattr(aten, gpu_op, None)
        if cpu is not None and gpu is not None and gpu in registry:
            mapping[cpu] = getattr(registry[gpu], "__wrapped__", registry[gpu])   # FlopCounterMode wraps it again
    return mapping


class FlopCounter:
    """The FLOP-counted step of one rank, over its ``RankContext``. ``step``: (step, start ns) while one is counted,
    else None (the step clock reads it at every step's end)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.mode = None
        self.step = None
        self.stance = None         # the force_eager stance of the counted step

    def start(self) -> None:
        """Run the next step (the step in progress now that the previous one ended) under FlopCounterMode."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        if "torch._dynamo" in sys.modules:
            set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
            if set_stance is None:
                self.ctx.meta("flops_skipped", {"reason": "this torch has no torch.compiler.set_stance: counting "
                                                          "FLOPs in a compiled job would turn its compiled code eager"})
                return
            self.stance = set_stance("force_eager")
        self.mode = FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas())
        self.mode.__enter__()
        self.step = (self.ctx.step, now())

    def finish(self, step):
        """The FLOPs of step ``step`` if it was the counted one (its span written), else None."""
        if self.mode is None or self.step is None or self.step[0] != step:
            return None
        mode, (s, t0) = self.mode, self.step
        self.mode = self.step = None
        mode.__exit__(None, None, None)
        if self.stance is not None:
            stance, self.stance = self.stance, None
            stance.__exit__(None, None, None)
        self.ctx.span("flops_count", "FlopCounterMode", t0, now(), step=s)
        return int(mode.get_total_flops())
