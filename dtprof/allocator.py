"""The analysis process keeps the memory it frees, for its next arrays.

glibc gives every allocation of 32 MiB and more its own mapping and unmaps it when freed, so each new large array
(a column or a temporary of millions of rows) is faulted in again page by page, and the kernel zeroes every page
first. At 16,384 ranks x 1,000 steps that zeroing was a fifth of the analysis' CPU time (perf: clear_page_erms
under huge-page faults of numpy's temporaries), with about a million page faults. With mmap off and trimming off,
freed memory returns to glibc's heap and is reused (docs/scale.md has the measurements).

Only dtprof's own short-lived command processes call this (dtprof/cli.py): never the training job's processes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4   # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and never give freed memory back to the kernel (glibc's mallopt);
    False where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # each returns 1 on success; the heap grows 1 GiB at a time (fewer brk calls), and is trimmed only past 2 GiB free
    # at its top (the largest threshold an int carries)
    return all(mallopt(p, v) == 1 for p, v in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1),
                                               (M_TOP_PAD, 1 << 30)))
