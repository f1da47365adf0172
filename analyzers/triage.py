"""Incident triage: one verdict and its evidence, from a run directory (docs/triage.md). No torch import.

Inputs, all optional: the run tables (``open_run``), each rank's ``heartbeat.json`` and ``dump-<id>.json``
(collectors/heartbeat.py), the watchdog's ``node_dir/triage/{hang,crash,exit}.json`` (dtprof/watchdog.py), the
job's ``node_dir/stderr.log`` / ``stdout.log``, and Flight Recorder entries (in the dumps, or external files).

Verdicts, checked in this order (the first that applies is the root cause; the others still add evidence):

1. **mismatch** — one collective instance, identified across ranks by (group, seq) as in the run format and
   PyTorch's ``torchfrtrace``, was called with a different op, size (``in_bytes``) or dtype on different ranks.
   From the ``collectives`` table and Flight Recorder entries.
2. **hang** — the watchdog fired (or, live, no rank progressed for ``stale_s``), the job's output holds a
   collective timeout, or Flight Recorder dumps given explicitly show ranks that never reached a collective the
   others entered. The collective most waiting ranks are inside (group, seq, op) is "the collective"; the
   culprits are the group's members that are not inside it (where they are instead comes from their stacks).
   Without in-flight collectives, the Flight Recorder's newest seq per rank and group gives the same answer.
3a. **oom** — a rank failed an allocation (its ``oom`` meta row, or an out-of-memory message in its exception dump
   or the job's output: dtprof/oom.py): the request, step, phase, its memory ledger and the levers that would have
   made room (analyzers/memory.py ``levers``); the other ranks are listed as stopped by it.
3. **crash** — a rank exited non-zero or was killed: torchrun's failure report ("Root Cause" block:
   ``exitcode : -9`` = SIGKILL) and the watchdog's record of which rank's process vanished first.
4. **interrupted** — a node's ``dtprof run`` launcher was killed before it recorded the job's end (node.json
   still "running", its process gone: ``dtprof.rundir.run.launcher_killed``); its timings are not a straggler's.
5. **numerics** / **divergence** — the earliest numerics incident (analyzers/health.py): a local loss or gradient
   norm that went non-finite, a loss spike or gradient-norm explosion ("numerics"), or data-parallel replicas whose
   parameter fingerprints differ ("divergence"); ``step`` is the incident's step.
6. **straggler** — a rank the analysis classifies as a persistent straggler (``stragglers.PERSISTENT_RULE``:
   slow in at least 75 % of the measured steps, by compute or by holding its peers up at a collective), with the
   NVML evidence the analysis built for it (throttle reasons, SM clock, temperature, power, ECC errors).
7. **healthy** otherwise.

Every stop of the job's processes by the launcher (node.json "stops": the hang watchdog's, or leftovers after the
command ended) is named in the evidence, with its signals, grace period and whether any process survived it.
"""
from __future__ import annotations

import functools
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dtprof.analyzers.collectives import own_records
from dtprof.reports.fmt import fmt_bytes  # the one byte formatter (the one module of reports/ analyzers use)
from dtprof.rundir.incident import Incident, best_dump
from dtprof.rundir.schema import P2P_OPS
from dtprof.rundir.writer import stop_text
from dtprof.watchdog import STALE_BEAT_S

VERDICTS = ("hang", "crash", "mismatch", "interrupted", "straggler", "healthy", "oom", "numerics", "divergence")
# Collective timeouts and transport failures in a job's output (NCCL watchdog, gloo, c10d store).
TIMEOUT_PATTERNS = [
    re.compile(r"Watchdog caught collective operation timeout[^\n]*"),
    re.compile(r"WorkNCCL\(SeqNum=\d+, OpType=\w+[^\n]*timeout[^\n]*", re.I),
    re.compile(r"[^\n]*gloo[^\n]*(?:Timed out|timeout|Connection closed by peer|Connection reset)[^\n]*", re.I),
    re.compile(r"[^\n]*NCCL (?:error|WARN)[^\n]*", re.I),
    re.compile(r"[^\n]*DistStoreError[^\n]*"),
]
_NCCL_SEQ = re.compile(r"SeqNum=(\d+), OpType=(\w+)")
# a rank's own exception saying its collective timed out (gloo's, NCCL's watchdog): it waited, it is not the cause
_COLL_TIMEOUT = re.compile(r"Timed out waiting \d+ms for \w+ operation|Watchdog caught collective operation timeout")
# a rank's own exception saying a peer closed its connection: in a collective timeout, the ranks that waited beside
# the one that timed out raise this as it exits (within PEER_LOSS_S of its error); the late rank when it enters
_PEER_CLOSED = re.compile(r"Connection closed by peer|Connection reset by peer")
PEER_LOSS_S = 2.0
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/dtprof/", "/collectors/", "<frozen")


# ------------------------------------------------------------------------------------------------- helpers
def where(dump: dict | None) -> str | None:
    """'train.py:88 in __next__' for the innermost frame that is the user's code (outside dtprof, torch and other
    installed packages): of the exception's traceback when the dump records one, else of the main thread."""
    if not dump:
        return None
    exc = dump.get("exception") or {}
    main = next((s for s in dump.get("stacks") or [] if s.get("main")), None)
    frames = exc.get("frames") or (main or {}).get("frames")
    if not frames:
        return None
    user = [f for f in frames if not any(part in f["file"] for part in _LIBRARY_PARTS)]
    f = (user or frames)[-1]
    text = f"{Path(f['file']).name}:{f['line']} in {f['func']}"
    inner = frames[-1]
    if user and inner is not f:
        text += f" (inside {Path(inner['file']).name}:{inner['line']} in {inner['func']})"
    return text


def rank_label(rank: int, ranks_tbl) -> str:
    """'rank 3 (host n1, GPU 3)' or 'rank 3 (host n1, cpu)'."""
    if ranks_tbl is not None and len(ranks_tbl):
        row = ranks_tbl[ranks_tbl["rank"] == rank]
        if len(row):
            r = row.iloc[0]
            dev = (f"GPU {int(r['device_index'])}" if str(r["device_type"]) == "cuda" and
                   not _isna(r["device_index"]) else str(r["device_type"]) or "device ?")
            return f"rank {rank} (host {r['host']}, {dev})"
    return f"rank {rank}"


