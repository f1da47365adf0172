"""Functional collectives (``torch.ops._c10d_functional``) as one rank sees them: the collectives that DTensor,
tensor parallelism (``parallelize_module``), context parallelism and ``torch.distributed._functional_collectives``
issue. The runtime's Recorder makes one ``FunctionalHooks`` over the rank's ``RankContext`` and the
``CollectiveRows`` its ``CollectiveHooks`` write (collective_rows.py) and installs it; fault rules as in runtime.py.

Why intercept at the op namespace (torch 2.13, read from the installed sources)
- DTensor's redistribute (``placement_types.py``, ``_collective_utils.py``) calls the Python functions of
  ``torch.distributed._functional_collectives`` (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``
  ...), and every one of them calls ``torch.ops._c10d_functional.<op>(...)`` by attribute at call time. The
  backward formulas of those ops (``torch.library.register_autograd`` in the same file) call the same attributes.
  ``torch.distributed`` Python functions are *not* on this path (torch-facts: "DTensor / tensor parallel: not seen").
- So we replace the cached ``OpOverloadPacket`` attributes of the namespaces ``torch.ops._c10d_functional`` and
  ``torch.ops._c10d_functional_autograd`` with a thin proxy (``_OpProxy``): calling it records a row; every other
  attribute (``.default``, overloads, ``_schema``) and hashing/equality go to the real packet, so code holding
  ``.default`` overloads or using packets as dict keys (CommDebugMode) still works. A TorchDispatchMode would see
  the same ops but puts every aten op of the program through Python; the proxy costs nothing for other ops.
- Not seen: code that calls an ``OpOverload`` it fetched itself (``torch.ops._c10d_functional.all_reduce.default``),
  collectives issued from C++ (the legacy ``_c10d_functional_autograd`` ops' backward), and compiled graphs
  (calls while tracing/compiling pass straight through: the compiled program's collectives are not recorded).

Rows (same columns as other collectives; docs/run-format.md)
- ``op`` canonical, ``api`` = the functional op's name (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``all_reduce`` ...; ``<name>_autograd`` for the ``_c10d_functional_autograd`` namespace), ``source``
  "functional", ``async_op`` True.
- ``group``: the op's ``group_name`` argument resolved to its ProcessGroup and named by
  ``CollectiveRows.group`` (the name the groups table uses; a new group gets its groups row there);
  ``seq`` from ``CollectiveRows.where`` (one counter per group, shared with ``torch.distributed`` calls).
- ``in_bytes`` from the input tensor(s), ``out_bytes`` from the op's returned tensor(s) (so all_gather's output is
  group_size × input, reduce_scatter's is input ÷ group_size, all_to_all's follows its split sizes).
- ``issue_ns``/``return_ns``: the op call; ``end_ns``: when ``wait_tensor`` on its output (matched by the output's
  storage) returned. Each such wait is also a ``comm_wait`` span named "wait_tensor", and ``RankContext.collective``
  names the op while the main thread waits. A coalesced op completes at the wait on its first output. Rows never
  waited are written with ``end_ns`` null at exit (``CollectiveRows.expire_pending``).
"""
from __future__ import annotations

import time
from typing import Any

from dtprof.collectors.collective_rows import dtype_name, nbytes_list

now = time.monotonic_ns

