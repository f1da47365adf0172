"""The analysis's options: everything it depends on besides the run's tables, in one documented object.

``analyze(run, options)`` reads nothing else: no files outside the run, no environment. The command-line edge
(``dtprof.options.resolve_options``: ``dtprof summary``, ``dtprof report``, ``dtprof compare``, the launcher)
fills it from the command line, the run's recorded launcher config (node.json ``config``) and the device peaks it
resolves (``--peak-tflops``, a stored ``dtprof calibrate`` figure, the spec table), each peak with its source;
summary.json ``options`` records the object as used.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
TRANSFORMER_KEYS = ("n_params", "layers", "heads", "head_dim", "seq_len")


@dataclass(frozen=True)
class DevicePeak:
    tflops: float | None
    """Dense peak TFLOP/s of one device of this name for ``AnalysisOptions.dtype``; None when unknown."""
    source: str = ""
    """Where ``tflops`` came from: "user: ...", "calibrated on <date> ...", "spec sheet ..."."""
    reason: str = ""
    """Why ``tflops`` is None (e.g. a CPU has no spec peak)."""

    def __post_init__(self):
        if self.tflops is not None and not self.tflops > 0:
            raise ValueError(f"peak {self.tflops!r} TFLOP/s: must be positive")
        if self.tflops is None and not self.reason:
            raise ValueError("an unknown peak needs its reason")


@dataclass(frozen=True)
class AnalysisOptions:
    warmup: int | None = None
    """Leading steps excluded from step statistics; None: detected (analyzers/steps.py)."""
    flops_per_step: float | None = None
    """Model FLOPs of one step of the whole job (all ranks together), for MFU; None: from the run (analyzers/mfu.py)."""
    dtype: str = "bf16"
    """The dtype whose peak MFU divides by: one of DTYPES."""
    transformer: dict | None = None
    """A transformer's shape for the PaLM FLOPs formula: keys TRANSFORMER_KEYS, numbers."""
    peaks: dict[str, DevicePeak] = field(default_factory=dict)
    """Device name (``ranks.device_name``) -> its peak, resolved at the command-line edge. A device with no entry has
    no known peak (MFU is null, saying so)."""
    gpu_window: str = "all"
    """Which kernels ``ranks[i].gpu_time`` counts: "all" (every kernel span) or "hta" (HolisticTraceAnalysis'
    window: kernels launched before the rank's last ProfilerStep; analyzers/kernel_breakdown.py WINDOWS)."""

    straggler_min_saving: float = 0.05
    """A rank is a persistent straggler only when removing its extra work saves at least this share of the step
    (analyzers/stragglers.py, from the what-if model of analyzers/whatif.py)."""

    def __post_init__(self):
        if not 0 < self.straggler_min_saving < 1:
            raise ValueError(f"straggler_min_saving {self.straggler_min_saving!r}: must be between 0 and 1")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            raise ValueError(f"warmup {self.warmup!r}: must be a whole number >= 0")
        if self.flops_per_step is not None and not self.flops_per_step > 0:
            raise ValueError(f"flops_per_step {self.flops_per_step!r}: must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.transformer is not None:
            missing = [k for k in TRANSFORMER_KEYS if k not in self.transformer]
            if missing:
                raise ValueError(f"transformer: needs {', '.join(missing)}")
        if self.gpu_window not in ("all", "hta"):
            raise ValueError(f"gpu_window {self.gpu_window!r}: must be 'all' or 'hta'")
        for name, p in self.peaks.items():
            if not isinstance(p, DevicePeak):
                raise ValueError(f"peaks[{name!r}]: must be a DevicePeak")

    def record(self) -> dict:
        """The options as summary.json ``options`` records them (peaks with their sources)."""
        return asdict(self)
