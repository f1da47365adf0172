"""Out-of-memory error messages: what was requested and what the allocator had (stdlib only: the rank side uses it
at exit, triage on the logs and dumps).

Formats read:
- the CPU allocator (c10/core/impl/alloc_cpu.cpp): "DefaultCPUAllocator: can't allocate memory: you tried to
  allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)";
- CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp), torch >= 2.1: "CUDA out of memory. Tried to allocate
  2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.23 GiB is free. [Process N has X memory in use.]
  [Including non-PyTorch memory, this process has X memory in use.] Of the allocated memory X is allocated by
  PyTorch, and X is reserved by PyTorch but unallocated." (2.1 spelled "capacty");
- torch < 2.1: "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already
  allocated; 3.44 MiB free; 14.71 GiB reserved in total by PyTorch)"; HIP's messages say "HIP out of memory".
"""
from __future__ import annotations

import re

_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_CPU = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_GPU = re.compile(r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE)
_FIELDS = {
    "device_total_bytes": (re.compile(r"total capac\w+ of " + _SIZE), re.compile(_SIZE + r" total capacity")),
    "device_free_bytes": (re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free\b")),
    "process_bytes": (re.compile(r"this process has " + _SIZE + r" memory in use"),),
    "allocated_bytes": (re.compile(_SIZE + r" is allocated by PyTorch"), re.compile(_SIZE + r" already allocated")),
    "reserved_unallocated_bytes": (re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),),
    "reserved_bytes": (re.compile(_SIZE + r" reserved in total by PyTorch"),),
}
_GPU_INDEX = re.compile(r"GPU (\d+)")


def _bytes(m) -> int:
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse(message: str) -> dict | None:
    """The figures of an out-of-memory message: ``kind`` ("cpu" or "cuda"), ``requested_bytes`` and, where the
    message gives them, ``device_total_bytes``, ``device_free_bytes``, ``process_bytes``, ``allocated_bytes``,
    ``reserved_bytes``, ``reserved_unallocated_bytes``, ``gpu``; None when it is not an out-of-memory message."""
    m = _CPU.search(message)
    if m:
        return {"kind": "cpu", "requested_bytes": int(m.group(1))}
    m = _GPU.search(message)
    if not m:
        return None
    out: dict = {"kind": "cuda", "requested_bytes": _bytes(m)}
    rest = message[m.end():]
    for key, pats in _FIELDS.items():
        for pat in pats:
            f = pat.search(rest)
            if f:
                out[key] = _bytes(f)
                break
    if "reserved_bytes" not in out and "allocated_bytes" in out and "reserved_unallocated_bytes" in out:
        out["reserved_bytes"] = out["allocated_bytes"] + out["reserved_unallocated_bytes"]
    g = _GPU_INDEX.search(rest)
    if g:
        out["gpu"] = int(g.group(1))
    return out


def in_chain(exc) -> tuple[BaseException, dict] | tuple[None, None]:
    """The out-of-memory error an exception is or wraps (its ``__cause__``/``__context__`` chain: a pipelining stage
    raises its own RuntimeError "from" the model's error), with its figures; (None, None) when none is."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parsed = parse(str(exc))
        if parsed is not None:
            return exc, parsed
        exc = exc.__cause__ or exc.__context__
    return None, None
