"""Rank-side parts: each owns one concern of what dtprof does inside a rank, over a narrow ``RankContext``.

A part never sees the ``Recorder`` (collectors/runtime.py). It is given a ``RankContext`` at ``install`` and
hears of the rank's progress through the few callbacks below, each optional: the recorder calls only the ones a
part's class overrides, so a part costs the hot path nothing it does not use. Every callback runs under
try/except in the recorder: a part that raises is switched off with a ``fault`` naming it, and training goes on.

Where the callbacks run
- ``install(ctx)``: the training thread, once, when the rank starts recording (torch imported, the writer open).
- ``on_backward(tensors)``: the training thread, at each top-level ``torch.autograd.backward`` /
  ``Tensor.backward`` of a detailed step, before it runs; ``tensors`` is what backward was called on.
- ``on_optimizer_pre_step(optimizer)``: the training thread, before a ``torch.optim`` optimizer step of a detailed
  step (not in an A/B "off" block), where its gradients are final (after DDP's all-reduce, before the update).
- ``optimizer_step_pending(optimizer) -> bool``: the training thread, after each ``torch.optim`` optimizer step:
  True when that step is one parameter group of an optimizer step that goes on (an engine that steps its groups
  one at a time, DeepSpeed ZeRO: collectors/engine_deepspeed.py); the step clock then waits for the last group.
- ``on_optimizer_group(optimizer)``: the training thread, after each such group before the last (a part said
  pending); the last group's is ``on_optimizer_step``. Only in jobs with such a part.
- ``on_optimizer_step(optimizer)``: the training thread, after each ``torch.optim`` optimizer step (the last group's
  of a grouped one) and before the step it ends is closed (``ctx.step`` is still that step); every step, detailed
  or not (but see ``every_step``): keep it cheap.
- ``on_step_end(step, t_ns, detailed)``: the training thread, after step ``step``'s row was appended.
- ``every_step = False`` (a class attribute): the part's ``on_optimizer_step`` and ``on_step_end`` run on detailed
  steps only. A part with nothing to do on a boundary-only step sets it: a step of a fraction of a millisecond
  pays each call (~1-2 µs with its dispatch on a busy 2-core VM), and most of a sampled job's steps are
  boundary-only.
- ``on_detail(on)``: the training thread, when sampling switches full detail on or off for the following steps.
- ``on_flush()``: the flusher thread, before the writer flushes (once a second): the place for slow work.
- ``on_exit()``: at exit (atexit or SIGTERM), before the final flush.

Rules (docs/architecture.md, "Rank-side rules"): no graph break, recompile or host-device sync; nothing on the
training thread that waits on the network, the disk or another process; cost bounded per step (use ``ctx.detail``
or ``detailed`` to do expensive work on sampled steps only).

To add a part: write its class in its own module under collectors/, and add its factory to ``PART_FACTORIES``. A
part for one library names it (``lazy_part(..., when_imported="deepspeed")``): it is made when the job imports that
library (at the rank's start if it already has), and never in a job that does not: no cost there.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import time
from typing import Callable

now = time.monotonic_ns


class RankContext:
    """What a part or a hook object may know and do: the rank's identity, the step in progress, whether it is
    recorded in full detail, whether dtprof records at all, and the run format's writers. The recorder keeps the
    mutable fields current; a hook object sets ``collective`` and ``last_progress_ns`` (what the heartbeat reports).
    It is the one place these flags live: the recorder reads them here too."""

    __slots__ = ("rank", "host", "rank_dir", "options", "step", "detail", "active", "disabled", "fault_test",
                 "collective", "last_progress_ns", "add", "fault", "event", "_meta", "append_span",
                 "append_collective", "extend", "span", "refresh_identity", "group", "roots", "hold_step_end",
                 "end_held_step")

    def __init__(self, rank: int, host: str, rank_dir: str, options: dict, add: Callable, fault: Callable,
                 event: Callable, meta: Callable):
        self.rank = rank
        self.host = host
        self.rank_dir = rank_dir
        self.options = options
        self.step = 0               # the step in progress
        self.detail = True          # the step in progress is recorded in full detail
        self.active = False         # recording (False before start, and during an A/B "off" block)
        self.disabled = False       # a fault switched dtprof off for this rank: every hook passes through
        self.fault_test = ""        # tests only: DTPROF_TEST_FAULT=<hook>[@<rank>] injects a fault ("collective", ...)
        self.collective = None      # (row or its first columns, entered_ns) of the collective the main thread is in
        self.last_progress_ns = 0   # the main thread's last sign of progress (the heartbeat's hang evidence)
        self.add = add              # add(row): one typed row (collectors/records.py) to its table
        self.fault = fault          # fault(where): dtprof's own fault, switching the rank's recording off
        self.event = event          # event(level, message): an events row
        self._meta = meta
        # set when the rank starts (the writer open): the hot paths' appends, without a table lookup per row
        self.append_span = None         # append_span(row): a spans row (records.span_row)
        self.append_collective = None   # append_collective(row): a collectives row (records.collective_row)
        self.extend = None              # extend(table, rows): several rows of one table
        self.span = None                # span(kind, name, t0, t1, ...): a spans row of the step in progress
        self.refresh_identity = None    # refresh_identity(): rank.json recomputed (after init_process_group)
        self.group = None               # group(pg) -> (name, size, pg, seq counter): a process group, named once
        self.roots = None               # roots() -> the top-level modules step 0's forwards ran (may be empty)
        # an engine's own step call runs (DeepSpeed's engine.step(): collectors/engine_deepspeed.py): an optimizer
        # step inside it ends the step only when the part that raised this calls end_held_step() as the call returns
        self.hold_step_end = False
        self.end_held_step = None       # end_held_step(): the step clock's (stepclock.py)

    def meta(self, kind: str, value: dict) -> None:
        """One structured fact (the ``meta`` table; kinds in dtprof.rundir.schema.META_KINDS)."""
        self._meta(kind, value)


class StepFlags:
    """The per-step state the step clock (collectors/stepclock.py) shares with the DDP and pipelining hooks: each
    side sets what it knows, the other reads it. Given to both; held by neither's other."""

    __slots__ = ("in_backward", "pp_active", "ddp_last_issue_ns", "ddp_next_bucket")

    def __init__(self):
        self.in_backward = False       # a top-level backward is running (the step clock's wrapper)
        self.pp_active = 0             # >0 while a pipeline schedule's step() runs (hooks_pipelining)
        self.ddp_last_issue_ns = None  # issue time of DDP's last bucket in the backward in progress (hooks_ddp)
        self.ddp_next_bucket = 0       # index of DDP's next bucket in the backward in progress (no comm hook)