def _isna(v) -> bool:
    try:
        import pandas as pd
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def ranks_text(ranks) -> str:
    """[0,1,2,4,5] -> '0–2, 4–5'."""
    ranks = sorted(set(int(r) for r in ranks))
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}–{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _group_members(groups_tbl, group: str, fallback) -> list[int]:
    if groups_tbl is not None and len(groups_tbl):
        g = groups_tbl[groups_tbl["group"].astype(str) == str(group)]
        if len(g):
            return sorted({int(x) for x in str(g["ranks"].iloc[0]).split(",") if x.strip()})
    return sorted(fallback)


def mismatch_candidates(parts) -> list[tuple[str, int]]:
    """The collective instances (group, seq) whose ranks may disagree in op, size or dtype, from the arrivals
    reduced per part (analyzers/stragglers.py ``arrival_parts``: the node summaries', rundir.rows.Rows, reduced in
    DuckDB): a part with more than one kind, or parts of one instance with different kinds. Only their rows need
    reading for ``find_mismatches``."""
    bad = parts.query('SELECT "group", seq FROM rows GROUP BY "group", seq '
                      'HAVING min(kind) <> max(kind) OR max(kinds) > 1 ORDER BY "group", seq')
    return [(str(g), int(q)) for g, q in zip(bad["group"], bad["seq"])]


def find_mismatches(collectives, fr_entries) -> list[dict]:
    """Collective instances (group, seq) whose op, size or dtype differ across ranks."""
    import pandas as pd

    parts = []
    if collectives is not None and len(collectives):
        c = collectives[~collectives["op"].astype(str).isin(P2P_OPS)]
        parts.append(pd.DataFrame({"rank": c["rank"].astype("int64"), "group": c["group"].astype(str),
                                   "seq": c["seq"].astype("int64"), "op": c["op"].astype(str),
                                   "in_bytes": c["in_bytes"].astype("int64"), "dtype": c["dtype"].astype(str),
                                   "source": "collectives table"}))
    if fr_entries is not None and len(fr_entries):
        f = fr_entries[~fr_entries["is_p2p"].astype(bool)].dropna(subset=["rank", "seq"])
        parts.append(pd.DataFrame({"rank": f["rank"].astype("int64"), "group": f["group"].astype(str),
                                   "seq": f["seq"].astype("int64"), "op": f["op"].astype(str),
                                   "in_bytes": f["in_bytes"].astype("Int64").fillna(-1).astype("int64"),
                                   "dtype": f["dtype"].astype(str), "source": "Flight Recorder"}))
    if not parts:
        return []
    out = []
    for source_df in parts:  # compare like with like: the two sources name dtypes and groups differently
        if source_df.empty:
            continue
        g = source_df.groupby(["group", "seq"], sort=True)
        n = g[["op", "in_bytes", "dtype"]].nunique()
        bad = n[(n > 1).any(axis=1)]
        for (group, seq), row in bad.iterrows():
            inst = source_df[(source_df["group"] == group) & (source_df["seq"] == seq)]
            fields = [c for c in ("op", "in_bytes", "dtype") if row[c] > 1]
            # the odd ones out: ranks whose values differ from the most common combination
            key = inst[["op", "in_bytes", "dtype"]].astype(str).agg("|".join, axis=1)
            common = key.value_counts().index[0]
            odd = sorted(inst.loc[key != common, "rank"].astype(int).unique())
            per_rank = {int(r): {"op": o, "in_bytes": int(b), "dtype": d}
                        for r, o, b, d in zip(inst["rank"], inst["op"], inst["in_bytes"], inst["dtype"])}
            out.append({"group": str(group), "seq": int(seq), "fields": fields, "odd_ranks": odd,
                        "per_rank": per_rank, "op": inst["op"].mode().iloc[0], "source": inst["source"].iloc[0]})
        if out:
            break
    return out


def _in_flight(hbs: dict, dumps: dict) -> dict[int, dict | None]:
    """The collective each rank is inside, from its incident dump if any, else its heartbeat."""
    out = {}
    for r in set(hbs) | set(dumps):
        d = best_dump(dumps.get(r, {}))
        src = d if d is not None else hbs.get(r)
        out[r] = src.get("collective") if src else None
    return out


def find_hang(hbs, dumps, known_ranks, groups_tbl, fr_entries, now_ns) -> dict:
    """The collective most ranks wait in and the members that are not in it."""
    inflight = _in_flight(hbs, dumps)
    inside = {r: c for r, c in inflight.items() if c}
    if inside:
        key = Counter((str(c.get("group")), c.get("seq"), c.get("op")) for c in inside.values()).most_common(1)[0][0]
        group, seq, op = key
        waiting = sorted(r for r, c in inside.items() if (str(c.get("group")), c.get("seq"), c.get("op")) == key)
        members = _group_members(groups_tbl, group, known_ranks)
        culprits = [r for r in members if r not in waiting]
        entered = [inside[r].get("entered_ns") for r in waiting if inside[r].get("entered_ns")]
        waited_s = (now_ns - min(entered)) / 1e9 if entered and now_ns else None
        return {"collective": {"op": op, "group": group, "seq": seq}, "waiting": waiting, "culprits": culprits,
                "waited_s": waited_s, "source": "in-flight collectives"}
    if fr_entries is not None and len(fr_entries):  # fall back on the Flight Recorder's newest seq per rank
        members = {}
        if groups_tbl is not None and len(groups_tbl):
            members = {str(g): [int(x) for x in str(rs).split(",") if x.strip()]
                       for g, rs in zip(groups_tbl["group"], groups_tbl["ranks"])}
        inst = match_across_ranks(fr_entries, members or None)
        inst = inst[inst["ranks_missing"].str.len() > 0]
        if len(inst):
            last = inst.iloc[0]  # the earliest instance some rank never reached
            op = last["ops"][0] if last["ops"] else None
            return {"collective": {"op": op, "group": str(last["group"]), "seq": int(last["seq"])},
                    "waiting": list(last["ranks_present"]), "culprits": list(last["ranks_missing"]),
                    "waited_s": None, "source": "Flight Recorder"}
    return {"collective": None, "waiting": [], "culprits": [], "waited_s": None, "source": None}


# A process in one of these states (/proc/<pid>/stat, recorded by the watchdog as it fires) cannot run at all
FROZEN_STATES = {"T": "is stopped (SIGSTOP)", "t": "is stopped by a tracer",
                 "D": "is in an uninterruptible sleep in the kernel"}
# A heartbeat this old while another rank's is fresh (under half of it) is one that stopped: a rank's heartbeat
# thread beats every 0.5 s whatever its main thread does, so only a frozen process (or one holding the GIL inside
# C++) stops beating: STALE_BEAT_S (dtprof/watchdog.py, which judges a stalled heartbeat thread by it too)


def frozen_ranks(hang_recs: list[dict], heartbeats: dict, now_ns: int | None) -> dict[int, str]:
    """Ranks whose whole process stopped, each with how it shows: a process state that cannot run, or a heartbeat
    that stopped while other ranks' beat on. From the watchdog's hang records (``heartbeat_age_s``,
    ``process_state``), else (live) from the heartbeats' own times against ``now_ns``."""
    ages: dict[int, tuple[float, str | None]] = {}
    for rec in hang_recs:
        for r, v in (rec.get("ranks") or {}).items():
            if v.get("heartbeat_age_s") is not None:
                ages[int(r)] = (float(v["heartbeat_age_s"]), v.get("process_state"))
    if not ages and now_ns:
        ages = {r: ((now_ns - hb["t_ns"]) / 1e9, None) for r, hb in heartbeats.items()
                if hb.get("t_ns") and hb.get("exit") is None}
    out = {}
    for r, (age, state) in ages.items():
        fresh = [a for q, (a, _) in ages.items() if q != r]
        if state in FROZEN_STATES:
            out[r] = f"its process {FROZEN_STATES[state]}; its heartbeat stopped {age:.0f} s before the hang was seen"
        elif age >= STALE_BEAT_S and fresh and min(fresh) < age / 2:
            out[r] = (f"its heartbeat stopped {age:.0f} s before the hang was seen while the others' beat on "
                      f"(newest {min(fresh):.1f} s old): "
                      + (f"its process runs (state {state}) but its heartbeat thread is blocked (the GIL held inside "
                         f"C++, or a fault of dtprof's own)" if state else "its whole process froze"))
    return out


def match_across_ranks(entries, group_ranks: dict[str, list[int]] | None = None):
    """Match collective entries by (group, seq). Returns a DataFrame per instance: group, seq, ops, sizes,
    dtypes (distinct values seen), ranks_present, ranks_missing, mismatch (op, size or dtype differ).

    ``group_ranks`` names each group's members; without it a group's members are all ranks seen in it.
    """
    import pandas as pd

    e = entries[~entries["is_p2p"].astype(bool)].dropna(subset=["rank", "seq"])
    if e.empty:
        return pd.DataFrame(columns=["group", "seq", "ops", "sizes", "dtypes", "ranks_present", "ranks_missing",
                                     "mismatch"])
    g = e.groupby(["group", "seq"], sort=True)
    inst = pd.DataFrame({
        "ops": g["op"].agg(lambda s: sorted(set(s))),
        "sizes": g["input_sizes"].agg(lambda s: sorted(set(s))),
        "dtypes": g["dtype"].agg(lambda s: sorted(set(s))),
        "ranks_present": g["rank"].agg(lambda s: sorted(int(r) for r in set(s))),
    }).reset_index()
    # A rank is missing from an instance if it dumped but its newest entry in that group is older (it never got
    # there). Ranks older entries fell out of the ring buffer for are not "missing"; ranks without a dump are
    # unknown and not listed.
    dumped = sorted(int(r) for r in entries["rank"].dropna().unique())
    newest = e.groupby(["group", "rank"])["seq"].max()
    members = {str(k): sorted(v) for k, v in (group_ranks or {}).items()}
    missing = []
    for gr, seq in zip(inst["group"], inst["seq"]):
        cand = [r for r in members.get(str(gr), dumped) if r in dumped]
        missing.append([r for r in cand if newest.get((gr, r), -1) < seq])
    inst["ranks_missing"] = missing
    inst["mismatch"] = (inst["ops"].str.len() > 1) | (inst["sizes"].str.len() > 1) | (inst["dtypes"].str.len() > 1)
    return inst


# NCCL's OpType names -> dtprof's canonical op names (dtprof.rundir.schema.COLLECTIVE_OPS)
_NCCL_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
             "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
             "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter"}


