"""DeviceMesh awareness: name each mesh dimension's process group and record the mesh shape.

Installed by ``runtime.init`` (through ``hooks_functional``'s hook-in). ``DeviceMesh.__init__`` is wrapped; after a
*root* mesh (one built by ``init_device_mesh`` or ``DeviceMesh(...)``, not a slice such as ``mesh["tp"]``) has
created its process groups, this rank records:
- for each mesh dimension, the group this rank belongs to along it, as a ``groups`` row with ``mesh_dim`` = the
  dimension's name: the user's ``mesh_dim_names`` (conventionally ``dp``, ``tp``, ``pp``, ``cp``) or ``dim<i>``
  when the mesh has no names. The group's first row (written by ``hooks_collectives._group`` when the group is
  first seen, ``mesh_dim`` empty) stays; readers take the last non-empty ``mesh_dim`` per (rank, group)
  (docs/run-format.md).
- one ``mesh`` meta row {"shape": [2, 2], "dims": ["dp", "tp"]}.
A mesh dimension of size 1 still gets its row (its group has one rank). Faults disable dtprof on the rank as in
runtime.py; the mesh itself is never affected (the original ``__init__`` has already returned).
"""
from __future__ import annotations

from typing import Any

from dtprof.collectors import hooks_collectives as hc
from dtprof.collectors.records import Group

_installed = False
_rec: Any = None             # the runtime's Recorder, given by install (this module never imports the runtime)
_announced = set()          # (shape, dims) already written on this rank


def dim_names(mesh) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else tuple(f"dim{i}" for i in range(mesh.ndim))


def record_mesh(mesh) -> None:
    """Write the groups rows and the meta row for ``mesh`` (once per shape and names)."""
    state = _rec
    if state.disabled or not state.active:
        return
    if getattr(mesh, "_root_mesh", None) is not None:
        return                                  # a slice of a mesh already recorded
    shape = tuple(int(s) for s in mesh.shape)
    dims = dim_names(mesh)
    if (shape, dims) in _announced:
        return
    if mesh.get_coordinate() is None:
        return                                  # this rank is not in the mesh
    _announced.add((shape, dims))
    import torch.distributed as dist

    for i, dim in enumerate(dims):
        pg = mesh.get_group(i)
        name, size = hc._group(pg)[:2]
        ranks = dist.get_process_group_ranks(pg)
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = ""
        state.add(Group(rank=state.rank, group=name, ranks=",".join(map(str, ranks)), size=size, backend=backend,
                        desc=str(getattr(pg, "group_desc", "") or ""), mesh_dim=dim))
    state.meta("mesh", {"shape": list(shape), "dims": list(dims)})


def _wrap_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if _rec.disabled or not _rec.active or not kwargs.get("_init_backend", True):
            return
        try:
            record_mesh(self)
        except Exception:
            _rec.fault("device mesh")

    __init__.__wrapped__ = orig
    __init__.__doc__ = orig.__doc__
    return __init__


def install(rec) -> None:
    """Wrap DeviceMesh.__init__, recording into ``rec`` (the runtime's Recorder)."""
    global _installed, _rec
    _rec = rec
    if _installed:
        return
    from torch.distributed import device_mesh

    cls = getattr(device_mesh, "DeviceMesh", None)
    if cls is None or not hasattr(cls, "get_group"):     # torch without distributed support: a stub
        return
    cls.__init__ = _wrap_init(cls.__init__)
    _installed = True
