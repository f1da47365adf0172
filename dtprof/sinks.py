"""Publishing live metrics: `dtprof run --metrics SINK` (docs/metrics-export.md names every series and its unit).

One ``Publisher`` per launcher (per node): a thread that asks ``dtprof.live.LiveNode`` what the ranks flushed
since its last poll, once a second, and hands it to each sink. Nothing of this runs in the training job.

Sinks: ``prometheus:[HOST:]PORT`` (an HTTP /metrics endpoint, 127.0.0.1 unless HOST is given), ``tensorboard:DIR``
(event files), ``wandb[:PROJECT]`` (a W&B run; ``WANDB_MODE=offline`` needs no network), ``mlflow[:URI]`` (an
MLflow run; a ``file:`` store works offline). Each library is an optional extra (``pip install dtprof[wandb]``).

Decisions
- A sink's library missing is a usage error (one line, exit 2) found before anything runs (``check_sinks``).
- Each sink has its own thread and queue: a sink that raises (port taken, disk full, W&B down) or stops keeping up
  (``QUEUE_MAX`` updates waiting) is reported in one line and dropped; the job, the run and the other sinks go on.
- Prometheus gets every step (a histogram and counters, so rates hold at any scrape interval) and the newest GPU
  sample. TensorBoard, W&B and MLflow store each point for good, so each gets at most one point per rank (and per
  GPU) per ``--metrics-interval`` (default 10 s: a week of 8 ranks stays in the tens of MB): the mean of the steps
  in it (tokens/s and MFU as totals over time, peak memory the max), logged at the last step's number. With steps
  longer than the interval, every step is a point.
- The Prometheus endpoint is served until `dtprof run` exits (after its analysis), so a scrape after the job's
  last step still finds the final values.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dtprof.cli import InputError

if TYPE_CHECKING:   # dtprof.live imports pandas: only once a publisher starts, not for checking the option
    from dtprof.live import GpuSample, NodeStatus, RankStep, Update

POLL_S = 1.0
QUEUE_MAX = 120          # updates waiting for one sink (two minutes at one a second) before it is dropped
CLOSE_TIMEOUT_S = 30.0   # the final flush of all sinks after the job, at most
# sink -> (module to find, the extra that installs it)
LIBRARIES = {"prometheus": ("prometheus_client", "prometheus"), "tensorboard": ("tensorboard", "tensorboard"),
             "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# nvml column -> (series name, scale): docs/metrics-export.md
GPU_SERIES = {
    "sm_util_pct": ("gpu_utilization_ratio", 0.01),
    "mem_bw_util_pct": ("gpu_memory_bandwidth_utilization_ratio", 0.01),
    "mem_used_bytes": ("gpu_memory_used_bytes", 1.0),
    "mem_total_bytes": ("gpu_memory_total_bytes", 1.0),
    "power_w": ("gpu_power_watts", 1.0),
    "temp_c": ("gpu_temperature_celsius", 1.0),
    "sm_clock_mhz": ("gpu_sm_clock_hertz", 1e6),
    "mem_clock_mhz": ("gpu_memory_clock_hertz", 1e6),
    "pcie_tx_bytes_s": ("gpu_pcie_tx_bytes_per_second", 1.0),
    "pcie_rx_bytes_s": ("gpu_pcie_rx_bytes_per_second", 1.0),
    "nvlink_tx_bytes_s": ("gpu_nvlink_tx_bytes_per_second", 1.0),
    "nvlink_rx_bytes_s": ("gpu_nvlink_rx_bytes_per_second", 1.0),
    "ecc_errors": ("gpu_ecc_uncorrected_errors", 1.0),
}


# ---- the option --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SinkSpec:
    kind: str
    target: str    # prometheus: "host:port"; tensorboard: a directory; wandb: a project or ""; mlflow: a URI or ""
    text: str      # as given

    def describe(self) -> str:
        return self.text


def parse_sink(text: str) -> SinkSpec:
    kind, _, target = text.partition(":")
    if kind not in LIBRARIES:
        raise InputError(f"--metrics {text!r}: unknown sink; expected prometheus:[HOST:]PORT, tensorboard:DIR, "
                         "wandb[:PROJECT] or mlflow[:URI]")
    if kind == "prometheus":
        host, _, port = target.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if not port.isdigit() or int(port) > 65535:
            raise InputError(f"--metrics {text!r}: expected prometheus:PORT or prometheus:HOST:PORT (a port 0-65535)")
        target = f"{host}:{int(port)}"
    elif kind == "tensorboard" and not target:
        raise InputError(f"--metrics {text!r}: expected tensorboard:DIR (the directory for the event files)")
    return SinkSpec(kind, target, text)


def check_sinks(texts) -> list[SinkSpec]:
    """The sinks of ``--metrics``, each checked before anything runs: its syntax and that its library imports
    (without importing it: a W&B or MLflow import costs seconds)."""
    specs = [parse_sink(t) for t in texts]
    for spec in specs:
        module, extra = LIBRARIES[spec.kind]
        if importlib.util.find_spec(module) is None:
            raise InputError(f"--metrics {spec.text}: the {module} library is not installed; "
                             f"pip install 'dtprof[{extra}]' (nothing was run)")
    return specs


# ---- the publisher -----------------------------------------------------------------------------------------------

@dataclass
class Context:
    """What the sinks know about the run."""
    run_dir: Path
    node_dir: Path
    host: str
    config: dict
    interval_s: float
    say: Callable[[str], None]


class Publisher:
    """Polls the node's run directory once a second and feeds every sink (see the module docstring)."""

    def __init__(self, specs: list[SinkSpec], ctx: Context, warn: Callable[[str], None]):
        from dtprof.live import LiveNode

        self.ctx = ctx
        self.warn = warn
        self.live = LiveNode(ctx.node_dir, ctx.config, ctx.host)
        self.workers = [SinkWorker(make_sink(s, ctx), warn) for s in specs]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dtprof-metrics", daemon=True)
        self._broken = False
        self.cpu_s, self.polls, self.steps = 0.0, 0, 0

    def start(self) -> Publisher:
        for w in self.workers:
            w.start()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll(final=False)

    def _poll(self, final: bool) -> None:
        if self._broken:
            return
        t0 = time.thread_time()
        try:
            update = self.live.poll(final=final)
        except Exception as e:  # noqa: BLE001 -- whatever went wrong, the job and the run go on
            self._broken = True
            self.warn(f"dtprof: live metrics stopped: reading the run failed ({_why(e)}); the job and the run go on")
            return
        self.cpu_s += time.thread_time() - t0
        self.polls += 1
        self.steps += len(update.steps)
        for w in self.workers:
            w.put(update)

    def stop(self, exit_code: int) -> None:
        """After the job: publish what the ranks flushed last, close every sink (at most CLOSE_TIMEOUT_S)."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        self._poll(final=True)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for w in self.workers:
            w.finish(exit_code, max(0.0, deadline - time.monotonic()))

    def record(self) -> dict:
        """What publishing cost and how each sink fared, for node.json ``metrics``: the CPU time of the reading
        thread and of each sink's thread (their thread CPU clocks), steps published, polls."""
        return {"steps_published": self.steps, "polls": self.polls, "read_cpu_s": round(self.cpu_s, 3),
                "sinks": {w.sink.name: {"status": w.failure or "ok", "cpu_s": round(w.cpu_s, 3)}
                          for w in self.workers}}