def log_timeouts(text: str) -> list[str]:
    out = []
    for pat in TIMEOUT_PATTERNS:
        for m in pat.finditer(text):
            line = m.group(0).strip()
            if line not in out:
                out.append(line)
    return out[:20]


# a '[rankN]: SomeError: message' line torchrun's workers print
EXCEPTION_LINE = re.compile(r"^\[rank(\d+)\]:\s*(\w[\w.]*(?:Error|Exception|Interrupt)\b[^\n]*)$", re.M)


def _exception_line(text: str, rank: int) -> str | None:
    """The last '[rankN]: SomeError: message' line torchrun's workers printed, if any."""
    return _exception_lines(text).get(rank)


@functools.lru_cache(maxsize=2)
def _exception_lines(text: str) -> dict[int, str]:
    """Per rank, its last exception line in ``text``: one pass over the logs for every rank that asks (a pattern
    per rank compiled 16,384 times was seconds of triage at that many ranks; the OOM and crash rules both ask)."""
    return {int(m.group(1)): m.group(2).strip() for m in EXCEPTION_LINE.finditer(text)}


# What libstdc++ prints when a C++ thread ends by unwinding through a noexcept destructor: in torch 2.x, a gloo
# worker thread freeing a finished collective (which holds a Python object: the backward's stashed context) after
# the interpreter began finalising, whose GIL request ends the thread (pytorch issue #190489)
TEARDOWN_ABORT = "terminate called without an active exception"


def _teardown_abort_cause(logs: str) -> str:
    """The known cause of a rank's abort in its interpreter's teardown, when the job's output shows it."""
    if TEARDOWN_ABORT not in logs:
        return ""
    return (f"; the job's output shows '{TEARDOWN_ABORT}', which torch's own teardown abort prints (a gloo thread "
            f"freeing a collective after the interpreter began finalising, pytorch issue #190489)")


def find_stragglers(stragglers: list[dict]) -> list[dict]:
    """Persistent stragglers as the analysis states them (summary ``stragglers``, analyzers/stragglers.py), each
    with its NVML evidence as the analysis built it."""
    return [{"rank": s["rank"], "late_step_frac": s["late_step_frac"], "time_lost_s": s["time_lost_s"],
             "compute_score": s["score"], "reason": s["reason"], "nvml": s["nvml"], "nvml_lines": s["evidence"],
             "method": "dtprof.analyzers.stragglers"}
            for s in stragglers if s["kind"] == "persistent"]