# op name -> (canonical op, position of the group_name argument)
_OPS = {
    "all_reduce": ("all_reduce", 2),
    "all_reduce_": ("all_reduce", 2),
    "all_reduce_coalesced": ("all_reduce", 2),
    "all_reduce_coalesced_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2),
    "all_gather_into_tensor_out": ("all_gather", 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_tensor_out": ("reduce_scatter", 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2),
    "broadcast_": ("broadcast", 2),
}
_AUTOGRAD_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _tensors(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _storage_key(t):
    """Completion key of a collective output: its storage (views of the output wait on the same storage)."""
    try:
        return ("functional", t.untyped_storage().data_ptr())
    except Exception:
        return None


def _resolve_group(group_name):
    import torch.distributed.distributed_c10d as c10d

    if isinstance(group_name, str):
        return c10d._resolve_process_group(group_name)
    return group_name           # a ProcessGroup passed directly


class FunctionalHooks:
    """The recording proxies in the functional-collective namespaces, and DeviceMesh naming (collectors/mesh.py),
    for one rank: rows go through its ``CollectiveRows`` (``collectives``), which names groups and counts seq for
    every collective hook. ``install`` never raises; ``remove`` puts torch's packets back."""

    def __init__(self, ctx, rows) -> None:
        self.ctx = ctx
        self.collectives = rows       # the rank's CollectiveRows (collective_rows.py)
        self.tracing: Any = None      # torch.distributed._functional_collectives._are_we_tracing, bound at install
        self.replaced: list = []      # (namespace, name, packet) replaced by a proxy
        self.mesh: Any = None         # the DeviceMesh hooks (collectors/mesh.py)

    def record(self, api, op, group_arg, args, kwargs, result, issue, ret) -> None:
        ins = _tensors(args[0])
        outs = _tensors(result)
        first_in = ins[0] if ins else None
        peer = None
        if op == "broadcast":
            import torch.distributed as dist

            pg = _resolve_group(group_arg)
            peer = dist.get_global_rank(pg, int(args[1])) if len(args) > 1 else None
        else:
            pg = _resolve_group(group_arg)
        hooks = self.collectives
        row = hooks.make_row(op, api, "functional", hooks.where(op, pg, peer), nbytes_list(ins), nbytes_list(outs),
                             dtype_name(first_in), peer, True, issue, ret)
        key = _storage_key(outs[0]) if outs else None
        if key is None:
            self.ctx.append_collective(row)
            return
        old = hooks.pending.pop(key, None)
        if old is not None:        # that storage was never waited on and got reused: keep the old rows, end unknown
            self.ctx.extend("collectives", old[1])
        hooks.add_pending(key, None, [row])

    def on_wait(self, tensor, orig):
        """wait_tensor: completes the pending functional collective whose output this tensor is."""
        ctx = self.ctx
        if ctx.disabled or not ctx.active or self.tracing():
            return orig(tensor)
        try:
            key = _storage_key(tensor)
            rows = self.collectives.pending_rows(key) if key is not None else None
            t0 = now()
            if rows is not None:
                ctx.collective = (rows[0], t0)
        except Exception:
            ctx.fault("functional wait_tensor")
            return orig(tensor)
        try:
            return orig(tensor)
        finally:
            try:
                if rows is not None:
                    ctx.collective = None
                    t1 = now()
                    ctx.last_progress_ns = t1
                    self.collectives.complete(key, t1)
                    ctx.span("comm_wait", "wait_tensor", t0, t1)
            except Exception:
                ctx.fault("functional wait_tensor")

    def call(self, packet, spec, args, kwargs):
        """A call of a proxied packet: recorded, unless dtprof is off or the call is being traced."""
        ctx = self.ctx
        if ctx.disabled or not ctx.active or self.tracing():
            return packet(*args, **kwargs)
        api, op, group_pos = spec
        if api == "wait_tensor":
            return self.on_wait(args[0] if args else kwargs["tensor"], packet)
        issue = now()
        result = self.collectives.call_recorded(packet, *args, **kwargs)
        try:
            ret = now()
            ctx.last_progress_ns = ret
            group_arg = args[group_pos] if len(args) > group_pos else kwargs.get("group_name")
            self.record(api, op, group_arg, args, kwargs, result, issue, ret)
        except Exception:
            ctx.fault(f"functional collective ({api})")
        return result

    def install(self) -> None:
        """The runtime's single hook-in for hybrid jobs: functional collectives and DeviceMesh naming. Never
        raises: what cannot be installed is an events warning row."""
        from dtprof.collectors.mesh import MeshHooks

        self.mesh = MeshHooks(self.ctx, self.collectives)
        for name, installer in (("dtprof.collectors.hooks_functional.FunctionalHooks.install_functional",
                                 self.install_functional),
                                ("dtprof.collectors.mesh.MeshHooks.install", self.mesh.install)):
            try:
                installer()
            except Exception as e:
                self.ctx.event("warning", f"{name} unavailable: {type(e).__name__}: {e}")

    def install_functional(self) -> None:
        """Replace the functional-collective packets with recording proxies (once)."""
        if self.replaced:
            return
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import _functional_collectives as funcol  # registers the ops' Python parts

        self.tracing = funcol._are_we_tracing
        plan = [("_c10d_functional", name, name, spec) for name, spec in _OPS.items()]
        plan.append(("_c10d_functional", "wait_tensor", "wait_tensor", (None, None)))
        plan += [("_c10d_functional_autograd", name, name + "_autograd", _OPS[name]) for name in _AUTOGRAD_OPS]
        for namespace, name, api, (op, group_pos) in plan:
            ns = getattr(torch.ops, namespace)
            try:
                packet = getattr(ns, name)
            except AttributeError:
                continue
            if isinstance(packet, _OpProxy):
                continue
            setattr(ns, name, _OpProxy(packet, (api, op, group_pos), self))
            self.replaced.append((ns, name, packet))

    def remove(self) -> None:
        """torch's packets and DeviceMesh back."""
        for ns, name, packet in self.replaced:
            setattr(ns, name, packet)
        self.replaced.clear()
        if self.mesh is not None:
            self.mesh.remove()


class _OpProxy:
    """Stands in for one OpOverloadPacket in its ``torch.ops`` namespace: calls are recorded, everything else is
    the packet's."""

    def __init__(self, packet, spec, hooks):
        self._dtprof_packet = packet
        self._dtprof_spec = spec            # (api, canonical op, position of the group_name argument)
        self._dtprof_hooks = hooks

    def __getattr__(self, name):
        return getattr(self._dtprof_packet, name)

    def __hash__(self):
        return hash(self._dtprof_packet)

    def __eq__(self, other):
        return other is self or other is self._dtprof_packet

    def __repr__(self):
        return repr(self._dtprof_packet)

    def __call__(self, *args, **kwargs):
        return self._dtprof_hooks.call(self._dtprof_packet, self._dtprof_spec, args, kwargs)
