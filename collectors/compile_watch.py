"""torch.compile: Dynamo must never trace dtprof (docs/cli-run.md, "Compiled models").

- ``patch`` (at ``import torch``, before the program compiles anything): ``torch.compile`` and ``Module.compile``
  start watching Dynamo's compiles (``watch``), and ``Module.compile()`` (which compiles the module's own
  ``_call_impl``, its hooks included) has the module's forward timed by a wrapper around that compiled call.
- ``watch``: Dynamo calls the recorder's ``on_compile_start`` before it traces anything (the global module hooks
  move to the roots then, so no graph is ever traced with them), and every frame of dtprof's rank side is marked
  for Dynamo to skip (``skip_our_code``).
"""
from __future__ import annotations

import os
import sys
import traceback


def _last_error_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


class CompileWatch:
    """torch.compile's integration for one rank, over its ``RankContext``. ``on_compile_start``: the recorder's
    (Dynamo is about to trace); ``fwd_pre_hook``/``fwd_hook``: the step clock's forward hooks, which time a
    ``Module.compile()``d module from outside its graph."""

    def __init__(self, ctx, on_compile_start, fwd_pre_hook, fwd_hook, compiled_roots):
        self.ctx = ctx
        self.on_compile_start = on_compile_start
        self.fwd_pre_hook = fwd_pre_hook
        self.fwd_hook = fwd_hook
        self.watching = False        # Dynamo's compile-start callback is registered
        self.compiled_roots = compiled_roots   # ids of modules compiled with Module.compile(): timed by their wrapper

    def watch(self) -> None:
        """Have Dynamo call ``on_compile_start`` before it traces anything (torch._dynamo is imported by now: the
        program compiled something; importing it ourselves would cost every job ~1.5 s)."""
        self.watching = True
        try:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self.on_compile_start)
        except Exception:             # an older torch: the roots' hooks only move at step 0's end
            self.ctx.event("warning", f"Dynamo's compile callbacks are unavailable: {_last_error_line()}")
        skip_our_code()

    def patch(self) -> None:
        """Before the program compiles anything (at ``import torch``): ``torch.compile`` and ``Module.compile``
        watch Dynamo's compiles (``watch``), and ``Module.compile()`` (which compiles the module's own
        ``_call_impl``, its hooks included) has the module's forward timed by a wrapper around that compiled call,
        which nn.Module calls outside the graph (wrap_compiled_call)."""
        import warnings

        import torch

        # torch warns at each call of a torch.compile(module) while global module hooks exist: ours, in step 0
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        cw, ctx = self, self.ctx
        orig_compile, orig_module_compile = torch.compile, torch.nn.Module.compile

        def compile(*args, **kwargs):
            out = orig_compile(*args, **kwargs)
            if not cw.watching:
                cw.watch()
            return out

        def module_compile(module, *args, **kwargs):
            out = orig_module_compile(module, *args, **kwargs)
            try:
                cw.wrap_compiled_call(module)
            except Exception:
                ctx.fault("Module.compile")
            return out

        for wrapper, orig in ((compile, orig_compile), (module_compile, orig_module_compile)):
            wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
            wrapper.__doc__ = orig.__doc__
        torch.compile = compile
        torch.nn.Module.compile = module_compile

    def wrap_compiled_call(self, module) -> None:
        """Time a ``Module.compile()``d module's forward by a wrapper around its compiled call (outside the graph)."""
        inner = module._compiled_call_impl
        if inner is None:
            return
        ctx, pre_hook, hook = self.ctx, self.fwd_pre_hook, self.fwd_hook
        self.compiled_roots.add(id(module))
        if not self.watching:
            self.watch()

        def compiled_call(*args, **kwargs):
            if not ctx.active or ctx.disabled or not ctx.detail:
                return inner(*args, **kwargs)
            pre_hook(module, args, kwargs)
            out = inner(*args, **kwargs)
            hook(module, args, out)
            return out

        module._compiled_call_impl = compiled_call


def skip_our_code() -> None:
    """Tell Dynamo never to compile a frame of dtprof's rank side. A hook called from eager code that runs under
    a compiled module's frame callback (torch.compile(module) runs the module's own hooks outside its graph) is a
    frame Dynamo would otherwise compile (its cached graph would then run instead of the hook), and so would be
    every torch function a hook calls (registering hooks, starting the recording). The hooks and the recorder's
    methods skip their callees too; a wrapper of a torch function (a collective, backward, a DataLoader's
    ``__next__``: the closures) skips only its own frame, so what it wraps is Dynamo's to judge as in a bare job.
    Costs nothing per call."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except Exception:
        return
    from dtprof.collectors import (
        ab,
        collective_rows,
        cuda_timing,
        engine_deepspeed,
        flops,
        hooks_collectives,
        hooks_ddp,
        hooks_functional,
        hooks_pipelining,
        identity,
        inputs,
        module_hooks,
        parts,
        records,
        sampling,
        stepclock,
    )

    runtime = sys.modules["dtprof.collectors.runtime"]     # (imported: it made the CompileWatch)
    recorder = (runtime, identity, sys.modules[__name__], stepclock, module_hooks, sampling, cuda_timing, flops, ab)

    own = FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT)
    with_callees = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    seen: set = set()

    ours = os.path.dirname(os.path.abspath(__file__))

    def skip(code, strategy) -> None:
        # (a decorated function's code may be the decorator's: contextlib's, shared by every context manager)
        if id(code) in seen or not os.path.abspath(code.co_filename).startswith(ours):
            return
        seen.add(id(code))
        set_code_exec_strategy(code, strategy)
        for nested in code.co_consts:      # closures and comprehensions defined inside
            if hasattr(nested, "co_code"):
                skip(nested, own)

    for mod in (*recorder, hooks_collectives, collective_rows, hooks_ddp, hooks_pipelining, hooks_functional, parts,
                inputs, records, engine_deepspeed):
        strategy = with_callees if mod in recorder else own
        for obj in vars(mod).values():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            for member in (vars(obj).values() if isinstance(obj, type) else (obj,)):
                code = getattr(getattr(member, "__func__", member), "__code__", None)
                if code is not None:
                    skip(code, strategy)