# ------------------------------------------------------------------------------------------------ verdict
@dataclass
class Case:
    """What one triage reads, and the evidence its rules collect in order (a rule may add evidence whether or not
    its verdict applies)."""

    run: Any                    # the run (dtprof.rundir.run.Run), or None: only Flight Recorder files were given
    incident: Incident          # its heartbeats, dumps, watchdog records, logs and Flight Recorder entries
    stragglers: list | None     # the analysis' summary ``stragglers``
    straggler_error: str | None  # why the analysis has none, when it failed
    collectives: Any            # the rows the mismatch check reads
    steps: Any                  # the run's rank-steps (rank, step)
    live: bool
    stale_s: float
    now_ns: int | None
    health: Any = None          # the analysis' summary ``health`` (None: ``health_error``, or no analysis)
    health_error: str | None = None
    evidence: list = field(default_factory=list)
    known: set = field(default_factory=set)
    timeouts: list = field(default_factory=list)

    @classmethod
    def of(cls, run, analysis: Mapping[str, Any]) -> Case:
        """The case of ``run`` from what the analysis found (``triage``'s ``analysis``)."""
        summary = analysis.get("summary") or {}
        model = analysis.get("model")
        return cls(run, analysis["incident"], summary.get("stragglers"), analysis.get("analysis_error"),
                   analysis.get("mismatch_rows"), model.steps if model is not None else None,
                   bool(analysis.get("live", False)), float(analysis.get("stale_s", 60.0)), analysis.get("now_ns"),
                   summary.get("health"), summary.get("health_reason"))

    @property
    def ranks_tbl(self):
        return self.run.ranks if self.run is not None else None

    def label(self, r) -> str:
        return rank_label(r, self.ranks_tbl)

    def rank_steps(self):   # read on first use: most verdicts need no steps
        return self.steps if self.steps is not None else self.run.steps

    def last_step(self, r):
        """The last step a rank recorded ('?' for none)."""
        rs = self.rank_steps() if self.run is not None else None
        done = rs.loc[rs["rank"] == r, "step"] if rs is not None and len(rs) else []
        return int(done.max()) if len(done) else "?"

    def step_of(self, r):
        """The step a rank was in: its newest heartbeat or dump, or the one after its last recorded step (the
        heartbeat is written every 0.5 s, so a fast job can be past it)."""
        last = self.last_step(r)
        cands = ([self.incident.heartbeats.get(r, {}).get("step")]
                 + [d.get("step") for d in self.incident.dumps.get(r, {}).values()])
        cands = [int(c) for c in cands if c is not None] + ([last + 1] if last != "?" else [])
        return max(cands) if cands else "?"

    def stacks_evidence(self, ranks, why: str) -> None:
        for r in ranks:
            d = best_dump(self.incident.dumps.get(r, {}))
            loc = where(d)
            if loc:
                self.evidence.append({"kind": "stack", "rank": r, "message": f"{self.label(r)} {why} at {loc}",
                                      "dump": d.get("request")})

    def result(self, verdict: str, culprits, collective, message: str) -> dict:
        return {"verdict": verdict, "culprit_ranks": sorted(int(r) for r in culprits), "collective": collective,
                "message": message, "evidence": self.evidence}


def _mismatch(c: Case) -> dict | None:
    """1. One collective instance called with a different op, size or dtype on different ranks."""
    rows = c.collectives if c.collectives is not None else c.run.collectives if c.run is not None else None
    mism = find_mismatches(own_records(rows) if rows is not None else None, c.incident.fr)
    if not mism:
        return None
    m = mism[0]
    odd = m["odd_ranks"]
    details = "; ".join(f"rank {r}: {v['op']} {v['in_bytes']} B {v['dtype']}"
                        for r, v in sorted(m["per_rank"].items()) if r in odd or r == min(m["per_rank"]))
    msg = (f"mismatch: {m['op']} #{m['seq']} of group {m['group']} differs in {', '.join(m['fields'])} on "
           f"{', '.join(c.label(r) for r in odd)} ({details})")
    for other in mism[1:5]:
        c.evidence.append({"kind": "mismatch", "message": f"also {other['op']} #{other['seq']} of group "
                           f"{other['group']} differs in {', '.join(other['fields'])} on ranks "
                           f"{ranks_text(other['odd_ranks'])}"})
    c.evidence.insert(0, {"kind": "mismatch", "message": f"from the {m['source']}: " + ", ".join(
        f"rank {r} {v['op']} {v['in_bytes']} B {v['dtype']}" for r, v in sorted(m["per_rank"].items())),
        "per_rank": {str(k): v for k, v in m["per_rank"].items()}})
    return c.result("mismatch", odd, {"op": m["op"], "group": m["group"], "seq": m["seq"]}, msg)


def _timed_out(c: Case) -> dict[int, str | None]:
    """Ranks whose own exception is a collective timeout, each with the torch.distributed call it was in (from its
    traceback's frames), or {}."""
    out = {}
    for r, by_id in c.incident.dumps.items():
        exc = (by_id.get("exception") or {}).get("exception") or {}
        if _COLL_TIMEOUT.search(exc.get("message") or ""):
            calls = [f.get("func") for f in exc.get("frames") or [] if str(f.get("file", "")).endswith(
                "distributed_c10d.py")]
            out[r] = calls[-1] if calls else None
    return out


def _lost_peer_beside(c: Case, timed_out: dict) -> set[int]:
    """Ranks whose own exception is a closed connection raised within PEER_LOSS_S of the first collective timeout's:
    they waited in the collective too and lost the rank that timed out as it exited (under load one waiting rank's
    timeout fires first). None when that leaves no other rank to blame."""
    def at(r):
        return (c.incident.dumps.get(r, {}).get("exception") or {}).get("t_ns")
    first = min((t for t in map(at, timed_out) if t is not None), default=None)
    if first is None:
        return set()
    lost = {r for r, by_id in c.incident.dumps.items() if r not in timed_out and at(r) is not None
            and abs(at(r) - first) <= PEER_LOSS_S * 1e9
            and _PEER_CLOSED.search(((by_id.get("exception") or {}).get("exception") or {}).get("message") or "")}
    return lost if set(c.known) - set(timed_out) - lost else set()


def progress_age_s(heartbeats: Mapping[int, dict], now_ns: int) -> float | None:
    """Seconds since the newest progress (heartbeat ``last_progress_ns``) of any rank at ``now_ns``; None without
    heartbeats. A job still running hangs once this reaches its timeout (triage's ``stale_s``, the live path's
    ``hang_after_s``, dtprof/live.py)."""
    if not heartbeats:
        return None
    return (now_ns - max(hb.get("last_progress_ns") or 0 for hb in heartbeats.values())) / 1e9