_END = object()


class SinkWorker:
    """One sink in its own thread: its failures and its slowness stay its own."""

    def __init__(self, sink: Sink, warn: Callable[[str], None]):
        self.sink = sink
        self.warn = warn
        self.dead = False
        self.failure: str | None = None
        self.cpu_s = 0.0
        self.q: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self.thread = threading.Thread(target=self._run, name=f"dtprof-sink-{sink.name}", daemon=True)
        self.exit_code = 0

    def start(self) -> None:
        self.thread.start()

    def put(self, update: Update) -> None:
        if self.dead:
            return
        try:
            self.q.put_nowait(update)
        except queue.Full:
            self._fail(f"not keeping up ({QUEUE_MAX} updates waiting)")

    def finish(self, exit_code: int, timeout_s: float) -> None:
        self.exit_code = exit_code
        if not self.dead:
            try:
                self.q.put(_END, timeout=timeout_s)
            except queue.Full:
                self._fail("not keeping up at the end of the job")
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive() and not self.dead:
            self._fail(f"did not finish within {CLOSE_TIMEOUT_S:g} s of the job's end")

    def _run(self) -> None:
        try:
            self._timed(self.sink.open)
            while True:
                item = self.q.get()
                if item is _END:
                    self._timed(self.sink.close, self.exit_code)
                    return
                if not self.dead:
                    self._timed(self.sink.publish, item)
        except Exception as e:  # noqa: BLE001 -- port taken, disk full, service down: this sink is dropped
            self._fail(_why(e))

    def _timed(self, fn: Callable, *args) -> None:
        t0 = time.thread_time()
        try:
            fn(*args)
        finally:
            self.cpu_s += time.thread_time() - t0

    def _fail(self, why: str) -> None:
        if not self.dead:
            self.dead = True
            self.failure = f"failed: {why}"
            self.warn(f"dtprof: metrics sink {self.sink.name} failed: {why}; dropped, the job and the run go on")


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def make_sink(spec: SinkSpec, ctx: Context) -> Sink:
    cls = {"prometheus": PrometheusSink, "tensorboard": TensorBoardSink, "wandb": WandbSink,
           "mlflow": MlflowSink}[spec.kind]
    return cls(spec, ctx)


