"""A step's peak memory: the ``steps`` table's ``peak_mem_bytes`` (runtime.py's module docstring, "Steps").

On CUDA the allocator's peak since the last step's end (``torch.cuda.max_memory_allocated``, then reset); on CPU the
process's resident high-water mark, which only grows.
"""
from __future__ import annotations

import resource
import time

now = time.monotonic_ns
RSS_READ_INTERVAL_NS = 50_000_000   # on CPU: at most one getrusage per 50 ms


def rss_high_water_bytes() -> int:
    """The process's resident high-water mark: a system call that sums over all its threads (~10 us on the training
    thread of a busy 2-core VM, timed in a tiny DDP step)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux reports KiB


class PeakMemory:
    def __init__(self, cuda):
        self.cuda = cuda                          # the step clock's CudaTiming: ``on`` once CUDA is in use
        self.rss_read_ns = -RSS_READ_INTERVAL_NS  # when the RSS high-water mark was last read (CPU)
        self.rss_peak = 0

    def read(self) -> int:
        if self.cuda.on:
            import torch

            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return int(peak)
        # the value only grows, so steps under RSS_READ_INTERVAL_NS apart reuse the last reading
        t = now()
        if t - self.rss_read_ns >= RSS_READ_INTERVAL_NS:
            self.rss_read_ns = t
            self.rss_peak = rss_high_water_bytes()
        return self.rss_peak