def _hang(c: Case) -> dict | None:
    """2. The watchdog fired, no rank progressed for ``stale_s`` (live), the output holds a collective timeout (or
    ranks' own exceptions are collective timeouts while other ranks' are not), or Flight Recorder files given show
    ranks that never reached a collective the others entered."""
    inc = c.incident
    hang_rec = inc.watchdog["hang"][0] if inc.watchdog["hang"] else None
    now = (hang_rec or {}).get("detected_ns") or c.now_ns or time.monotonic_ns()
    stale = progress_age_s(inc.heartbeats, now) if c.live else None
    if stale is not None:
        c.evidence.append({"kind": "heartbeat", "message": f"newest progress on any rank {stale:.1f} s ago"})
    nccl_timeout = next((m for m in (_NCCL_SEQ.search(t) for t in c.timeouts) if m), None)
    # Dumps given with --fr are snapshots taken at one moment (usually a timeout): a rank behind the others in a
    # group is a hang signature. Dumps inside a run only count once something else says the job hung.
    fr_behind = False
    if inc.fr_given and len(inc.fr):
        fr_behind = bool((match_across_ranks(inc.fr)["ranks_missing"].str.len() > 0).any())
        if fr_behind:
            c.evidence.append({"kind": "flight_recorder", "message": "Flight Recorder dumps: some ranks never "
                               "reached a collective the others entered"})
    timed_out = _timed_out(c)
    if not timed_out or set(timed_out) >= set(c.known):
        timed_out = {}   # none, or every rank timed out: nothing tells a rank that never entered
    if not (hang_rec or (stale is not None and stale >= c.stale_s) or nccl_timeout or fr_behind or timed_out):
        return None
    groups_tbl = c.run.groups if c.run is not None else None
    # a rank whose process cannot run (stopped, in the kernel) is the culprit whatever its last beat said it was
    # inside: that beat is older than the freeze; the collective is the one the others wait in
    stopped = sorted({int(r) for rec in inc.watchdog["hang"] for r, v in (rec.get("ranks") or {}).items()
                      if v.get("process_state") in FROZEN_STATES})
    h = find_hang({r: hb for r, hb in inc.heartbeats.items() if r not in stopped},
                  {r: d for r, d in inc.dumps.items() if r not in stopped}, c.known, groups_tbl, inc.fr, now)
    if timed_out and not h["culprits"]:   # the process group timed out first: the ranks that did not wait in it
        lost = _lost_peer_beside(c, timed_out)
        h["waiting"] = sorted(set(timed_out) | lost)
        h["culprits"] = [r for r in sorted(c.known) if r not in h["waiting"]]
        op = next((o for o in timed_out.values() if o), None)
        h["collective"] = h["collective"] or ({"op": op, "group": None, "seq": None} if op else None)
        h["source"] = "the ranks' own collective-timeout errors (the others never entered the collective)"
        c.evidence.append({"kind": "exit", "message": f"ranks {ranks_text(sorted(timed_out))} raised the process "
                           f"group's collective timeout in {op or 'a collective'}; ranks {ranks_text(h['culprits'])} "
                           f"did not" + (f"; ranks {ranks_text(sorted(lost))} lost a peer as it timed out" if lost
                                         else "")})
    in_one = True   # every waiting rank waits in the one collective named
    if stopped:
        others = [r for r in sorted(c.known) if r not in stopped]
        in_one = h["waiting"] == others
        h["culprits"], h["waiting"] = stopped, others
        h["source"] = "the watchdog's process states (a rank that cannot run)"
    if h["collective"] is None and nccl_timeout:
        op = nccl_timeout.group(2).lower()
        h["collective"] = {"op": _NCCL_OPS.get(op, op), "group": None, "seq": int(nccl_timeout.group(1))}
    if hang_rec:
        c.evidence.insert(0, {"kind": "watchdog", "message": f"watchdog: no rank progressed for "
                              f"{hang_rec['idle_s']:.0f} s (--hang-timeout {hang_rec['timeout_s']:g}); job stopped",
                              "missing_dumps": hang_rec.get("missing_dumps", [])})
        if hang_rec.get("missing_dumps"):
            c.evidence.append({"kind": "watchdog", "message": "no state dump from ranks "
                               + ranks_text(hang_rec["missing_dumps"])})
    frozen = frozen_ranks(inc.watchdog["hang"], inc.heartbeats, now if c.live else None)
    for r, how in sorted(frozen.items()):
        c.evidence.append({"kind": "heartbeat", "rank": r, "message": f"{c.label(r)}: {how}"})
    if frozen and not h["culprits"]:   # no collective names the culprit: the rank whose process froze does
        h["culprits"] = sorted(frozen)
        h["waiting"] = [r for r in h["waiting"] if r not in frozen]
        h["source"] = "the ranks' heartbeats (the one that stopped)"
    coll = h["collective"]
    # a collective named by a timeout's error alone (gloo's) has no sequence number
    cname = (coll["op"] + (f" #{coll['seq']}" if coll.get("seq") is not None else "")
             + (f" of group {coll['group']}" if coll.get("group") is not None else "") if coll else "a collective")
    culprits = h["culprits"]
    c.stacks_evidence(culprits, "was")
    c.stacks_evidence(h["waiting"][:1], "waits (like the others)")
    if culprits:
        msg = _hang_message(c, h, culprits, cname)
    elif h["waiting"]:
        msg = (f"hang: ranks {ranks_text(h['waiting'])} wait in {cname}; no rank is missing from it "
               f"(a rank on a node without dtprof, or a hang inside the collective itself)")
    else:
        msg = (f"hang: the job's output reports a timeout in {cname}; no heartbeats say which rank never "
               f"entered it (record with `dtprof run --hang-timeout` to name the culprit)")
    if culprits and culprits[0] in frozen and (coll is None or culprits[0] in stopped):   # the freeze is the story
        msg = (f"hang: {c.label(culprits[0])} froze: {frozen[culprits[0]]}"
               + (f"; ranks {ranks_text(h['waiting'])} wait for it" + (f" in {cname}" if coll and in_one else "")
                  if h["waiting"] else ""))
    elif culprits and culprits[0] in frozen:
        msg += f"; rank {culprits[0]}: {frozen[culprits[0]]}"
    if h["source"]:
        c.evidence.append({"kind": "method", "message": f"culprits from {h['source']}"})
    return c.result("hang", culprits, coll, msg)


def _hang_message(c: Case, h: dict, culprits: list, cname: str) -> str:
    """'hang: rank 3 (...) never entered all_reduce #12 of group 0; ranks 0–2 waited 30 s there; ...'."""
    r0 = culprits[0]
    loc = where(best_dump(c.incident.dumps.get(r0, {})))
    inflight = _in_flight(c.incident.heartbeats, c.incident.dumps).get(r0)
    whats = (f"is inside {inflight.get('op')} #{inflight.get('seq')} of group {inflight.get('group')}"
             if inflight else "never entered")
    who = ", ".join(c.label(r) for r in culprits[:4]) + (f" and {len(culprits) - 4} more" if len(culprits) > 4
                                                         else "")
    waited = f" waited {h['waited_s']:.0f} s there" if h["waited_s"] is not None else " wait there"
    msg = (f"hang: {who} {whats} {cname}" +
           (f"; ranks {ranks_text(h['waiting'])}{waited}" if h["waiting"] else "") +
           (f"; rank {r0} was at {loc}" if loc else ""))
    if inflight:
        msg = msg.replace(f"{whats} {cname}", f"{whats} while the others wait in {cname}")
    return msg


def _launcher_name(command) -> str:
    """'torchrun's agent' for a torchrun command, else the command's program."""
    words = [str(w) for w in command or []]
    if any(Path(w).name in ("torchrun", "torch.distributed.run", "torch.distributed.launch") for w in words):
        return "torchrun's agent"
    return f"the job's command ({Path(words[0]).name})" if words else "the job's command"