class Sink:
    def __init__(self, spec: SinkSpec, ctx: Context):
        self.spec, self.ctx, self.name = spec, ctx, spec.text

    def open(self) -> None: ...

    def publish(self, update: Update) -> None: ...

    def close(self, exit_code: int) -> None: ...


# ---- Prometheus --------------------------------------------------------------------------------------------------

class PrometheusSink(Sink):
    """Every step counted; gauges hold the newest step's and GPU sample's values. Labels: rank and host (per rank),
    host, gpu and uuid (per GPU), part (the step breakdown)."""

    def open(self) -> None:
        import prometheus_client as pc

        reg = self.registry = pc.CollectorRegistry()
        rk = ("rank", "host")

        def gauge(name, doc, labels=rk):
            return pc.Gauge(name, doc, labels, registry=reg)

        def counter(name, doc, labels=rk):
            return pc.Counter(name, doc, labels, registry=reg)

        self.duration = pc.Histogram("dtprof_step_duration_seconds", "Step time of a rank", rk,
                                     buckets=STEP_BUCKETS, registry=reg)
        self.steps = counter("dtprof_steps", "Steps a rank finished")
        self.step = gauge("dtprof_step_number", "The newest step a rank finished (counted from 0)")
        self.last = gauge("dtprof_step_last_duration_seconds", "Step time of the rank's newest step")
        self.parts = counter("dtprof_step_part_seconds", "Time per part of the step breakdown, summed over steps",
                             ("rank", "host", "part"))
        self.tokens = counter("dtprof_step_tokens", "Tokens a rank processed in its steps")
        self.samples = counter("dtprof_step_samples", "Samples a rank processed in its steps")
        self.tok_s = gauge("dtprof_step_tokens_per_second", "Tokens of the newest step / its step time")
        self.smp_s = gauge("dtprof_step_samples_per_second", "Samples of the newest step / its step time")
        self.mfu = gauge("dtprof_step_mfu_ratio", "Model FLOPs utilisation of the newest step (0..1)")
        self.mem = gauge("dtprof_step_peak_memory_bytes", "Peak memory of the newest step")
        self.cpu_wait = counter("dtprof_step_cpu_wait_seconds", "Time the training thread waited for a CPU")
        from dtprof.live import MEMORY_SERIES

        self.memory = {k: gauge(f"dtprof_memory_{k}", f"Memory ledger: {k} of the newest sampled step")
                       for k in MEMORY_SERIES}
        self.late = gauge("dtprof_step_collective_lateness_seconds",
                          "Newest step: Σ over its collectives of its arrival - the first arrival on this node")
        self.late_total = counter("dtprof_collective_lateness_seconds", "Lateness at collectives, summed over steps")
        self.straggler = gauge("dtprof_straggler", "1 while dtprof names the rank a straggler (live rule)")
        self.mem_pressure = gauge("dtprof_memory_pressure", "1 while the rank's memory would run out soon at its "
                                  "trend, or it failed an allocation (live rule)")
        self.headroom = gauge("dtprof_memory_headroom_bytes", "Bytes the rank can still allocate (newest sample)")
        self.loss = gauge("dtprof_loss", "The rank's local loss of its newest step with one (before any reduction)")
        self.grad_norm = gauge("dtprof_grad_norm", "The newest step's gradient norm (the job's clip_grad_norm_'s, "
                               "else dtprof's)")
        self.lr = gauge("dtprof_learning_rate", "The first param group's learning rate of the newest step")
        self.nonfinite = counter("dtprof_nonfinite_steps", "Steps whose loss or gradient norm was NaN or Inf")
        self.hang = gauge("dtprof_hang", "1 while no rank of the node has progressed for the hang threshold",
                          ("host",))
        self.age = gauge("dtprof_progress_age_seconds", "Seconds since any rank of the node progressed", ("host",))
        self.ranks = gauge("dtprof_ranks", "Ranks recorded on the node", ("host",))
        gl = ("host", "gpu", "uuid")
        self.gpu = {col: gauge(f"dtprof_{name}", f"NVML {col} (docs/metrics-export.md)", gl)
                    for col, (name, _) in GPU_SERIES.items()}
        self.throttle = gauge("dtprof_gpu_throttle_reasons", "NVML clocks event reasons bitmask", gl)
        self.throttled = gauge("dtprof_gpu_throttled", "1 while the clocks are slowed (power, thermal, HW)", gl)
        host, _, port = self.spec.target.rpartition(":")
        self.server, _ = pc.start_http_server(int(port), addr=host, registry=reg)
        bound = self.server.server_address[1]
        self.ctx.say(f"dtprof: Prometheus metrics at http://{host}:{bound}/metrics")

    def publish(self, update: Update) -> None:
        for s in update.steps:
            self._step(s)
        newest: dict[tuple[str, int], GpuSample] = {}
        for g in update.gpus:
            newest[(g.host, g.gpu)] = g
        for g in newest.values():
            self._gpu(g)
        self._status(update.status)

    def _step(self, s: RankStep) -> None:
        lab = (str(s.rank), s.host)
        self.duration.labels(*lab).observe(s.duration_s)
        self.steps.labels(*lab).inc()
        self.step.labels(*lab).set(s.step)
        self.last.labels(*lab).set(s.duration_s)
        for part, sec in s.parts_s.items():
            self.parts.labels(*lab, part).inc(max(sec, 0.0))
        if s.tokens is not None:
            self.tokens.labels(*lab).inc(s.tokens)
            self.tok_s.labels(*lab).set(s.tokens / s.duration_s if s.duration_s > 0 else 0.0)
        if s.samples is not None:
            self.samples.labels(*lab).inc(s.samples)
            self.smp_s.labels(*lab).set(s.samples / s.duration_s if s.duration_s > 0 else 0.0)
        if s.mfu is not None:
            self.mfu.labels(*lab).set(s.mfu)
        if s.peak_mem_bytes is not None:
            self.mem.labels(*lab).set(s.peak_mem_bytes)
        if s.cpu_wait_s is not None:
            self.cpu_wait.labels(*lab).inc(s.cpu_wait_s)
        for k, v in s.memory.items():
            self.memory[k].labels(*lab).set(v)
        if s.detailed:            # a boundary-only step has no collectives recorded
            self.late.labels(*lab).set(s.lateness_s)
            self.late_total.labels(*lab).inc(s.lateness_s)
        for gauge_, value in ((self.loss, s.loss), (self.grad_norm, s.grad_norm), (self.lr, s.learning_rate)):
            if value is not None:
                gauge_.labels(*lab).set(value)
        if s.nonfinite:
            self.nonfinite.labels(*lab).inc()
            for name, gauge_ in (("loss", self.loss), ("grad_norm", self.grad_norm)):
                if name in s.nonfinite.split():
                    gauge_.labels(*lab).set(float("nan"))

    def _gpu(self, g: GpuSample) -> None:
        from dtprof.analyzers.gpu import THROTTLE_MASK

        lab = (g.host, str(g.gpu), g.uuid)
        for col, (_, scale) in GPU_SERIES.items():
            v = g.values.get(col)
            if v is not None:
                self.gpu[col].labels(*lab).set(float(v) * scale)
        reasons = g.values.get("throttle_reasons")
        if reasons is not None:
            self.throttle.labels(*lab).set(int(reasons))
            self.throttled.labels(*lab).set(1 if int(reasons) & THROTTLE_MASK else 0)

    def _status(self, st: NodeStatus) -> None:
        self.ranks.labels(st.host).set(len(st.ranks))
        for rank, host in st.ranks.items():
            self.straggler.labels(str(rank), host).set(1 if rank in st.stragglers else 0)
            self.mem_pressure.labels(str(rank), host).set(1 if rank in st.memory else 0)
            if rank in st.headroom:
                self.headroom.labels(str(rank), host).set(st.headroom[rank])
        self.hang.labels(st.host).set(1 if st.hang else 0)
        if st.progress_age_s is not None:
            self.age.labels(st.host).set(st.progress_age_s)


