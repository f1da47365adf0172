"""The forward hooks' modules: which modules the step clock's forward hooks (collectors/stepclock.py) sit on.

Global module hooks put every module call of the program on nn.Module's slow path, so they are used only in step
0, to find the top-level modules (the roots); after that the hooks sit on the roots alone (and on the modules a
trained root wraps, parked during its training forward). A module's hooks are taken out of it for a while
(``park_hooks``) where they would only cost nn.Module's slow path. The roots also give the ``model`` meta row.
"""
from __future__ import annotations


class ModuleHooks:
    """The module hooks of one rank, over its ``RankContext``. ``fwd_pre_hook``/``fwd_hook``: the step clock's;
    ``compiled_roots``: ids of the modules compiled with ``Module.compile()`` (compile_watch.py), timed by their call
    wrapper instead."""

    def __init__(self, ctx, fwd_pre_hook, fwd_hook, compiled_roots):
        self.ctx = ctx
        self.fwd_pre_hook = fwd_pre_hook
        self.fwd_hook = fwd_hook
        self.compiled_roots = compiled_roots
        self.module_handles: list = []   # forward hooks: global ones during step 0, then on the root modules only
        self.wrapped_handles: dict = {}  # id(trained root) -> the handles of the hooks on the modules it wraps
        self.roots = None          # weakref.WeakSet of the modules seen at nesting depth 0 in step 0
        self.trained: set = set()  # ids of step 0's roots whose forward ran with gradients, and the modules they wrap
        self.global_hooks_on = False   # the global module hooks are installed (step 0, until a compile starts)
        self.in_flight: list = []  # ids of the modules whose forward is under way, while the global hooks are on
        self.parked_hooks: list = []   # (hooks dict, key, hook, first) of hooks out for now (park_hooks)

    def note_root(self, module) -> None:
        if self.roots is None:
            import weakref

            self.roots = weakref.WeakSet()
        self.roots.add(module)

    def note_trained(self, module) -> None:
        self.trained.update(id(m) for m in (module, *wrapped_modules(module)))

    def record_model(self) -> None:
        """A ``model`` meta row at the end of step 0: the parameters of the root modules (each parameter once; a
        DTensor counts its global shape, a plain shard its local one), part of what identifies a configuration
        (`dtprof compare`). Once per run; a model that cannot be counted is left out, never a fault."""
        try:
            roots = list(self.roots or ())
            if not roots:
                return
            params = {id(p): p for m in roots for p in m.parameters()}
            self.ctx.meta("model", {"parameters": int(sum(p.numel() for p in params.values())),
                                "modules": sorted({type(m).__name__ for m in roots})})
        except Exception:
            pass

    def park_hooks(self, handles) -> None:
        """Take these module hooks out of their modules until ``unpark_hooks``: a module with hooks takes
        nn.Module's slow path on every call. Out during a pipeline schedule's step (the step clock's
        begin_pipeline_step), and the hooks of the modules a trained root wraps during its training forward, where
        they would only count depth (``install``)."""
        for h in handles:
            hooks = h.hooks_dict_ref()
            if hooks is not None and h.id in hooks:
                first = next(iter(hooks)) == h.id
                self.parked_hooks.append((hooks, h.id, hooks.pop(h.id), first))

    def unpark_hooks(self) -> None:
        """Put parked hooks back where they were (a pre-hook registered first goes first)."""
        parked, self.parked_hooks = self.parked_hooks, []
        for hooks, key, hook, first in parked:
            hooks[key] = hook
            if first:
                hooks.move_to_end(key, last=False)

    def install(self) -> int | None:
        """Global module hooks put every module call of the program on nn.Module's slow path (~4 us each,
        measured in benchmarks/overhead.py), so they are used only in step 0 to find the top-level modules; after
        that the forward hooks sit on those root modules alone. Forward spans after step 0 therefore come from the
        modules that were top-level in step 0 (a model first called later is not timed as ``forward``).
        Dynamo traces module hooks into its graphs and guards on the global ones, so they also leave for the roots
        as soon as Dynamo starts to compile (the recorder's on_compile_start): no graph is ever traced with them."""
        from torch.nn.modules import module as nn_module

        if self.roots is None:
            self.module_handles[:] = [nn_module.register_module_forward_pre_hook(self.fwd_pre_hook),
                                      nn_module.register_module_forward_hook(self.fwd_hook)]
            self.global_hooks_on = True
            return None
        else:
            # the roots and, of the trained ones, the modules they wrap: a framework evaluates the unwrapped model
            # (the Hugging Face Trainer calls DDP's module directly); inside the wrapper's training forward their
            # hooks are parked (fwd_pre_hook), so the wrapped module's calls take nn.Module's fast path. A module
            # compiled with Module.compile() is timed by its call wrapper (compile_watch.py): hooks on it would
            # run inside its graph.
            handles: dict = {}
            self.wrapped_handles = {}
            for m in list(self.roots):
                wrapped = wrapped_modules(m) if id(m) in self.trained else []
                for w in (m, *wrapped):
                    if id(w) not in handles and id(w) not in self.compiled_roots:
                        handles[id(w)] = [w.register_forward_pre_hook(self.fwd_pre_hook, prepend=True,
                                                                      with_kwargs=True),
                                          w.register_forward_hook(self.fwd_hook)]
                if wrapped:
                    self.wrapped_handles[id(m)] = [h for w in wrapped for h in handles.get(id(w), ())]
            self.module_handles[:] = [h for hs in handles.values() for h in hs]
            self.global_hooks_on = False
            # forwards under way when the global hooks left: only those with a hook of their own will call fwd_hook
            depth = sum(1 for mid in self.in_flight if mid in handles or mid in self.compiled_roots)
            self.in_flight = []
            return depth


    def remove(self) -> None:
        for h in self.module_handles:
            h.remove()
        self.module_handles.clear()
        self.wrapped_handles = {}
        self.parked_hooks = []

    def to_roots(self) -> int | None:
        """The global hooks (installed while ``roots`` was None) move to the roots; returns the forwards under way
        that will still call the forward hook (None: they had moved already)."""
        if not self.global_hooks_on:
            return None
        if self.roots is None:             # a compile before any module ran: no root known yet
            import weakref

            self.roots = weakref.WeakSet()
        self.remove()
        return self.install()


def wrapped_modules(module) -> list:
    """The modules a wrapper holds as ``.module`` (DDP, DataParallel, FSDP1, DeepSpeed's engine), outermost first.
    Not what a torch.compile'd module holds (it forwards ``.module`` to the module it compiled): Dynamo traces
    that one, and a hook on it would be traced into the graph."""
    out: list = []
    m = module
    while "_orig_mod" not in getattr(m, "_modules", ()) and len(out) < 4:
        m = getattr(m, "module", None)
        if not hasattr(m, "register_forward_pre_hook"):
            break
        out.append(m)
    return out