def _command_killed(c: Case) -> dict | None:
    """A node's command that started the ranks (torchrun's agent, a spawning parent) was killed by a signal from
    outside while its ranks ran: no rank died before it (the watchdog saw none vanish before node.json's
    ``command_end_mono_ns``, on the same host's clock), the command is not itself a rank, dtprof forwarded no
    signal to it and did not stop it for a hang, and the ranks it left running were stopped by dtprof after it.
    The ranks are not the cause: they lost their parent (and train on: ``dtprof run`` waits for them while they
    progress)."""
    if c.run is None:
        return None
    inc = c.incident
    rank_pids = {hb.get("pid") for hb in inc.heartbeats.values()}
    if c.ranks_tbl is not None and "pid" in c.ranks_tbl:
        rank_pids |= {int(p) for p in c.ranks_tbl["pid"].dropna()}
    for n in c.run.nodes:
        rc, pid, end = n.get("job_returncode"), n.get("command_pid"), n.get("command_end_mono_ns")
        if not (isinstance(rc, int) and rc < 0 and pid and end and pid not in rank_pids
                and not n.get("signals_forwarded") and n.get("status") != "hung"):
            continue
        dead = [d for x in inc.watchdog["crash"] if x.get("node") == n.get("node") for d in x.get("dead") or []]
        if any(d["detected_ns"] < end for d in dead):
            continue   # a rank died first: the command's death followed it
        left = [s for s in n.get("stops") or [] if str(s.get("reason", "")).startswith("left running")]
        orphans = sum(s.get("sigterm_sent_to") or 0 for s in left)
        sig = n.get("signal") or f"signal {-rc}"
        node_ranks = sorted(r for r, hb in inc.heartbeats.items() if hb.get("host") == n.get("host")) or \
            sorted(c.known)
        steps = sorted({hb.get("step") for r, hb in inc.heartbeats.items() if r in node_ranks
                        and hb.get("step") is not None})
        at = (f" at step {steps[0]}" if len(steps) == 1 else f" at steps {steps[0]}–{steps[-1]}") if steps else ""
        who = _launcher_name(n.get("command"))
        c.evidence.insert(0, {"kind": "exit", "message": f"node {n.get('node')}: {who} (pid {pid}) was killed by "
                              f"{sig}; no rank had died before it", "pid": pid, "signal": sig})
        msg = (f"crash: {who} (pid {pid}, host {n.get('host') or '?'}) was killed by {sig} while its ranks "
               f"{ranks_text(node_ranks)} trained{at}; no rank failed: they lost their parent"
               + (f"; dtprof stopped the {orphans} process(es) it left running once they made no progress"
                  if orphans else "; they trained on to their end" if all(
                      inc.heartbeats.get(r, {}).get("exit") == "clean" for r in node_ranks) else ""))
        return c.result("crash", [], None, msg)
    return None


def _oom_of_rank(c: Case, r: int, records: dict) -> dict | None:
    """Rank ``r``'s out-of-memory error: its ``oom`` meta row (collectors/memory.py; ``records``: each rank's last
    ``oom`` meta value), else the message of its exception dump or of its last exception line in the job's output
    (dtprof/oom.py), or None."""
    from dtprof import oom

    if isinstance(records.get(r), dict):
        return {**records[r], "source": "the rank's oom record"}
    own = (c.incident.dumps.get(r, {}).get("exception") or {}).get("exception") or {}
    text = own.get("message") or _exception_line(c.incident.logs, r) or ""
    parsed = oom.parse(text)
    if parsed is None:
        return None
    funcs = [f.get("func") for f in own.get("frames") or []]
    phase = ("backward" if "_engine_run_backward" in funcs or "backward" in funcs else
             "forward" if "forward" in funcs else None)
    return {**parsed, "step": c.step_of(r), "phase": phase, "module": None, "message": text.splitlines()[0][:500],
            "source": "its exception dump" if own.get("message") else "the job's output"}


def _oom(c: Case) -> dict | None:
    """3a. A rank failed an allocation (CUDA out of memory, the CPU allocator's "can't allocate memory"): the
    request, the step and phase, what it held (its memory ledger: analyzers/memory.py) and the levers that would have
    made room, each with its predicted saving against the shortfall. The other ranks were stopped by it."""
    from dtprof.analyzers import memory as memory_mod

    meta = c.run.meta if c.run is not None else None
    records: dict = {}
    if meta is not None and len(meta):   # each rank's last oom row, read once (not a pass over meta per rank)
        oom_rows = meta[(meta["kind"].astype(str) == "oom").to_numpy()]
        records = dict(zip(oom_rows["rank"].tolist(), oom_rows["value"].tolist()))
    found = {r: rec for r in sorted(c.known) if (rec := _oom_of_rank(c, r, records)) is not None}
    if not found:
        return None
    raised = {r: (c.incident.dumps.get(r, {}).get("exception") or {}).get("wall_ns") or 0 for r in found}
    culprits = sorted(found, key=lambda r: (raised[r], r))
    first = found[culprits[0]]
    led = memory_mod.ledger(c.run) if c.run is not None else None
    row = (led[led["rank"] == culprits[0]].to_dict("records") or [{}])[0] if led is not None and len(led) else {}
    held = {k: first[k] if first.get(k) is not None else row.get(k)
            for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes")}
    ledger = {**row, **held}
    if first.get("reserved_unallocated_bytes") is not None:    # a CUDA message's fragmentation at the failure
        ledger["fragmentation_bytes"] = first["reserved_unallocated_bytes"]
    request = int(first["requested_bytes"])
    free = first.get("device_free_bytes")
    shortfall = request - int(free) if free is not None else request
    lay = memory_mod.layout(c.run) if c.run is not None else {"world": len(c.known) or 1, "sharded": False}
    scales = first.get("phase") in ("forward", "backward")
    # what the rank needed at that moment: what it held (its ledger's tensors) and the request
    needed = sum(int(ledger.get(k) or 0) for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes",
                                                    "activations_bytes")) + request
    levers = memory_mod.levers(ledger, lay["world"], lay["sharded"], shortfall=shortfall,
                               request=request if scales else 0, peak=needed)
    stopped = sorted(set(c.known) - set(found))
    for r in culprits:
        f = found[r]
        c.evidence.append({"kind": "oom", "rank": r, "message": f"{c.label(r)} at step {f.get('step')}"
                           + (f" in {f['phase']}" if f.get("phase") else "")
                           + (f" ({f['module']})" if f.get("module") else "")
                           + f": {f.get('message')} (from {f.get('source')})", **{k: v for k, v in f.items()
                                                                                 if k != "message"}})
    for r in stopped:
        c.evidence.append({"kind": "stopped", "rank": r, "message": f"{c.label(r)} was stopped by rank "
                           f"{culprits[0]}'s out-of-memory error (its own end follows from it)"})
    covering = [x["lever"] for x in levers if x.get("covers_shortfall")]
    held_text = ", ".join(f"{k[:-6].replace('_', ' ')} {fmt_bytes(v)}" for k, v in held.items() if v is not None)
    msg = (f"oom: {c.label(culprits[0])} could not allocate {fmt_bytes(request)} at step {first.get('step')}"
           + (f" in {first['phase']}" if first.get("phase") else "")
           + (f" ({first['module']})" if first.get("module") else "")
           + (f" with {fmt_bytes(free)} free" if free is not None else "")
           + (f"; it held {held_text}" if held_text else "")
           + (f"; {', '.join(covering)} alone would cover the {fmt_bytes(shortfall)} shortfall" if covering else
              f"; no single lever covers the {fmt_bytes(shortfall)} shortfall" if levers else "")
           + (f"; rank(s) {ranks_text(stopped)} stopped by it" if stopped else ""))
    res = c.result("oom", culprits, None, msg)
    res.update(step=first.get("step"), requested_bytes=request, phase=first.get("phase"), module=first.get("module"),
               shortfall_bytes=shortfall, device_free_bytes=free, ledger=ledger, levers=levers,
               stopped_ranks=stopped)
    return res