# ---- TensorBoard, W&B, MLflow: points per interval ---------------------------------------------------------------

@dataclass
class _StepAcc:
    """The steps of one rank in one interval, reduced to one point."""
    n: int = 0
    step: int = 0
    duration: float = 0.0
    parts: dict = field(default_factory=dict)
    sums: dict = field(default_factory=dict)      # tokens, samples, cpu_wait, flops: summed over the steps having it
    known: dict = field(default_factory=dict)     # ... and how many steps had it
    peak_flops: float | None = None
    peak_mem: float | None = None
    lateness: float = 0.0
    n_detailed: int = 0                           # steps with parts and lateness (sampling: not every step)
    health: dict = field(default_factory=dict)    # loss, grad_norm, learning_rate: the newest step's that has it
    nonfinite: int = 0                            # steps with a NaN/Inf loss or gradient norm
    memory: dict = field(default_factory=dict)    # the newest memory ledger row's series in the interval

    def add(self, s: RankStep) -> None:
        self.n += 1
        self.n_detailed += s.detailed
        self.step = max(self.step, s.step)
        self.duration += s.duration_s
        for p, sec in s.parts_s.items():
            self.parts[p] = self.parts.get(p, 0.0) + sec
        for k, v in (("tokens", s.tokens), ("samples", s.samples), ("cpu_wait", s.cpu_wait_s), ("flops", s.flops)):
            if v is not None:
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.known[k] = self.known.get(k, 0) + 1
        self.peak_flops = s.peak_flops
        if s.peak_mem_bytes is not None:
            self.peak_mem = max(self.peak_mem or 0.0, s.peak_mem_bytes)
        self.lateness += s.lateness_s
        for k, v in (("loss", s.loss), ("grad_norm", s.grad_norm), ("learning_rate", s.learning_rate)):
            if v is not None:
                self.health[k] = v
        self.nonfinite += bool(s.nonfinite)     # (a NaN point is not written: not every tracker stores one)
        if s.memory:
            self.memory = s.memory

    def values(self) -> dict[str, float]:
        v = {"step_duration_seconds": self.duration / self.n}
        v.update({f"step_{p}_seconds": t / self.n_detailed for p, t in self.parts.items()})
        full = {k for k, c in self.known.items() if c == self.n}   # a rate only over steps that all report it
        if self.duration > 0:
            for k, name in (("tokens", "step_tokens_per_second"), ("samples", "step_samples_per_second")):
                if k in full:
                    v[name] = self.sums[k] / self.duration
            if "flops" in full and self.peak_flops:
                v["step_mfu_ratio"] = self.sums["flops"] / (self.duration * self.peak_flops)
        if "cpu_wait" in full:
            v["step_cpu_wait_seconds"] = self.sums["cpu_wait"] / self.n
        if self.peak_mem is not None:
            v["step_peak_memory_bytes"] = self.peak_mem
        if self.n_detailed:
            v["step_collective_lateness_seconds"] = self.lateness / self.n_detailed
        v.update(self.health)
        if self.nonfinite:
            v["nonfinite_steps"] = float(self.nonfinite)
        v.update({f"memory_{k}": x for k, x in self.memory.items()})
        return v