class RankPart:
    """Base class of a rank-side part (module docstring). Override only the callbacks the part needs."""

    name = "part"
    every_step = True      # False: on_optimizer_step and on_step_end on detailed steps only (module docstring)

    def install(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def on_backward(self, tensors) -> None:
        pass

    def on_optimizer_pre_step(self, optimizer) -> None:
        pass

    def optimizer_step_pending(self, optimizer) -> bool:
        return False

    def on_optimizer_group(self, optimizer) -> None:
        pass

    def on_optimizer_step(self, optimizer) -> None:
        pass

    def on_step_end(self, step: int, t_ns: int, detailed: bool) -> None:
        pass

    def on_detail(self, on: bool) -> None:
        pass

    def on_flush(self) -> None:
        pass

    def on_exit(self) -> None:
        pass


CALLBACKS = ("on_backward", "on_optimizer_pre_step", "optimizer_step_pending", "on_optimizer_group",
             "on_optimizer_step", "on_step_end", "on_detail", "on_flush", "on_exit")


class Parts:
    """The parts of one rank and, per callback, the bound methods of the parts that override it (an empty tuple
    costs the hot path one truth test)."""

    optimizer_step_pending: tuple    # (rebind sets one tuple per callback, and the boundary_ ones)
    on_optimizer_step: tuple
    on_step_end: tuple
    boundary_optimizer_step: tuple   # on_optimizer_step and on_step_end of a boundary-only step: the parts'
    boundary_step_end: tuple         # with every_step (RankPart.every_step)

    on_rebind: Callable[[], None] | None = None   # told when the callbacks change (the step clock's boundary.refresh)

    def __init__(self, parts: list[RankPart], report: Callable, deferred: tuple = ()):
        self.parts = list(parts)
        self._report = report       # report(where): an events error row naming the part and the exception
        self.deferred = deferred    # (factory, options) of parts made when their library is imported
        self.ctx: RankContext | None = None
        self.rebind()

    def rebind(self) -> None:
        for cb in CALLBACKS:
            setattr(self, cb, tuple(getattr(p, cb) for p in self.parts
                                    if getattr(type(p), cb) is not getattr(RankPart, cb)))
        self.boundary_optimizer_step = tuple(m for m in self.on_optimizer_step if m.__self__.every_step)
        self.boundary_step_end = tuple(m for m in self.on_step_end if m.__self__.every_step)
        if self.on_rebind is not None:
            self.on_rebind()

    def install(self, ctx: RankContext) -> None:
        self.ctx = ctx
        for part in list(self.parts):
            try:
                part.install(ctx)
            except Exception:
                self.drop(part, "install")
        for factory, options in self.deferred:
            _on_import(factory.when_imported, functools.partial(self.add, factory, options))

    def add(self, factory: Callable, options: dict) -> None:
        """Make and install one part now (a deferred part, its library just imported)."""
        try:
            part = factory(options)
        except Exception:
            self._report(f"part {factory.__name__}")
            return
        if part is None or self.ctx is None:
            return
        try:
            part.install(self.ctx)
        except Exception:
            self._report(f"{part.name}.install")
            return
        self.parts.append(part)
        self.rebind()

    def pending(self, optimizer) -> bool:
        """A part says this torch optimizer step is a group of an optimizer step not over yet."""
        for m in self.optimizer_step_pending:
            try:
                if m(optimizer):
                    return True
            except Exception:
                self.drop(m.__self__, m.__name__)
        return False

    def call(self, methods: tuple, *args) -> None:
        """Call each of ``methods`` (one callback's tuple); a part that raises is dropped with a fault event."""
        for m in methods:
            try:
                m(*args)
            except Exception:
                self.drop(m.__self__, m.__name__)

    def drop(self, part: RankPart, where: str) -> None:
        """Switch off one part after its own fault; the recorder and the other parts go on."""
        try:
            self._report(f"{part.name}.{where}")
        except Exception:
            pass
        if part in self.parts:
            self.parts.remove(part)
            self.rebind()


def lazy_part(module: str, factory: str, when_imported: str | None = None) -> Callable[[dict], RankPart | None]:
    """A factory that imports ``module`` only when the rank starts (the rank side is imported before torch), or,
    with ``when_imported``, only once the job has imported that top-level package."""
    def make(options: dict):
        import importlib

        return getattr(importlib.import_module(module), factory)(options)

    make.__name__ = f"{module}.{factory}"
    make.when_imported = when_imported    # type: ignore[attr-defined]
    return make


class _OnImport:
    """A finder first on ``sys.meta_path`` that lets the others find ``name`` and calls ``callback`` once that
    package's ``__init__`` has run (then leaves). Asked only at a module's first import: nothing at run time. A
    look-up that imports nothing (``importlib.util.find_spec``, as transformers' ``is_deepspeed_available`` does)
    wraps a loader that never runs, and the finder stays for the real import."""

    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback
        self.busy = self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.busy or self.done:
            return None
        self.busy = True                     # the other finders' look-up asks this one again
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:
            return None                      # the import goes on without the part
        finally:
            self.busy = False
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            if self.done:
                return
            self.done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                self.callback()
            except Exception:
                pass          # Parts.add reports its own faults
        loader.exec_module = exec_then_call
        return spec


def _on_import(name: str, callback: Callable[[], None]) -> None:
    """``callback()`` now if the job has imported ``name``, else once it does."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _OnImport(name, callback))


# Each factory takes the rank's options and returns a part, or None when the part does not apply to this job.
# New rank-side concerns (an engine's hooks, the memory ledger, the numerics sentinel) are added here.
PART_FACTORIES: list[Callable[[dict], RankPart | None]] = [
    lazy_part("dtprof.collectors.memory", "make"),      # the memory ledger (issue 48)
    lazy_part("dtprof.collectors.numerics", "make"),    # loss, grad norm, lr, fingerprints (issue 49)
    lazy_part("dtprof.collectors.engine_deepspeed", "make", when_imported="deepspeed"),   # issue 47
]


def make_parts(options: dict, report: Callable) -> Parts:
    made, deferred = [], []
    for factory in PART_FACTORIES:
        if getattr(factory, "when_imported", None):
            deferred.append((factory, options))
            continue
        try:
            part = factory(options)
        except Exception:
            report(f"part {factory.__name__}")
            continue
        if part is not None:
            made.append(part)
    return Parts(made, report, tuple(deferred))