def _crash(c: Case) -> dict | None:
    """3. A rank exited non-zero or was killed: torchrun's failure report and the watchdog's record of which
    rank's process vanished first. The command that started the ranks killed from outside comes first: then no
    rank is the cause (``_command_killed``)."""
    killed = _command_killed(c)
    if killed is not None:
        return killed
    inc, dumps = c.incident, c.incident.dumps
    exits = inc.watchdog["exit"]
    failures = [f for e in exits for f in e.get("torchrun_failures") or []]
    if not failures and inc.logs:
        from dtprof.watchdog import parse_torchrun_failures
        failures = parse_torchrun_failures(inc.logs)
    dead = sorted((d for x in inc.watchdog["crash"] for d in x.get("dead") or []), key=lambda d: d["detected_ns"])
    exit_code = next((e.get("exit_code") for e in exits), None)
    if exit_code is None and c.run is not None:   # no watchdog: a Ray Train worker's own end (collectors/raytrain.py)
        exit_code = next((n.get("exit_code") for n in c.run.nodes if "attempt_rank" in n and n.get("exit_code")),
                         None)
    if not (failures or dead or (exit_code not in (None, 0))):
        return None
    root = [f for f in failures if f["root_cause"]]
    # A rank torchrun calls the root cause, else the first whose process vanished, else any non-SIGTERM exit.
    # Ranks that raised, in the order their own excepthook recorded it (dump-exception.json; wall clock, as
    # the ranks may be on several hosts).
    raised = sorted((x.get("wall_ns") or 0, r) for r, ds in dumps.items()
                    if (x := ds.get("exception")) and x.get("exception"))
    first_raised = [raised[0][1]] if raised else []
    culprits = [f["rank"] for f in root] or first_raised or ([dead[0]["rank"]] if dead else []) or \
               [f["rank"] for f in failures if f["signal"] != "SIGTERM"]
    first_dead_ns = dead[0]["detected_ns"] if dead else None
    for f in failures:
        how = f"killed by {f['signal']}" if f["signal"] else f"exit code {f['exit_code']}"
        c.evidence.append({"kind": "exit", "rank": f["rank"], "message": f"torchrun: {c.label(f['rank'])} {how}"
                           + (" (root cause)" if f["root_cause"] else "") + f"; {f['traceback']}"[:300],
                           "exit_code": f["exit_code"], "signal": f["signal"]})
    parts = [_crash_part(c, r, failures, raised, first_raised) for r in culprits]
    others = sorted(set(c.known) - set(culprits))
    for r in others:
        d = dumps.get(r, {})
        snap = d.get("crash") or d.get("sigterm") or d.get("exception")
        if snap:
            coll = snap.get("collective")
            inside = f" inside {coll.get('op')} #{coll.get('seq')} of group {coll.get('group')}" if coll else ""
            c.evidence.append({"kind": "state", "rank": r, "message": f"{c.label(r)} at step {snap.get('step')}"
                               f"{inside}, at {where(snap) or '?'} (dump '{snap.get('request')}'"
                               + (f": {snap.get('reason')}" if snap.get("request") == "exception" else "") + ")"})
    msg = "crash: " + ("; ".join(parts) if parts else f"the job exited with code {exit_code}; no rank named")
    if first_dead_ns and others:
        msg += f"; {len(others)} other rank(s)' state captured" if any(
            ({"crash", "sigterm", "exception"} & set(dumps.get(r, {}))) for r in others) else ""
    return c.result("crash", culprits, None, msg)


def _crash_part(c: Case, r: int, failures: list, raised: list, first_raised: list) -> str:
    """What one crashed rank did: how it ended, at which step, with which exception."""
    dumps, logs = c.incident.dumps, c.incident.logs
    f = next((x for x in failures if x["rank"] == r), None)
    how = (f"was killed by {f['signal']}" if f and f["signal"] else
           f"exited with code {f['exit_code']}" if f else "exited")
    own = (dumps.get(r, {}).get("exception") or {})
    if own.get("exception"):
        e = own["exception"]
        exc = f"{e['type']}: {e['message'].splitlines()[0] if e['message'] else ''} at {where(own)}"
    else:
        exc = _exception_line(logs, r)
    first = " (failed first)" if len(raised) > 1 and first_raised == [r] else ""
    if f and f["signal"] and c.incident.heartbeats.get(r, {}).get("exit") == "clean":
        # killed after its atexit hooks ran (the heartbeat's last word): in the interpreter's teardown
        return (f"{c.label(r)} {how}{first} during its process's exit, after its last step "
                f"({c.last_step(r)}): its training had ended" + _teardown_abort_cause(logs))
    return f"{c.label(r)} {how}{first} at step {c.step_of(r)}" + (f": {exc}" if exc else "")


def _interrupted(c: Case) -> dict | None:
    """4. A node's launcher was killed before it recorded the job's end: its timings are not a straggler's."""
    cut = [n for n in (c.run.nodes if c.run is not None else []) if n.get("status") == "interrupted"]
    if not cut:
        return None
    return c.result("interrupted", [], None, f"{cut[0]['status_reason']} ({', '.join(n['node'] for n in cut)}); "
                    f"the job's end was not recorded, so no straggler verdict is drawn from its timings")