@dataclass
class _GpuAcc:
    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    n: int = 0
    throttled: int = 0

    def add(self, g: GpuSample) -> None:
        from dtprof.analyzers.gpu import THROTTLE_MASK

        self.n += 1
        for col, v in g.values.items():
            if v is not None and col in GPU_SERIES:
                self.sums[col] = self.sums.get(col, 0.0) + float(v)
                self.counts[col] = self.counts.get(col, 0) + 1
        reasons = g.values.get("throttle_reasons")
        if reasons is not None and int(reasons) & THROTTLE_MASK:
            self.throttled += 1

    def values(self) -> dict[str, float]:
        v = {GPU_SERIES[c][0]: s / self.counts[c] * GPU_SERIES[c][1] for c, s in self.sums.items()}
        v["gpu_throttled_ratio"] = self.throttled / self.n
        return v


class Tracker(Sink):
    """A sink that stores points for good (TensorBoard, W&B, MLflow): one point per rank and per GPU each
    ``interval_s``; a straggler, a hang or a rank's memory pressure (or out-of-memory failure), when it first shows,
    is also an alert (``alert``)."""

    def __init__(self, spec: SinkSpec, ctx: Context):
        super().__init__(spec, ctx)
        self.acc: dict[int, _StepAcc] = {}
        self.gpu_acc: dict[int, _GpuAcc] = {}
        self.last_emit = 0.0
        self.t0 = time.monotonic()
        self.status: NodeStatus | None = None
        self.alerted: set[str] = set()

    def publish(self, update: Update) -> None:
        self.status = update.status
        each = self.ctx.interval_s <= 0     # --metrics-interval 0: every step is a point of its own
        for s in update.steps:
            acc = _StepAcc() if each else self.acc.setdefault(s.rank, _StepAcc())
            acc.add(s)
            if each:
                self._rank_point(s.rank, acc)
            if s.nonfinite and "nonfinite" not in self.alerted:    # the first one only: the NaN spreads
                self.alerted.add("nonfinite")
                self.alert("nonfinite", f"rank {s.rank} on {s.host}: {s.nonfinite.replace(' ', ' and ')} "
                                        f"non-finite (NaN/Inf) at step {s.step}")
        for g in update.gpus:
            self.gpu_acc.setdefault(g.gpu, _GpuAcc()).add(g)
        self._alerts(update.status)
        if time.monotonic() - self.last_emit >= self.ctx.interval_s:
            self._emit()

    def close(self, exit_code: int) -> None:
        self._emit()
        self.finish(exit_code)

    def _emit(self) -> None:
        self.last_emit = time.monotonic()
        tick = int(self.last_emit - self.t0)
        st = self.status
        for rank, acc in sorted(self.acc.items()):
            self._rank_point(rank, acc)
        for gpu, gacc in sorted(self.gpu_acc.items()):
            self.gpu_point(gpu, tick, gacc.values())
        if st is not None and st.progress_age_s is not None:
            self.node_point(tick, {"hang": 1.0 if st.hang else 0.0, "progress_age_seconds": st.progress_age_s})
        self.acc, self.gpu_acc = {}, {}
        self.flush()

    def _rank_point(self, rank: int, acc: _StepAcc) -> None:
        values = acc.values()
        if self.status is not None:
            values["straggler"] = 1.0 if rank in self.status.stragglers else 0.0
            values["memory_pressure"] = 1.0 if rank in self.status.memory else 0.0
            if rank in self.status.headroom:
                values["memory_headroom_bytes"] = self.status.headroom[rank]
        self.rank_point(rank, acc.step, values)

    def _alerts(self, st: NodeStatus) -> None:
        for rank, why in st.stragglers.items():
            if f"straggler {rank}" not in self.alerted:
                self.alerted.add(f"straggler {rank}")
                self.alert("straggler", f"rank {rank} on {st.ranks.get(rank, st.host)} is a straggler: {why}")
        for rank, why in st.memory.items():
            kind = "oom" if why.startswith("out of memory") else "memory"
            if f"{kind} {rank}" not in self.alerted:
                self.alerted.add(f"{kind} {rank}")
                self.alert(kind, f"rank {rank} on {st.ranks.get(rank, st.host)}: {why}")
        if st.hang and "hang" not in self.alerted:
            self.alerted.add("hang")
            self.alert("hang", f"no rank on {st.host} progressed for {st.progress_age_s:.0f} s "
                               f"(threshold {st.hang_after_s:.0f} s)")

    # what each tracker implements
    def rank_point(self, rank: int, step: int, values: dict[str, float]) -> None: ...

    def gpu_point(self, gpu: int, tick: int, values: dict[str, float]) -> None: ...

    def node_point(self, tick: int, values: dict[str, float]) -> None: ...

    def alert(self, kind: str, text: str) -> None: ...

    def flush(self) -> None: ...

    def finish(self, exit_code: int) -> None: ...


