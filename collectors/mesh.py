"""DeviceMesh awareness: name each mesh dimension's process group and record the mesh shape.

Installed with the functional-collective hooks (``FunctionalHooks.install``), as a ``MeshHooks`` object.
``DeviceMesh.__init__`` is wrapped; after a *root* mesh (one built by ``init_device_mesh`` or ``DeviceMesh(...)``,
not a slice such as ``mesh["tp"]``) has created its process groups, this rank records:
- for each mesh dimension, the group this rank belongs to along it, as a ``groups`` row with ``mesh_dim`` = the
  dimension's name: the user's ``mesh_dim_names`` (conventionally ``dp``, ``tp``, ``pp``, ``cp``) or ``dim<i>``
  when the mesh has no names. The group's first row (written by ``CollectiveRows.group`` when the group is
  first seen, ``mesh_dim`` empty) stays; readers take the last non-empty ``mesh_dim`` per (rank, group)
  (docs/run-format.md).
- one ``mesh`` meta row {"shape": [2, 2], "dims": ["dp", "tp"]}.
A mesh dimension of size 1 still gets its row (its group has one rank). Faults disable dtprof on the rank as in
runtime.py; the mesh itself is never affected (the original ``__init__`` has already returned).
"""
from __future__ import annotations

from typing import Any

from dtprof.collectors.records import Group


def dim_names(mesh) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"dim{i}" for i in range(mesh.ndim))


class MeshHooks:
    """``DeviceMesh.__init__`` wrapped for one rank (its ``RankContext``); groups are named through its
    ``CollectiveRows``."""

    def __init__(self, ctx, rows) -> None:
        self.ctx = ctx
        self.collectives = rows       # the rank's CollectiveRows: names the groups
        self.announced: set = set()       # (shape, dims) already written on this rank
        self.patched: Any = None          # (DeviceMesh, its own __init__) while installed

    def record_mesh(self, mesh) -> None:
        """Write the groups rows and the meta row for ``mesh`` (once per shape and names)."""
        ctx = self.ctx
        if ctx.disabled or not ctx.active:
            return
        if getattr(mesh, "_root_mesh", None) is not None:
            return                                  # a slice of a mesh already recorded
        shape = tuple(int(s) for s in mesh.shape)
        dims = dim_names(mesh)
        if (shape, dims) in self.announced:
            return
        if mesh.get_coordinate() is None:
            return                                  # this rank is not in the mesh
        self.announced.add((shape, dims))
        import torch.distributed as dist

        for i, dim in enumerate(dims):
            pg = mesh.get_group(i)
            name, size = self.collectives.group(pg)[:2]
            ranks = dist.get_process_group_ranks(pg)
            try:
                backend = str(dist.get_backend(pg))
            except Exception:
                backend = ""
            ctx.add(Group(rank=ctx.rank, group=name, ranks=",".join(map(str, ranks)), size=size, backend=backend,
                          desc=str(getattr(pg, "group_desc", "") or ""), mesh_dim=dim))
        ctx.meta("mesh", {"shape": list(shape), "dims": list(dims)})

    def wrap_init(self, orig):
        ctx = self.ctx

        def __init__(mesh, *args, **kwargs):
            orig(mesh, *args, **kwargs)
            if ctx.disabled or not ctx.active or not kwargs.get("_init_backend", True):
                return
            try:
                self.record_mesh(mesh)
            except Exception:
                ctx.fault("device mesh")

        __init__.__wrapped__ = orig
        __init__.__doc__ = orig.__doc__
        return __init__

    def install(self) -> None:
        """Wrap DeviceMesh.__init__."""
        if self.patched is not None:
            return
        from torch.distributed import device_mesh

        cls = getattr(device_mesh, "DeviceMesh", None)
        if cls is None or not hasattr(cls, "get_group"):     # torch without distributed support: a stub
            return
        self.patched = (cls, cls.__init__)
        cls.__init__ = self.wrap_init(cls.__init__)

    def remove(self) -> None:
        if self.patched is not None:
            cls, init = self.patched
            cls.__init__ = init
            self.patched = None