def _straggler(c: Case) -> dict | None:
    """5. A rank the analysis classifies as a persistent straggler, with its NVML evidence."""
    if c.run is None or not len(c.rank_steps()):
        return None
    if c.stragglers is None:   # the analysis failed: that must not hide the rest of the triage
        c.evidence.append({"kind": "error", "message": "straggler analysis failed: "
                           + (c.straggler_error or "no analysis given")})
        return None
    try:
        slow = find_stragglers(c.stragglers)
    except Exception as e:  # a malformed analysis must not hide the rest of the triage
        slow = []
        c.evidence.append({"kind": "error", "message": f"straggler analysis failed: {type(e).__name__}: {e}"})
    if not slow:
        return None
    parts = []
    for s in slow:
        r = s["rank"]
        score = "n/a" if s["compute_score"] is None else f"{s['compute_score']:.2f}"
        c.evidence.append({"kind": "straggler", "rank": r, "message":
                           f"{c.label(r)}: persistent straggler, {s['reason']}; compute score {score} (1.0 = "
                           f"as fast as the fastest rank); its peers' arrival wait {s['time_lost_s']:.2f} s",
                           **{k: v for k, v in s.items() if k not in ("rank", "nvml", "nvml_lines")}})
        ev = s["nvml"]
        if ev.get("gpu") is not None:
            c.evidence.append({"kind": "nvml", "rank": r, "message": "; ".join(s["nvml_lines"]), **ev})
        parts.append(c.label(r) + (f" ({', '.join(ev['throttle_reasons'])})" if ev.get("throttle_reasons")
                                   else ""))
    return c.result("straggler", [s["rank"] for s in slow], None,
                    f"straggler: {', '.join(parts)} is persistently slower than its peers "
                    f"({slow[0]['reason']}; peers' arrival wait {sum(s['time_lost_s'] for s in slow):.2f} s)")


def restart_lines(run: dict) -> list[str]:
    """One line per earlier attempt of a restarted rank, and which attempt the statistics cover (summary.json's
    ``run.restarts`` and ``run.attempts``)."""
    lines = []
    for r in run.get("restarts") or []:
        what = (f"failed at step {r['step']} ({r['exception']})" if r["status"] == "failed" else
                f"stopped in step {r['step']} (its collective failed when rank {r['stopped_by']} did: "
                f"{str(r['exception'])[:120]})" if r.get("stopped_by") is not None else
                f"stopped in step {r['step']} (its group was stopped to restart it)")
        after = f", {r['restart_s']:.1f} s after the failure" if r.get("restart_s") is not None else ""
        lines.append(f"rank {r['rank']} attempt {r['attempt']} {what}; restarted at {r['restarted'] or '?'}{after}")
    if lines:
        cover = ", ".join(f"rank {k}: attempt {v}" for k, v in (run.get("attempts") or {}).items())
        lines.append(f"statistics cover each rank's last attempt ({cover})")
    return lines


_HEALTH_ORDER = {"divergence": 0, "nonfinite": 1, "loss_spike": 2, "grad_norm_explosion": 3}


def _numerics(c: Case) -> dict | None:
    """Numerics health (analyzers/health.py): the earliest incident decides: replicas whose parameter fingerprints
    differ ("divergence"), the first non-finite local loss or gradient norm, a loss spike or a gradient-norm
    explosion ("numerics"); ``step`` is its step, the culprits the ranks it names."""
    if c.run is None:
        return None
    block = c.health
    if block is None and c.health_error is None:   # no analysis before triage: read the health table here
        from dtprof.analyzers import health

        try:
            block = health.of_run(c.run)
        except Exception as e:  # a damaged health table must not hide the rest of the triage
            c.health_error = f"health analysis failed: {type(e).__name__}: {e}"
    if block is None:
        c.evidence.append({"kind": "error", "message": c.health_error})
        return None
    incidents = sorted(block["incidents"], key=lambda i: (i["step"], _HEALTH_ORDER[i["kind"]]))
    if not incidents:
        return None
    for i in incidents[:20]:
        c.evidence.append({"kind": "health", **i})
    first = incidents[0]
    verdict = "divergence" if first["kind"] == "divergence" else "numerics"
    res = c.result(verdict, first["ranks"], None, f"{verdict}: {first['message']}")
    res["step"] = first["step"]
    return res


# The verdicts in the order they are checked: the first that applies is the root cause (module docstring).
RULES = (_mismatch, _hang, _oom, _crash, _interrupted, _numerics, _straggler)


def triage(run, analysis: Mapping[str, Any]) -> dict:
    """The verdict for one run: analyze's "triage" stage. Returns the ``--json`` dict: verdict, culprit_ranks,
    collective, message, evidence (list of {kind, message, ...}).

    ``run``: the open run (dtprof.rundir.run.Run), or None when only Flight Recorder files are given. ``analysis``: what
    the analysis found before this stage (analyzers/summary.py ``analyze``): ``incident``, the run's incident files
    and Flight Recorder entries as its inputs stage read them (rundir/incident.py ``read_incident``); ``mismatch_rows``,
    the collectives rows the mismatch check reads (those of ``mismatch_candidates``; absent: all of the run's);
    ``model``, whose rank-steps the crash rule reads (absent: the run's steps table); ``summary`` ``stragglers``
    and ``health`` (or ``health_reason``); the command's ``live`` (the job is still running) and ``stale_s`` (how
    long without progress counts as a hang). Where there is no analysis (a run without steps, Flight Recorder files
    only, or an analysis that failed: ``analysis_error`` says why), only ``incident`` and the command's options.
    """
    c = Case.of(run, analysis)
    incident = c.incident
    c.known = set(incident.heartbeats) | set(incident.dumps)
    ranks_tbl = c.ranks_tbl
    if ranks_tbl is not None and len(ranks_tbl):
        c.known |= set(int(r) for r in ranks_tbl["rank"])
    if incident.fr is not None and len(incident.fr):
        c.known |= set(int(r) for r in incident.fr["rank"].dropna())
    c.timeouts = log_timeouts(incident.logs)
    for line in c.timeouts:
        c.evidence.append({"kind": "log", "message": f"job output: {line[:300]}"})
    if run is not None and run.problems:
        c.evidence += [{"kind": "read", "message": p} for p in run.problems]
    for node in run.nodes if run is not None else []:
        for stop in node.get("stops") or []:
            c.evidence.append({"kind": "stop", "message": f"dtprof run on {node.get('host') or '?'} "
                               f"{stop_text(stop)}", **stop})
    restarts = run.restarts if run is not None else []
    c.evidence += [{"kind": "restart", "message": line}
                   for line in restart_lines({"restarts": restarts, "attempts": run.attempts if run else {}})]
    for rule in RULES:
        res = rule(c)
        if res is not None:
            return res
    again = "".join(f"; {c.label(r['rank'])} failed at step {r['step']} ({r['exception']}) and was restarted"
                    for r in restarts if r["status"] == "failed")
    if restarts and not again:
        again = f"; rank(s) {ranks_text({r['rank'] for r in restarts})} restarted"
    return c.result("healthy", [], None, f"healthy: no hang, crash, mismatch or persistent straggler found "
                                         f"({len(c.known)} rank(s) examined){again}")