def _run_name(ctx: Context) -> str:
    return f"{ctx.run_dir.name}-{ctx.host}"


class TensorBoardSink(Tracker):
    """Event files in DIR/rank-<r>, DIR/gpu-<host>-<i> and DIR/node-<host>: TensorBoard draws the ranks (and the
    GPUs) as runs of one chart per quantity."""

    def open(self) -> None:
        from tensorboard.summary import Writer

        self._writer_cls = Writer
        self.writers: dict[str, Any] = {}
        Path(self.spec.target).mkdir(parents=True, exist_ok=True)

    def _w(self, sub: str):
        if sub not in self.writers:
            self.writers[sub] = self._writer_cls(str(Path(self.spec.target) / _safe(sub)))
        return self.writers[sub]

    def rank_point(self, rank, step, values):
        w = self._w(f"rank-{rank}")
        for k, v in values.items():
            w.add_scalar(k, v, step)

    def gpu_point(self, gpu, tick, values):
        w = self._w(f"gpu-{self.ctx.host}-{gpu}")
        for k, v in values.items():
            w.add_scalar(k, v, tick)

    def node_point(self, tick, values):
        w = self._w(f"node-{self.ctx.host}")
        for k, v in values.items():
            w.add_scalar(k, v, tick)

    def alert(self, kind, text):
        self.node_point(int(time.monotonic() - self.t0), {f"alert_{kind}": 1.0})

    def flush(self):
        for w in self.writers.values():
            w.flush()

    def finish(self, exit_code):
        for w in self.writers.values():
            w.close()


