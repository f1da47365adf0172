"""Live per-step metrics from a node's run directory while the job runs (`dtprof run --metrics`,
docs/metrics-export.md). No torch import; nothing here runs in the job.

The launcher's publisher thread (dtprof/sinks.py) calls ``LiveNode.poll()`` about once a second. It reads only what
is already written: the rows each rank's flusher thread appends every second (``rank-*/steps``, ``spans``,
``collectives``, ``groups``, ``meta`` JSON-lines files), ``rank.json``, the heartbeats (``rank-*/heartbeat.json``,
every 0.5 s) and the NVML sampler's ``nvml`` file, each from where the last read stopped. The ranks do no extra work.

Decisions
- A rank-step is published ``SETTLE_S`` after its steps row was first seen: a flush writes the steps file before
  the spans and collectives files, and on a GPU the spans timed by CUDA events land a flush later. A row that comes
  later still is missed here (its time reads as "other" in that step's breakdown); the analysis after the job is
  the reference.
- The step breakdown is analyzers/breakdown.py's ``step_breakdown`` on the buffered rows, so each part has the same
  definition as in summary.json, and a part added there (a "waiting for the GPU" part) is exported with no change
  here.
- Lateness, stragglers and hangs are the analysis's own functions on the buffered rows, so each is defined once:
  a collective instance's arrivals, each row's lateness and the last rank's lead are analyzers/stragglers.py
  ``local_arrivals`` (``instance_arrivals`` on one clock), counted per rank-step by the rows' step as
  ``step_leads`` counts them; a late step is ``late_step`` and a straggler ``late_most``; a hang's age is
  analyzers/triage.py ``progress_age_s``. Lateness is measured among this node's ranks only: each node's launcher
  sees its own ranks, and aligning the clocks of several hosts is the analysis's job, after the run.
- Live straggler: over the last ``STRAGGLER_WINDOW`` steps (``STRAGGLER_MIN_STEPS`` at least), the rank held its
  peers up (``late_step``: a lead of at least half the median step of the window) in at least
  ``STRAGGLER_LATE_FRAC`` of them and twice as often as any other rank (``late_most``): the after-run transient rule
  with its minimum raised from 2 steps in the whole run to half the window. On a busy machine every rank is
  sometimes late, and a 50-step window of that noise must not page anyone (measured: an unslowed 2-rank job on 2
  shared cores had one rank late in 15 of 50 steps, the other in 7).
- Live hang: no rank progressed (heartbeat ``last_progress_ns``) for ``--hang-timeout`` when it is given (the
  watchdog's criterion), else for ``max(HANG_MIN_S, HANG_STEPS x median step)``.
- Live memory pressure (the out-of-memory early warning): per rank, samples of what it uses and the room it has
  left (a GPU rank: its ledger rows' reserved peak against its device's memory, rank.json; a CPU rank: its process's
  address space (``/proc/<pid>/statm``) under its ``RLIMIT_AS`` (``/proc/<pid>/limits``), or its resident bytes,
  against the machine's available memory, read here once a poll: the rank does nothing). A rank is under memory
  pressure when its room is under ``MEM_LOW_FRAC`` of its capacity, or when its use grew at each of its last
  ``MEM_MIN_SAMPLES`` samples and, at the rate fitted over the last ``MEM_WINDOW``, fills the room within
  ``max(MEM_HORIZON_MIN_S, MEM_HORIZON_STEPS x median step)``: the trend, not a level, so a job that settled near its
  capacity after its first steps is left alone. Samples count from the rank's step ``MEM_WARMUP_STEPS`` on: its
  start-up (imports, the first steps' optimizer state) grows its memory at a rate no later step keeps. A rank that
  failed an allocation (its ``oom`` meta row) is reported as such.
- Memory stays bounded over weeks: rows are dropped once their steps are published (collectives ``KEEP_NS`` later,
  so a peer's arrival at the same collective is still there), and the published history is a bounded window.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from dtprof.rundir.files import TableTail
from dtprof.rundir.writer import RANK_PREFIX

SETTLE_NS = 2_500_000_000      # two flushes of the ranks (1 s each) and a margin
KEEP_NS = 30_000_000_000       # collectives rows kept this long after their rank's published steps
STRAGGLER_WINDOW = 50
STRAGGLER_MIN_STEPS = 20
STRAGGLER_LATE_FRAC = 0.5
HANG_MIN_S = 120.0
HANG_STEPS = 50
RANK_TABLES = ("steps", "spans", "collectives", "groups", "meta", "health", "memory")
MEM_WARMUP_STEPS = 3           # a rank's memory samples count from its step this far in (start-up grows its memory)
MEM_WINDOW = 20
MEM_MIN_SAMPLES = 4
MEM_LOW_FRAC = 0.05
MEM_HORIZON_STEPS = 50
MEM_HORIZON_MIN_S = 60.0
# the memory ledger's columns published per rank-step (collectors/memory.py; only sampled steps have a row)
MEMORY_SERIES = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "allocated_bytes", "peak_bytes",
                 "reserved_peak_bytes")




@dataclass
class RankStep:
    """One published rank-step: what every sink exports (docs/metrics-export.md)."""
    rank: int
    host: str
    step: int
    end_ns: int
    duration_s: float
    parts_s: dict[str, float]           # the step breakdown's parts (analyzers/breakdown.py PARTS), seconds
    tokens: float | None = None
    samples: float | None = None
    flops: float | None = None          # model FLOPs of this step on this rank (None: unknown)
    peak_flops: float | None = None     # this rank's device peak FLOP/s (None: unknown live)
    peak_mem_bytes: float | None = None
    cpu_wait_s: float | None = None
    lateness_s: float = 0.0             # Σ over its collectives of (its arrival - the first arrival on this node)
    lead_s: float = 0.0                 # Σ over the collectives it arrived last at of (its arrival - the 2nd latest)
    detailed: bool = True               # False: sampling recorded only its times (no parts, no collectives)
    # numerics health (run format ``health``; its row is written a step after the step's: one that lands later
    # than the step's publication is not exported live)
    loss: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    nonfinite: str = ""                 # the step's non-finite values ("loss grad_norm"), "" for none
    memory: dict[str, float] = field(default_factory=dict)   # its memory ledger row's MEMORY_SERIES, where sampled

    @property
    def mfu(self) -> float | None:
        if self.flops is None or self.peak_flops is None or self.duration_s <= 0:
            return None
        return self.flops / (self.duration_s * self.peak_flops)


@dataclass
class GpuSample:
    host: str
    gpu: int
    uuid: str
    t_ns: int
    values: dict[str, float | None]     # the nvml table's value columns (dtprof/rundir/schema.py)


@dataclass
class NodeStatus:
    host: str
    ranks: dict[int, str] = field(default_factory=dict)   # rank -> host, the ranks seen on this node
    progress_age_s: float | None = None   # since the newest progress of any rank (None: none started, or all done)
    hang: bool = False
    hang_after_s: float | None = None
    stragglers: dict[int, str] = field(default_factory=dict)   # rank -> why
    memory: dict[int, str] = field(default_factory=dict)       # rank -> why it is under memory pressure (or failed)
    headroom: dict[int, float] = field(default_factory=dict)   # rank -> bytes it can still allocate (newest sample)


@dataclass
class Update:
    steps: list[RankStep]
    gpus: list[GpuSample]
    status: NodeStatus


class _Rank:
    def __init__(self, rank_dir: Path):
        self.dir = rank_dir
        self.tails = {t: TableTail(rank_dir, t) for t in RANK_TABLES}
        self.identity: dict | None = None
        self.executed_flops: float | None = None   # the rank's FlopCounterMode count, once its counted step is seen
        self.published_end_ns = 0
        self.health: dict[int, tuple] = {}         # step -> (loss, grad_norm, lr, nonfinite), until published
        self.ledger: dict[int, dict[str, float]] = {}   # step -> its memory row's series, until the step is published
        self.room: deque[tuple[int, float, float, float]] = deque(maxlen=MEM_WINDOW)  # (t_ns, used, room, capacity)
        self.oom: str | None = None                    # its out-of-memory failure, once its oom meta row is read
        self.newest_step = -1                          # the newest step its steps rows have shown


class LiveNode:
    """See the module docstring. ``config`` is the launcher's (node.json ``config``): dtype, peak_tflops,
    flops_per_step, hang_timeout_s."""

    def __init__(self, node_dir: Path, config: dict, host: str, clock=time.monotonic_ns):
        from dtprof.options import load_calibrations

        self.node_dir = Path(node_dir)
        self.config = config
        self.host = host
        self.clock = clock
        self.calibrations = load_calibrations() if config.get("peak_tflops") is None else {}
        self.ranks: dict[int, _Rank] = {}
        self.nvml = TableTail(self.node_dir, "nvml")
        self.buf = _empty_buffers()
        self.pending: list[tuple[int, pd.DataFrame]] = []   # (first seen ns, new steps rows)
        self.durations: deque[float] = deque(maxlen=STRAGGLER_WINDOW * 8)
        self.late: dict[int, deque[bool]] = {}

    # ---- reading ---------------------------------------------------------------------------------------------
    def _discover(self) -> None:
        for d in self.node_dir.glob(f"{RANK_PREFIX}*"):
            try:
                rank = int(d.name[len(RANK_PREFIX):])
            except ValueError:
                continue
            r = self.ranks.setdefault(rank, _Rank(d))
            if r.identity is None:
                try:
                    r.identity = json.loads((d / "rank.json").read_text())
                except (OSError, ValueError):
                    pass

    def _read_rows(self, now: int) -> None:
        from dtprof.analyzers.runmodel import captures, device_comm, with_exit

        for r in self.ranks.values():
            steps = r.tails["steps"].frame("steps")
            if len(steps):
                self.pending.append((now, steps))
                r.newest_step = max(r.newest_step, int(steps["step"].max()))
            for t in ("spans", "groups"):
                self._append(t, r.tails[t].frame(t))
            self._append("collectives", device_comm(with_exit(r.tails["collectives"].frame("collectives")),
                                                    self._gpu_ranks()))
            h = r.tails["health"].frame("health")
            for step, loss, norm, lr, bad in zip(h["step"], h["loss"], h["grad_norm"], h["lr"], h["nonfinite"]):
                r.health[int(step)] = (_num(loss), _num(norm), _num(lr), "" if pd.isna(bad) else str(bad))
            mem = r.tails["memory"].frame("memory")
            total = (r.identity or {}).get("device_mem_total_bytes")
            for row in mem.to_dict("records"):
                r.ledger[int(row["step"])] = {k: float(row[k]) for k in MEMORY_SERIES if pd.notna(row[k])}
                if total and pd.notna(row["reserved_peak_bytes"]) and row["step"] >= MEM_WARMUP_STEPS:   # a GPU rank
                    used = float(row["reserved_peak_bytes"])
                    r.room.append((int(row["t_ns"]), used, float(total) - used, float(total)))
            meta = r.tails["meta"].frame("meta")
            if len(meta):
                self._append("captures", captures(meta))
                for v in meta.loc[meta["kind"].astype(str) == "oom", "value"]:
                    if isinstance(v, dict):
                        r.oom = (f"failed to allocate {_gib(v.get('requested_bytes'))} at step {v.get('step')}"
                                 f" in {v.get('phase') or 'an unknown phase'}")

    def _gpu_ranks(self) -> np.ndarray:
        """The ranks whose rank.json names a GPU (the run model's ``gpu_ranks``, from what has been read)."""
        return np.array(sorted(k for k, r in self.ranks.items() if (r.identity or {}).get("device_type") == "cuda"),
                        np.int64)

    def _append(self, table: str, df: pd.DataFrame) -> None:
        if len(df):
            old = self.buf[table]
            self.buf[table] = df if old.empty else pd.concat([old.astype(df.dtypes.to_dict()), df], ignore_index=True)

    # ---- a poll ----------------------------------------------------------------------------------------------
    def poll(self, final: bool = False) -> Update:
        """What is new since the last poll; ``final`` publishes every step seen (the job has ended)."""
        now = self.clock()
        self._discover()
        self._read_rows(now)
        self._sample_cpu_room(now)
        ready = [df for seen, df in self.pending if final or now - seen >= SETTLE_NS]
        self.pending = [(seen, df) for seen, df in self.pending if not (final or now - seen >= SETTLE_NS)]
        steps = self._publish(pd.concat(ready, ignore_index=True)) if ready else []
        return Update(steps, self._gpus(), self._status(now))

    def _publish(self, st: pd.DataFrame) -> list[RankStep]:
        from dtprof.analyzers.breakdown import PARTS, step_breakdown

        st = st.sort_values(["rank", "step"], ignore_index=True)
        windows = st[["rank", "step", "start_ns", "end_ns"]]
        bd = step_breakdown(SimpleNamespace(**self.buf, gpu_ranks=self._gpu_ranks()), windows).per_step
        lateness, lead = self._lateness(st)
        parts = {p: bd[f"{p}_s"].to_numpy(np.float64) for p in PARTS}
        detailed = (st["detail"].astype("Float64").fillna(1).to_numpy(np.float64) != 0 if "detail" in st
                    else np.ones(len(st), bool))
        out = []
        for i, row in enumerate(st.itertuples(index=False)):
            r = self.ranks[int(row.rank)]
            if pd.notna(row.executed_flops):
                r.executed_flops = float(row.executed_flops)
            rs = RankStep(rank=int(row.rank), host=self._host_of(r), step=int(row.step), end_ns=int(row.end_ns),
                          duration_s=(row.end_ns - row.start_ns) / 1e9,
                          parts_s={p: float(v[i]) for p, v in parts.items()} if detailed[i] else {},
                          tokens=_num(row.tokens), samples=_num(row.samples),
                          flops=self._flops(r, row), peak_flops=self._peak(r),
                          peak_mem_bytes=_num(row.peak_mem_bytes),
                          cpu_wait_s=None if pd.isna(row.cpu_wait_ns) else float(row.cpu_wait_ns) / 1e9,
                          lateness_s=float(lateness[i]), lead_s=float(lead[i]), detailed=bool(detailed[i]),
                          memory=r.ledger.pop(int(row.step), {}))
            health = r.health.pop(rs.step, None)
            if health is not None:
                rs.loss, rs.grad_norm, rs.learning_rate, rs.nonfinite = health
            r.published_end_ns = max(r.published_end_ns, rs.end_ns)
            out.append(rs)
        self._track_stragglers(out)
        self._prune()
        newest: dict[int, int] = {}
        for s in out:
            newest[s.rank] = max(newest.get(s.rank, -1), s.step)
        for rank, step in newest.items():    # ledger rows of steps already published: never to be used (bounded)
            led = self.ranks[rank].ledger
            for k in [k for k in led if k <= step]:
                del led[k]
        return out

    def _lateness(self, st: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """Per rank-step of ``st``: Σ lateness and Σ lead (see RankStep) of its collectives, derived as the analysis
        derives them (analyzers/stragglers.py ``local_arrivals``, ``step_leads``) from the buffered rows."""
        from dtprof.analyzers.stragglers import local_arrivals, step_leads

        n = len(st)
        co = self.buf["collectives"]
        key = pd.MultiIndex.from_arrays([st["rank"].to_numpy(np.int64), st["step"].to_numpy(np.int64)])
        if len(co):   # only the instances these rank-steps took part in: the buffer holds KEEP_NS of older ones
            at = pd.MultiIndex.from_arrays([co["rank"].to_numpy(np.int64),
                                            co["step"].astype("Int64").fillna(-1).to_numpy(np.int64)]).isin(key)
            inst = pd.MultiIndex.from_arrays([co["group"].astype(str).to_numpy(), co["seq"].to_numpy(np.int64)])
            co = co[inst.isin(inst[at])]
        if co.empty:
            return np.zeros(n), np.zeros(n)
        ranks = pd.DataFrame({"rank": sorted(self.ranks), "host": self.host, "node": str(self.node_dir)})
        arr, rows = local_arrivals(SimpleNamespace(collectives=co, ranks=ranks))
        late = rows.groupby(["rank", "step"])["lateness_ns"].sum().reindex(key).fillna(0).to_numpy(np.float64)
        lead = step_leads(arr).dropna(subset=["step"]).astype({"step": "int64"}).set_index(["rank", "step"])
        return late / 1e9, lead["lead_s"].reindex(key).fillna(0.0).to_numpy(np.float64)

    def _prune(self) -> None:
        """Drop rows that no later step can need (see the module docstring)."""
        for r in self.ranks.values():     # health rows of steps published without them (they came too late)
            if len(r.health) > 4 * STRAGGLER_WINDOW:
                for step in sorted(r.health)[:-STRAGGLER_WINDOW]:
                    del r.health[step]
        end = {rank: r.published_end_ns for rank, r in self.ranks.items()}
        for table, col, keep in (("spans", "end_ns", 0), ("collectives", "exit_ns", KEEP_NS)):
            df = self.buf[table]
            if len(df):
                limit = df["rank"].map(end).fillna(0).to_numpy(np.int64) - keep
                self.buf[table] = df[df[col].to_numpy(np.int64) > limit].reset_index(drop=True)

    # ---- per rank facts --------------------------------------------------------------------------------------
    def _host_of(self, r: _Rank) -> str:
        return str((r.identity or {}).get("host") or self.host)

    def _flops(self, r: _Rank, row) -> float | None:
        """Model FLOPs of the step on this rank, as analyzers/mfu.py takes them: --flops-per-step (the job's, split
        evenly over its ranks), else the step's annotated model_flops, else the rank's executed FLOPs count."""
        if self.config.get("flops_per_step"):
            world = int((r.identity or {}).get("world_size") or 1)
            return float(self.config["flops_per_step"]) / max(world, 1)
        if pd.notna(row.model_flops):
            return float(row.model_flops)
        return r.executed_flops

    def _peak(self, r: _Rank) -> float | None:
        """The device's peak FLOP/s as dtprof/options.py resolves it, from what is known while the job runs: no CPU
        calibration yet (dtprof run makes it after the job), so a CPU needs --peak-tflops or `dtprof calibrate`."""
        from dtprof.analyzers.mfu import norm_dtype
        from dtprof.options import device_peak

        ident = r.identity or {}
        name, kind = str(ident.get("device_name") or ""), str(ident.get("device_type") or "")
        dtype = norm_dtype(self.config.get("dtype") or ("fp32" if kind == "cpu" else "bf16"))
        p = device_peak(name, kind, dtype, self.config.get("peak_tflops"), self.calibrations)
        return p.tflops * 1e12 if p.tflops else None

    # ---- node state ------------------------------------------------------------------------------------------
    def _gpus(self) -> list[GpuSample]:
        from dtprof.rundir.schema import TABLES

        value_cols = [c for c, _ in TABLES["nvml"]][5:]
        out = []
        for row in self.nvml.read():
            d = dict(zip(self.nvml.columns or [], row))
            out.append(GpuSample(str(d.get("host")), int(d.get("gpu") or 0), str(d.get("uuid")), int(d["t_ns"]),
                                 {c: d.get(c) for c in value_cols}))
        return out

    def _track_stragglers(self, steps: list[RankStep]) -> None:
        self.durations.extend(s.duration_s for s in steps)
        if not self.durations:
            return
        from dtprof.analyzers.stragglers import late_step

        p50 = statistics.median(self.durations)
        for s in steps:
            if s.detailed:        # a boundary-only step carries no collectives: no evidence either way
                self.late.setdefault(s.rank, deque(maxlen=STRAGGLER_WINDOW)).append(bool(late_step(s.lead_s, p50)))

    def stragglers(self) -> dict[int, str]:
        """The analysis's transient-lateness rule (analyzers/stragglers.py ``late_most``) over each rank's window,
        at least ``STRAGGLER_LATE_FRAC`` of it late (module docstring)."""
        from dtprof.analyzers.stragglers import late_most

        ranks = sorted(self.late)
        counts = np.array([sum(self.late[r]) for r in ranks], np.int64)
        seen = np.array([len(self.late[r]) for r in ranks], np.int64)
        need = np.where(seen >= STRAGGLER_MIN_STEPS, np.ceil(STRAGGLER_LATE_FRAC * seen), np.inf)
        return {r: (f"arrived last at its collectives, at least half a median step after the others, in {n} "
                    f"of its last {k} steps")
                for r, n, k, late in zip(ranks, counts, seen, late_most(counts, need)) if late}

    def _sample_cpu_room(self, now: int) -> None:
        """One (used, room, capacity) sample of each running CPU rank's process (module docstring)."""
        avail = total = None
        for r in self.ranks.values():
            ident = r.identity or {}
            if ident.get("device_type") == "cuda" or not ident.get("pid") or r.oom or r.newest_step < MEM_WARMUP_STEPS:
                continue
            if avail is None or total is None:
                avail, total = _meminfo()
                if avail is None or total is None:
                    return
            got = _process_room(int(ident["pid"]), avail, total)
            if got is not None:
                r.room.append((now, *got))

    def memory_pressure(self) -> dict[int, str]:
        """rank -> why it is under memory pressure, or that it failed an allocation (module docstring)."""
        out = {}
        median = statistics.median(self.durations) if self.durations else 0.0
        horizon = max(MEM_HORIZON_MIN_S, MEM_HORIZON_STEPS * median)
        for rank, r in self.ranks.items():
            if r.oom:
                out[rank] = f"out of memory: {r.oom}"
                continue
            if not r.room:
                continue
            t, used, room, cap = (np.array(x, np.float64) for x in zip(*r.room))
            if room[-1] < MEM_LOW_FRAC * cap[-1]:
                out[rank] = f"{_gib(room[-1])} left of {_gib(cap[-1])} ({room[-1] / cap[-1]:.0%})"
                continue
            if len(t) < MEM_MIN_SAMPLES or not (np.diff(used[-MEM_MIN_SAMPLES:]) > 0).all() or t[-1] <= t[0]:
                continue
            rate = float(np.polyfit((t - t[0]) / 1e9, used, 1)[0])    # bytes per second
            if rate > 0 and room[-1] / rate < horizon:
                out[rank] = (f"its memory grows {_gib(rate)}/s with {_gib(room[-1])} left of {_gib(cap[-1])}: "
                             f"out of memory in about {room[-1] / rate:.0f} s at this rate")
        return out

    def _status(self, now: int) -> NodeStatus:
        from dtprof.analyzers.triage import progress_age_s
        from dtprof.rundir.incident import read_heartbeats

        st = NodeStatus(self.host, {rank: self._host_of(r) for rank, r in self.ranks.items()},
                        stragglers=self.stragglers(), memory=self.memory_pressure(),
                        headroom={rank: r.room[-1][2] for rank, r in self.ranks.items() if r.room})
        hbs = read_heartbeats(self.node_dir)
        running = [hb for hb in hbs.values() if hb.get("exit") is None]
        if running:
            st.progress_age_s = max(0.0, progress_age_s(hbs, now) or 0.0)
            median = statistics.median(self.durations) if self.durations else 0.0
            st.hang_after_s = float(self.config.get("hang_timeout_s") or max(HANG_MIN_S, HANG_STEPS * median))
            st.hang = st.progress_age_s >= st.hang_after_s
        return st


def _empty_buffers() -> dict[str, pd.DataFrame]:
    from dtprof.analyzers.runmodel import captures, device_comm, with_exit
    from dtprof.rundir.conform import conform

    empty = pd.DataFrame()
    return {"spans": conform("spans", empty), "groups": conform("groups", empty),
            "collectives": device_comm(with_exit(conform("collectives", empty)), np.zeros(0, np.int64)),
            "captures": captures(conform("meta", empty))}


def _gib(v) -> str:
    return "?" if v is None else f"{float(v) / 2**30:.2f} GiB"


def _meminfo() -> tuple[float | None, float | None]:
    """(MemAvailable, MemTotal) of this machine in bytes; (None, None) without /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            kb = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f}
        return kb["MemAvailable"], kb["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None, None


def _process_room(pid: int, avail: float, total: float) -> tuple[float, float, float] | None:
    """(used, room, capacity) of a CPU rank's process: under an address-space limit its address space against the
    limit (what a CPU allocator failure comes from) and the machine's available memory; else its resident bytes
    against the available memory. None once the process is gone."""
    import os

    try:
        with open(f"/proc/{pid}/statm") as f:
            size, resident = (int(x) * os.sysconf("SC_PAGE_SIZE") for x in f.read().split()[:2])
        with open(f"/proc/{pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max address space"))
    except (OSError, StopIteration, ValueError):
        return None
    soft = line.split()[3]
    if soft.isdigit():
        limit = float(soft)
        return float(size), max(0.0, min(limit - size, avail)), min(limit, total)
    return float(resident), avail, total


def _num(v) -> float | None:
    return None if v is None or pd.isna(v) else float(v)
