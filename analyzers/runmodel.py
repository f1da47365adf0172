"""The run model: a run's derived columns, computed once when the run is loaded. This is their only home.

``RunModel.of(run, warmup)`` builds (and caches on the ``Run``) everything that more than one consumer needs and
that used to be derived again in each of them. Analyzers, the HTML report and its figures, the Perfetto export,
compare and triage read these columns; none derives them again.

- ``collectives`` = the run's collectives plus ``exit_ns``: when the operation was seen to end (``end_ns``, else
  ``return_ns`` when completion was never seen), ``comm`` (whether it is communication) and ``comm_start_ns`` (when
  its communication began, as far as known): ``device_comm``. Loaded on first use: only the views that draw rows
  read it.
- ``spans``: the run's spans, with the stages of pipelines that ran without schedule hooks recognised from what
  their ranks did (``pp_forward``/``pp_backward`` spans with stage and micro-batch: analyzers/pipeinfer.py).
- ``gpu_ranks``: the ranks whose device is a GPU (the ranks table's ``device_type`` "cuda").
- ``clock``: one clock model per host (``analyzers/clock.py``: offset + drift fitted on collective exits against
  the reference host, ``residual_ns`` the stated uncertainty), from the exits reduced per (instance, host)
  (``clock.exit_sums``): the node summaries' (source "summaries", a node without one reduced here from its own
  rows) or the whole run's rows reduced at once (source "raw"); the same reduction either way, merged per
  (instance, host) and fitted by one DuckDB query over them (``clock.fit_clocks``).
  ``align(t, rank)`` / ``align_host(t, host)`` put a rank's or host's monotonic times on the reference host's
  clock; every aligned time anywhere comes from them.
- ``steps``: per rank-step ``start_ns``, ``end_ns``, ``duration_s``, ``aligned_start_ns``, ``aligned_end_ns``,
  ``warmup``, ``traced`` (a trace capture disturbed it), ``flops_counted`` (it ran under FlopCounterMode),
  ``boundary_only`` (sampling recorded only its times), ``timed`` (none of the first three: its time counts),
  ``measured`` (timed, recorded in full detail on every rank, and read), plus the steps table's per-step
  numbers (peak memory, tokens, samples, FLOPs, detail).
- ``job``: per step ``time_s`` (the job's step time: the slowest rank's duration, ``analyzers/steps.py``),
  ``warmup``, ``traced``, ``flops_counted``, ``boundary_only``, ``timed``, ``detail_skipped`` (recorded in full
  detail, but a long run's analysis reads only every ``detail_every``-th detailed block: steps.detail_every),
  ``measured``; ``measured_steps`` the set of measured step indices.
- ``captures``: the ``trace_capture`` meta rows as rank, start_ns, end_ns: the intervals the profiler capture
  disturbed (kept out of step statistics, never read as data wait).
- ``pipeline_schedule`` / ``mesh``: the first meta row of that kind (dict) or None.

Other tables (``ranks``, ``spans``, ``groups``, ...) are the run's own and are reached through the model too, so an
analyzer takes the model wherever it took the run.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from dtprof.analyzers import breakdown as breakdown_mod
from dtprof.analyzers import clock as clock_mod
from dtprof.analyzers import pipeinfer
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers import whatif as whatif_mod
from dtprof.rundir.schema import TABLES


@dataclass
class RunModel:
    run: Any                       # dtprof.rundir.run.Run
    clock: pd.DataFrame
    steps: pd.DataFrame
    job: pd.DataFrame
    warmup_steps: int
    warmup_source: str
    captures: pd.DataFrame
    span_slice: pd.DataFrame | None = None   # ``spans`` is this slice of the run's spans (``sliced``), not all
    # source "summaries": the stored node summaries' rank_steps as read, the skipped detail's blanked
    # (blank_skipped; ``steps`` shares their columns; the summary's per rank-step figures are taken from
    # here, not read again); None where no node has one
    stored_rank_steps: pd.DataFrame | None = None
    # the analysis reads the spans and collectives of every this-many-th detailed block (steps.detail_every; 1: all):
    # the others' rows are left out of ``spans`` and ``collectives``
    detail_every: int = 1

    def sliced(self, spans: pd.DataFrame) -> RunModel:
        """This model whose ``spans`` are ``spans`` (a slice read with ``Run.read_spans``): for analyzers that
        need only some spans, so the others are never loaded. Pipelines are recognised in the slice as in the
        whole (``pipeline_spans``)."""
        return replace(self, span_slice=self.pipeline_spans(spans))

    def pipeline_spans(self, spans: pd.DataFrame) -> pd.DataFrame:
        """``spans`` with the pipeline stages that ran without schedule hooks recognised (analyzers/pipeinfer.py);
        the collectives are read only where some rank runs several forwards a step."""
        if not pipeinfer.may_hold_pipeline(spans):
            return spans
        return pipeinfer.with_pipeline_spans(spans, self.collectives)

    @classmethod
    def of(cls, run, warmup: int | None = None, source: str = "summaries",
           detail_every: int | None = None) -> RunModel:
        """The model of ``run`` for this warm-up choice (None: detected), built once per ``Run``, choice and
        ``source`` of the clock fit's exits ("summaries": the node summaries', "raw": the whole run's rows).
        ``detail_every``: read every this-many-th detailed block (None: as the run's size decides)."""
        cache = run.__dict__.setdefault("_run_models", {})
        key = (warmup, source, detail_every)
        if key not in cache:
            cache[key] = build(run, warmup, source, detail_every)
        return cache[key]

    @cached_property
    def collectives(self) -> pd.DataFrame:
        return device_comm(with_exit(self._detail_read("collectives")), self.gpu_ranks)

    @cached_property
    def read_spans(self) -> pd.DataFrame:
        return self.pipeline_spans(self._detail_read("spans"))

    @cached_property
    def skipped_steps(self) -> np.ndarray:
        """The steps whose detail this analysis does not read (``job["detail_skipped"]``)."""
        return self.job["step"].to_numpy()[self.job["detail_skipped"].to_numpy(bool)]

    def _detail_read(self, table: str) -> pd.DataFrame:
        """The run's ``table`` (spans or collectives) less the rows of the steps whose detail is skipped (only the
        others read, where the run's files allow: ``Run.read_rows``)."""
        if not len(self.skipped_steps):
            return self.run.table(table)
        return self.run.read_rows(table, skip_steps=self.skipped_steps)

    @cached_property
    def gpu_ranks(self) -> np.ndarray:
        return gpu_ranks(self.run.ranks)

    def __getattr__(self, name: str) -> Any:
        if name == "spans":
            return self.span_slice if self.span_slice is not None else self.read_spans
        if name in TABLES:   # the run's own tables, for analyzers that take the model where they took the run
            return self.run.table(name)
        raise AttributeError(name)

    @property
    def path(self):
        return self.run.path

    @property
    def measured_steps(self) -> set[int]:
        return set(self.job.loc[self.job["measured"], "step"].tolist())

    def align(self, t, rank) -> np.ndarray:
        """Times ``t`` (ns) of ranks ``rank`` on the reference host's clock."""
        return clock_mod.align_by_rank(self.run, t, rank, self.clock)

    def align_host(self, t, host) -> np.ndarray:
        """Times ``t`` (ns) of hosts ``host`` (host names) on the reference host's clock."""
        return clock_mod.align_times(t, host, self.clock)

    def meta_value(self, kind: str) -> dict | None:
        m = self.run.meta
        for v in m.loc[m["kind"].astype(str) == kind, "value"]:
            if isinstance(v, dict):
                return v
        return None


def with_exit(collectives: pd.DataFrame) -> pd.DataFrame:
    """``collectives`` plus ``exit_ns``: ``end_ns``, else ``return_ns`` (completion never seen)."""
    c = collectives
    exit_ns = c["end_ns"].astype("Int64").fillna(c["return_ns"]).to_numpy(np.int64) if len(c) else np.zeros(0, np.int64)
    return c.assign(exit_ns=exit_ns)


def gpu_ranks(ranks: pd.DataFrame) -> np.ndarray:
    """The ranks whose device is a GPU (sorted)."""
    on_gpu = ranks["device_type"].astype(str).to_numpy() == "cuda"
    return np.unique(ranks["rank"].to_numpy(np.int64)[on_gpu])


def device_comm(c: pd.DataFrame, gpus: np.ndarray) -> pd.DataFrame:
    """``c`` (with ``exit_ns``) plus ``comm`` and ``comm_start_ns`` (docs/metrics.md, "Step breakdown", "Waiting for
    the GPU"). On a GPU rank a collective's host call is not its communication: a one-rank group's collective
    communicates nothing (``comm`` False), and where NCCL timed the work on the device (``gpu_duration_ns``) its
    communication is that long, ending at its completion: ``comm_start_ns`` = max(issue, exit - GPU duration). On a
    CPU rank the host call is the communication (``comm`` True, ``comm_start_ns`` = ``issue_ns``)."""
    issue = c["issue_ns"].to_numpy(np.int64)
    on_gpu = np.isin(c["rank"].to_numpy(np.int64), gpus)
    dur = c["gpu_duration_ns"].astype("Int64").to_numpy(np.int64, na_value=-1) if len(c) else np.zeros(0, np.int64)
    timed = on_gpu & (dur >= 0)
    start = np.where(timed, np.maximum(issue, c["exit_ns"].to_numpy(np.int64) - dur), issue)
    one = c["group_size"].to_numpy(np.int64) == 1
    return c.assign(comm=~(on_gpu & one), comm_start_ns=start)


def captures(meta: pd.DataFrame) -> pd.DataFrame:
    """The trace_capture meta rows: rank, start_ns, end_ns, steps (list)."""
    rows = [(int(r), int(v["start_ns"]), int(v["end_ns"]), [int(s) for s in v.get("steps") or []])
            for r, k, v in zip(meta["rank"], meta["kind"].astype(str), meta["value"])
            if k == "trace_capture" and isinstance(v, dict) and v.get("start_ns") is not None
            and v.get("end_ns") is not None]
    return pd.DataFrame(rows, columns=["rank", "start_ns", "end_ns", "steps"]).astype(
        {"rank": "int64", "start_ns": "int64", "end_ns": "int64"})


def _traced(per: pd.DataFrame, cap: pd.DataFrame) -> np.ndarray:
    """Per rank-step: a capture on that rank overlaps the step's window or names the step."""
    out = np.zeros(len(per), bool)
    if cap.empty or per.empty:
        return out
    rank, step = per["rank"].to_numpy(np.int64), per["step"].to_numpy(np.int64)
    s, e = per["start_ns"].to_numpy(np.int64), per["end_ns"].to_numpy(np.int64)
    for c in cap.itertuples(index=False):   # one per capture (a handful per run)
        mine = rank == c.rank
        out |= mine & (s < c.end_ns) & (e > c.start_ns)
        out |= mine & np.isin(step, c.steps)
    return out


def exit_sums(run, source: str = "summaries"):
    """``clock.exit_sums`` of the run as rundir.rows.Rows (reduced by the fit in DuckDB): "raw", of all its
    collectives rows at once; "summaries", the node summaries' files (a node without a stored one reduced here from
    its own rows)."""
    from dtprof.rundir.rows import Rows

    of = all_exit_sums
    if source == "raw":
        return Rows.of("clock_exits", of(run))
    facts, _ = run.node_summaries(tables=())
    missing = [nd for nd, f in zip(run.node_dirs, facts) if f is None]
    if len(missing) == len(run.node_dirs):
        return Rows.of("clock_exits", of(run))
    return run.summary_rows("clock_exits", facts, {nd: of(run.node_run(nd)) for nd in missing})


def all_exit_sums(run) -> pd.DataFrame:
    """``clock.exit_sums`` of every collectives row of ``run`` (the skipped detail's too), made once per ``Run``: the
    clock fit and the node summary read the same."""
    cache = run.__dict__
    if "_exit_sums" not in cache:   # only the columns read (a long run's collectives are never whole in memory)
        co = run.read_rows("collectives", columns=EXIT_COLUMNS)
        cache["_exit_sums"] = clock_mod.exit_sums(run.ranks, with_exit(co))
    return cache["_exit_sums"]


# the collectives columns the exits are reduced from (with_exit, clock.exit_sums; issue_ns: its times are checked)
EXIT_COLUMNS = ("rank", "op", "group", "seq", "async_op", "issue_ns", "return_ns", "end_ns")


def rank_steps(run, source: str = "summaries") -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(per rank-step: ``steps.rank_steps``' columns, the stored node summaries' rank_steps or None): "raw", from
    the steps table; "summaries", from the node summaries' rank_steps (which carry the steps table's numbers, so the
    steps table is not read: 16.4 M rows at 16,384 x 1,000), a node without a stored one from its own steps."""
    from dtprof.analyzers.steps import by_rank_step

    if source == "raw":
        return steps_mod.rank_steps(run.steps), None
    facts, tables = run.node_summaries(tables=("rank_steps",))
    missing = [nd for nd, f in zip(run.node_dirs, facts) if f is None]
    if len(missing) == len(run.node_dirs):
        return steps_mod.rank_steps(run.steps), None
    stored = tables["rank_steps"]
    per = pd.concat([steps_mod.with_duration(stored)]
                    + [steps_mod.rank_steps(run.node_run(nd).steps) for nd in missing], ignore_index=True)
    return by_rank_step(per), stored


def build(run, warmup: int | None = None, source: str = "summaries", detail_every: int | None = None) -> RunModel:
    clk = clock_mod.fit_clocks(run.ranks, exit_sums(run, source))
    cap = captures(run.meta)
    per, stored = rank_steps(run, source)
    per["traced"] = _traced(per, cap)
    # ran under FlopCounterMode while other steps did not: slow for dtprof's sake (`dtprof run` counts one step).
    # When every step carries executed FLOPs (a run annotated that way) there is no undisturbed step to prefer.
    counted = per["executed_flops"].notna().to_numpy()
    per["flops_counted"] = counted & ~counted.all()
    per["boundary_only"] = per["detail"].to_numpy(np.float64) == 0    # sampling recorded only its boundary
    job = steps_mod.job_steps(per)
    stored_every = stored_detail_every(run, source)
    n_warm, warmup_source = steps_mod.warmup_of(job, warmup)
    warm = set(job["step"].to_numpy()[:n_warm].tolist())
    job["warmup"] = job["step"].isin(warm)
    # timed: its step time counts; measured: and every rank recorded it in full detail (the breakdown, overlap,
    # what-if and stragglers read spans and collectives, which a boundary-only step has none of)
    job["timed"] = ~job["warmup"] & ~job["traced"] & ~job["flops_counted"]
    recorded = (job["timed"] & ~job["boundary_only"]).to_numpy(bool)
    every = detail_every or max([steps_mod.detail_every(job["step"].to_numpy()[recorded], len(steps_mod.distinct(
        per["rank"].to_numpy(np.int64))))] + stored_every)
    # detail_skipped: recorded in full detail, but a long run's analysis reads only every `every`-th block's
    job["detail_skipped"] = recorded & ~steps_mod.detail_read(job["step"].to_numpy(), every)
    job["measured"] = recorded & ~job["detail_skipped"].to_numpy(bool)
    at = np.searchsorted(job["step"].to_numpy(np.int64), per["step"].to_numpy(np.int64))   # each one's step's row
    for c in ("warmup", "timed", "measured"):
        per[c] = job[c].to_numpy(bool)[at]
    rank = per["rank"].to_numpy(np.int64)
    per["aligned_start_ns"] = clock_mod.align_by_rank(run, per["start_ns"].to_numpy(np.int64), rank, clk)
    per["aligned_end_ns"] = clock_mod.align_by_rank(run, per["end_ns"].to_numpy(np.int64), rank, clk)
    skipped = job["step"].to_numpy()[job["detail_skipped"].to_numpy(bool)]
    if stored is not None and len(skipped):   # blanked once, as read: the stored columns are not kept beside
        stored = blank_skipped(stored, skipped)
    return RunModel(run=run, clock=clk, steps=per, job=job, warmup_steps=n_warm,
                    warmup_source=warmup_source, captures=cap, stored_rank_steps=stored, detail_every=every)


def stored_detail_every(run, source: str) -> list[int]:
    """The ``detail_every`` of each stored node summary: the run reads the blocks of the largest (a subset of
    every other's)."""
    if source == "raw":
        return []
    facts, _ = run.node_summaries(tables=())
    return [int(f.get("detail_every") or 1) for f in facts if f is not None]


# the rank_steps columns a rank-step whose detail is not read holds nothing in (its time is all "other")
DETAIL_COLUMNS = ("compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "overlap_s",
                  *(f"bd_{p}_s" for p in breakdown_mod.PARTS if p != "other"),
                  *(f"work_{p}_ns" for p in whatif_mod.WORK_PARTS))


def blank_skipped(per: pd.DataFrame, steps: np.ndarray) -> pd.DataFrame:
    """The stored summaries' rank_steps ``per`` with the rank-steps of ``steps`` as a summary that did not read
    their detail makes them: no span or collective in the window, so nothing but ``other``. In place (``per`` is
    the read's own frame: pandas writes a column no other frame shares in place), a column at a time, over a mask
    of the rows: at 16,384 x 1,000 a new array per column (131 MB, ~20 columns) cost more in first-touched memory
    than the writes, and a copy of them all beside the frame was 2.6 GB. A column that has those values already is
    left alone (a summary that did not read these steps either has most of them). Returns ``per``."""
    step = per["step"].to_numpy(np.int64)
    lo = int(step.min()) if len(step) else 0
    skip = np.zeros(int(step.max()) - lo + 1 if len(step) else 0, bool)
    steps = np.asarray(steps, np.int64)
    skip[steps[(steps >= lo) & (steps - lo < len(skip))] - lo] = True
    at = skip[step - lo]
    if not at.any():
        return per

    def put(c: str, values: np.ndarray | float) -> None:
        x = per[c].to_numpy()
        if np.isscalar(values):
            differs = (~np.isnan(x) if np.isnan(values) else x != values) & at
        else:
            differs = (x != values) & at
        if differs.any():
            per.loc[at, c] = values if np.isscalar(values) else np.asarray(values)[at]

    for c in DETAIL_COLUMNS:
        put(c, 0)
    put("overlap_ratio", np.nan)
    put("bd_other_s", (per["end_ns"].to_numpy(np.int64) - per["start_ns"].to_numpy(np.int64)) / 1e9)
    level = per["level"]
    if "hook" not in level.cat.categories:   # (not a level of the summary: as summarize orders them, sorted)
        per["level"] = level = level.cat.set_categories(sorted([*level.cat.categories, "hook"]))
    if ((level.cat.codes.to_numpy() != level.cat.categories.get_loc("hook")) & at).any():
        per.loc[at, "level"] = "hook"
    return per