class WandbSink(Tracker):
    """One W&B run per node (grouped by the run directory's name), keys ``rank<r>/<series>`` over ``rank<r>/step``
    and ``gpu<i>/<series>`` over ``node/time_seconds``. The launcher's own console and system metrics are left
    alone (console="off", stats off)."""

    def open(self) -> None:
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        # online without a key, wandb.init would ask for one on the terminal the job shares: refuse instead
        mode = wandb.setup().settings.mode    # WANDB_MODE, `wandb offline`, ...
        if mode not in ("offline", "dryrun", "disabled") and not wandb.login(prompt=False, verify=False):
            raise RuntimeError("no W&B API key (wandb login, WANDB_API_KEY, or WANDB_MODE=offline)")
        self.run = wandb.init(project=self.spec.target or os.environ.get("WANDB_PROJECT") or "dtprof",
                              name=_run_name(self.ctx), group=self.ctx.run_dir.name, job_type="dtprof",
                              config={"dtprof": self.ctx.config, "run_dir": str(self.ctx.run_dir)},
                              settings=settings, reinit="create_new")
        self.defined: set[str] = set()
        self.ctx.say(f"dtprof: W&B run {self.run.name} ({self.run.settings.mode})")

    def _log(self, prefix: str, x_key: str, x: int, values: dict[str, float]) -> None:
        if prefix not in self.defined:
            self.defined.add(prefix)
            self.run.define_metric(f"{prefix}/{x_key}")
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/{x_key}")
        self.run.log({f"{prefix}/{x_key}": x, **{f"{prefix}/{k}": v for k, v in values.items()}})

    def rank_point(self, rank, step, values):
        self._log(f"rank{rank}", "step", step, values)

    def gpu_point(self, gpu, tick, values):
        self._log(f"gpu{gpu}", "time_seconds", tick, values)

    def node_point(self, tick, values):
        self._log("node", "time_seconds", tick, values)

    def alert(self, kind, text):
        self.run.tags = tuple(self.run.tags or ()) + (f"dtprof:{kind}",)
        self.run.summary[f"dtprof/{kind}"] = text
        self.run.alert(title=f"dtprof: {kind}", text=text, level=self.wandb.AlertLevel.WARN)

    def finish(self, exit_code):
        self.run.summary["dtprof/exit_code"] = exit_code
        self.run.finish(exit_code=exit_code)


class MlflowSink(Tracker):
    """One MLflow run per node (experiment ``MLFLOW_EXPERIMENT_NAME`` or "dtprof"), keys as for W&B; a straggler
    or a hang is a ``dtprof.<kind>`` tag. A ``file:`` store is opted into for this process (MLflow 3 asks for
    ``MLFLOW_ALLOW_FILE_STORE``): the user named it."""

    def open(self) -> None:
        uri = self.spec.target or None
        if uri is not None and (uri.startswith("file:") or "://" not in uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dtprof"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=_run_name(self.ctx),
                                     tags={"dtprof.run_dir": str(self.ctx.run_dir), "dtprof.host": self.ctx.host})
        self.run_id = run.info.run_id
        self.batch: list = []
        self.ctx.say(f"dtprof: MLflow run {self.run_id} ({self.client.tracking_uri})")

    def _add(self, prefix: str, x: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.batch += [Metric(f"{prefix}/{k}", float(v), ms, int(x)) for k, v in values.items()]

    def rank_point(self, rank, step, values):
        self._add(f"rank{rank}", step, values)

    def gpu_point(self, gpu, tick, values):
        self._add(f"gpu{gpu}", tick, values)

    def node_point(self, tick, values):
        self._add("node", tick, values)

    def alert(self, kind, text):
        self.client.set_tag(self.run_id, f"dtprof.{kind}", text)

    def flush(self):
        batch, self.batch = self.batch, []
        for i in range(0, len(batch), 1000):     # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def finish(self, exit_code):
        self.client.set_tag(self.run_id, "dtprof.exit_code", str(exit_code))
        self.client.set_terminated(self.run_id, status="FINISHED" if exit_code == 0 else "FAILED")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
