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
3. **crash** — a rank exited non-zero or was killed: torchrun's failure report ("Root Cause" block:
   ``exitcode : -9`` = SIGKILL) and the watchdog's record of which rank's process vanished first.
4. **interrupted** — a node's ``dtprof run`` launcher was killed before it recorded the job's end (node.json
   still "running", its process gone: ``dtprof.reader.launcher_killed``); its timings are not a straggler's.
5. **straggler** — a rank the analysis classifies as a persistent straggler (``stragglers.PERSISTENT_RULE``:
   slow in at least 75 % of the measured steps, by compute or by holding its peers up at a collective), with the
   NVML evidence the analysis built for it (throttle reasons, SM clock, temperature, power, ECC errors).
6. **healthy** otherwise.

Every stop of the job's processes by the launcher (node.json "stops": the hang watchdog's, or leftovers after the
command ended) is named in the evidence, with its signals, grace period and whether any process survived it.
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

from dtprof.analyzers.collectives import own_records
from dtprof.runformat import NODE_PREFIX, RANK_PREFIX

VERDICTS = ("hang", "crash", "mismatch", "interrupted", "straggler", "healthy")
P2P = ("send", "recv")
# Collective timeouts and transport failures in a job's output (NCCL watchdog, gloo, c10d store).
TIMEOUT_PATTERNS = [
    re.compile(r"Watchdog caught collective operation timeout[^\n]*"),
    re.compile(r"WorkNCCL\(SeqNum=\d+, OpType=\w+[^\n]*timeout[^\n]*", re.I),
    re.compile(r"[^\n]*gloo[^\n]*(?:Timed out|timeout|Connection closed by peer|Connection reset)[^\n]*", re.I),
    re.compile(r"[^\n]*NCCL (?:error|WARN)[^\n]*", re.I),
    re.compile(r"[^\n]*DistStoreError[^\n]*"),
]
_NCCL_SEQ = re.compile(r"SeqNum=(\d+), OpType=(\w+)")
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/dtprof/", "/collectors/", "<frozen")


# ---------------------------------------------------------------------------------------------------- inputs
def _load_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def read_rank_files(run_dir: Path, node_dirs=None) -> tuple[dict, dict]:
    """(heartbeats by rank, dumps by rank: {dump_id: dump}) from every node directory of the run (``node_dirs``:
    those the reader keeps, without the earlier attempts of restarted ranks)."""
    hbs, dumps = {}, {}
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")) if node_dirs is None else node_dirs:
        for rd in sorted(nd.glob(f"{RANK_PREFIX}*")):
            try:
                rank = int(rd.name[len(RANK_PREFIX):])
            except ValueError:
                continue
            hb = _load_json(rd / "heartbeat.json")
            if hb:
                hbs[rank] = hb
            for dp in rd.glob("dump-*.json"):
                d = _load_json(dp)
                if d:
                    dumps.setdefault(rank, {})[dp.name[len("dump-"):-len(".json")]] = d
    return hbs, dumps


def read_watchdog(run_dir: Path) -> dict:
    """The watchdog's findings of every node: {"hang": [...], "crash": [...], "exit": [...]}."""
    out = {"hang": [], "crash": [], "exit": []}
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")):
        for kind in out:
            d = _load_json(nd / "triage" / f"{kind}.json")
            if d:
                out[kind].append({**d, "node": nd.name})
    return out


def read_logs(run_dir: Path) -> str:
    parts = []
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")):
        for name in ("stderr.log", "stdout.log"):
            p = nd / name
            if p.exists():
                parts.append(p.read_text(errors="replace"))
    return "\n".join(parts)


def best_dump(dumps: dict, prefer=("hang", "crash", "sigterm")) -> dict | None:
    """The dump of one rank that tells most about the incident: the watchdog's, else the newest."""
    for k in prefer:
        if k in dumps:
            return dumps[k]
    return max(dumps.values(), key=lambda d: d.get("t_ns") or 0) if dumps else None


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


def fr_entries_from_dumps(dumps: dict):
    """Flight Recorder entries carried in rank dumps -> one DataFrame (collectors/flight_recorder.py columns)."""
    import pandas as pd

    from dtprof.collectors.flight_recorder import COLUMNS, entries_frame

    frames = []
    for rank, by_id in dumps.items():
        d = best_dump(by_id)
        if d and isinstance(d.get("flight_recorder"), dict):
            frames.append(entries_frame(d["flight_recorder"], rank, f"rank-{rank} dump"))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


# ---------------------------------------------------------------------------------------------- detectors
def mismatch_candidates(parts) -> list[tuple[str, int]]:
    """The collective instances (group, seq) whose ranks may disagree in op, size or dtype, from the arrivals
    reduced per part (analyzers/stragglers.py ``arrival_parts``: the node summaries', nodesummary.Rows, reduced in
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
        c = collectives[~collectives["op"].astype(str).isin(P2P)]
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
        from dtprof.collectors.flight_recorder import match_across_ranks
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


# NCCL's OpType names -> dtprof's canonical op names (dtprof.schema.COLLECTIVE_OPS)
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


def _exception_line(text: str, rank: int) -> str | None:
    """The last '[rankN]: SomeError: message' line torchrun's workers printed, if any."""
    lines = re.findall(rf"^\[rank{rank}\]:\s*(\w[\w.]*(?:Error|Exception|Interrupt)\b[^\n]*)$", text, re.M)
    return lines[-1].strip() if lines else None


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
def triage(run_dir, fr_paths=(), live: bool = False, stale_s: float = 60.0, now_ns: int | None = None,
           run=None, stragglers=None, collectives=None, steps=None) -> dict:
    """The verdict for one run directory. Returns the ``--json`` dict: verdict, culprit_ranks, collective,
    message, evidence (list of {kind, message, ...}). ``fr_paths``: extra Flight Recorder dumps (files or
    directories). ``live``: the job is still running; ``stale_s`` is how long without progress counts as a hang.
    ``run`` and ``stragglers``: the run already open and its analysis' flagged ranks (summary ``stragglers``), as
    ``dtprof.analyzers.summary.analyze`` passes them; without them the run is opened and analysed here.
    ``collectives``: the rows the mismatch check reads (the analysis passes those of its ``mismatch_candidates``);
    default all of the run's. ``steps``: the run's rank-steps (rank, step; the analysis passes its run model's, so
    the steps table is not read again); default the run's steps table.
    """
    import pandas as pd

    from dtprof.collectors.flight_recorder import load_dumps
    from dtprof.launcher import stop_text
    from dtprof.reader import open_run

    run_dir = Path(run_dir)
    if run is None:
        run = open_run(run_dir, check_tables=True) if (run_dir / "run.json").exists() else None
    def rank_steps():   # read on first use: most verdicts need no steps
        return steps if steps is not None else run.steps

    ranks_tbl = run.ranks if run is not None else None
    groups_tbl = run.groups if run is not None else None
    hbs, dumps = read_rank_files(run_dir, run.node_dirs) if run is not None else ({}, {})
    wd = read_watchdog(run_dir) if run is not None else {"hang": [], "crash": [], "exit": []}
    logs = read_logs(run_dir) if run is not None else ""
    fr = fr_entries_from_dumps(dumps)
    if fr_paths:
        ext = load_dumps(fr_paths)
        fr = pd.concat([x for x in (fr, ext) if len(x)], ignore_index=True) if len(ext) else fr
    known = set(hbs) | set(dumps)
    if ranks_tbl is not None and len(ranks_tbl):
        known |= set(int(r) for r in ranks_tbl["rank"])
    if fr is not None and len(fr):
        known |= set(int(r) for r in fr["rank"].dropna())
    evidence: list[dict] = []
    label = lambda r: rank_label(r, ranks_tbl)  # noqa: E731

    timeouts = log_timeouts(logs)
    for line in timeouts:
        evidence.append({"kind": "log", "message": f"job output: {line[:300]}"})
    if run is not None and run.problems:
        evidence += [{"kind": "read", "message": p} for p in run.problems]
    for node in run.nodes if run is not None else []:
        for stop in node.get("stops") or []:
            evidence.append({"kind": "stop", "message": f"dtprof run on {node.get('host') or '?'} {stop_text(stop)}",
                             **stop})

    from dtprof.analyzers.summary import restart_lines

    restarted = restart_lines({"restarts": run.restarts, "attempts": run.attempts}) if run is not None else []
    evidence += [{"kind": "restart", "message": line} for line in restarted]

    def result(verdict, culprits, collective, message):
        return {"verdict": verdict, "culprit_ranks": sorted(int(r) for r in culprits), "collective": collective,
                "message": message, "evidence": evidence}

    def last_step(r):
        """The last step a rank recorded ('?' for none)."""
        rs = rank_steps() if run is not None else None
        done = rs.loc[rs["rank"] == r, "step"] if rs is not None and len(rs) else []
        return int(done.max()) if len(done) else "?"

    def step_of(r):
        """The step a rank was in: its newest heartbeat or dump, or the one after its last recorded step (the
        heartbeat is written every 0.5 s, so a fast job can be past it)."""
        last = last_step(r)
        cands = [hbs.get(r, {}).get("step")] + [d.get("step") for d in dumps.get(r, {}).values()]
        cands = [int(c) for c in cands if c is not None] + ([last + 1] if last != "?" else [])
        return max(cands) if cands else "?"

    def stacks_evidence(ranks, why):
        for r in ranks:
            d = best_dump(dumps.get(r, {}))
            loc = where(d)
            if loc:
                evidence.append({"kind": "stack", "rank": r, "message": f"{label(r)} {why} at {loc}",
                                 "dump": d.get("request")})

    # 1. mismatch
    rows = collectives if collectives is not None else run.collectives if run is not None else None
    mism = find_mismatches(own_records(rows) if rows is not None else None, fr)
    if mism:
        m = mism[0]
        odd = m["odd_ranks"]
        details = "; ".join(f"rank {r}: {v['op']} {v['in_bytes']} B {v['dtype']}"
                            for r, v in sorted(m["per_rank"].items()) if r in odd or r == min(m["per_rank"]))
        msg = (f"mismatch: {m['op']} #{m['seq']} of group {m['group']} differs in {', '.join(m['fields'])} on "
               f"{', '.join(label(r) for r in odd)} ({details})")
        for other in mism[1:5]:
            evidence.append({"kind": "mismatch", "message": f"also {other['op']} #{other['seq']} of group "
                             f"{other['group']} differs in {', '.join(other['fields'])} on ranks "
                             f"{ranks_text(other['odd_ranks'])}"})
        evidence.insert(0, {"kind": "mismatch", "message": f"from the {m['source']}: " + ", ".join(
            f"rank {r} {v['op']} {v['in_bytes']} B {v['dtype']}" for r, v in sorted(m["per_rank"].items())),
            "per_rank": {str(k): v for k, v in m["per_rank"].items()}})
        return result("mismatch", odd, {"op": m["op"], "group": m["group"], "seq": m["seq"]}, msg)

    # 2. hang
    hang_rec = wd["hang"][0] if wd["hang"] else None
    now = (hang_rec or {}).get("detected_ns") or now_ns or time.monotonic_ns()
    stale = None
    if live and hbs:
        newest = max(hb.get("last_progress_ns") or 0 for hb in hbs.values())
        stale = (now - newest) / 1e9
        evidence.append({"kind": "heartbeat", "message": f"newest progress on any rank {stale:.1f} s ago"})
    nccl_timeout = next((m for m in (_NCCL_SEQ.search(t) for t in timeouts) if m), None)
    # Dumps given with --fr are snapshots taken at one moment (usually a timeout): a rank behind the others in a
    # group is a hang signature. Dumps inside a run only count once something else says the job hung.
    fr_behind = False
    if fr_paths and len(fr):
        from dtprof.collectors.flight_recorder import match_across_ranks
        fr_behind = bool((match_across_ranks(fr)["ranks_missing"].str.len() > 0).any())
        if fr_behind:
            evidence.append({"kind": "flight_recorder", "message": "Flight Recorder dumps: some ranks never "
                             "reached a collective the others entered"})
    if hang_rec or (stale is not None and stale >= stale_s) or nccl_timeout or fr_behind:
        h = find_hang(hbs, dumps, known, groups_tbl, fr, now)
        if h["collective"] is None and nccl_timeout:
            op = nccl_timeout.group(2).lower()
            h["collective"] = {"op": _NCCL_OPS.get(op, op), "group": None, "seq": int(nccl_timeout.group(1))}
        if hang_rec:
            evidence.insert(0, {"kind": "watchdog", "message": f"watchdog: no rank progressed for "
                                f"{hang_rec['idle_s']:.0f} s (--hang-timeout {hang_rec['timeout_s']:g}); job stopped",
                                "missing_dumps": hang_rec.get("missing_dumps", [])})
            if hang_rec.get("missing_dumps"):
                evidence.append({"kind": "watchdog", "message": "no state dump from ranks "
                                 + ranks_text(hang_rec["missing_dumps"])})
        c = h["collective"]
        cname = (f"{c['op']} #{c['seq']}" + (f" of group {c['group']}" if c.get("group") is not None else "")
                 if c else "a collective")
        culprits = h["culprits"]
        stacks_evidence(culprits, "was")
        stacks_evidence(h["waiting"][:1], "waits (like the others)")
        if culprits:
            r0 = culprits[0]
            loc = where(best_dump(dumps.get(r0, {})))
            inflight = _in_flight(hbs, dumps).get(r0)
            whats = (f"is inside {inflight.get('op')} #{inflight.get('seq')} of group {inflight.get('group')}"
                     if inflight else "never entered")
            who = ", ".join(label(r) for r in culprits[:4]) + (f" and {len(culprits) - 4} more" if len(culprits) > 4
                                                                 else "")
            waited = f" waited {h['waited_s']:.0f} s there" if h["waited_s"] is not None else " wait there"
            msg = (f"hang: {who} {whats} {cname}" + ("" if inflight else "") +
                   (f"; ranks {ranks_text(h['waiting'])}{waited}" if h["waiting"] else "") +
                   (f"; rank {r0} was at {loc}" if loc else ""))
            if inflight:
                msg = msg.replace(f"{whats} {cname}", f"{whats} while the others wait in {cname}")
        else:
            if h["waiting"]:
                msg = (f"hang: ranks {ranks_text(h['waiting'])} wait in {cname}; no rank is missing from it "
                       f"(a rank on a node without dtprof, or a hang inside the collective itself)")
            else:
                msg = (f"hang: the job's output reports a timeout in {cname}; no heartbeats say which rank never "
                       f"entered it (record with `dtprof run --hang-timeout` to name the culprit)")
        if h["source"]:
            evidence.append({"kind": "method", "message": f"culprits from {h['source']}"})
        return result("hang", culprits, c, msg)

    # 3. crash
    exits = wd["exit"]
    failures = [f for e in exits for f in e.get("torchrun_failures") or []]
    if not failures and logs:
        from dtprof.watchdog import parse_torchrun_failures
        failures = parse_torchrun_failures(logs)
    dead = sorted((d for c in wd["crash"] for d in c.get("dead") or []), key=lambda d: d["detected_ns"])
    exit_code = next((e.get("exit_code") for e in exits), None)
    if exit_code is None and run is not None:   # no watchdog: a Ray Train worker's own end (collectors/raytrain.py)
        exit_code = next((n.get("exit_code") for n in run.nodes if "attempt_rank" in n and n.get("exit_code")), None)
    if failures or dead or (exit_code not in (None, 0)):
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
            evidence.append({"kind": "exit", "rank": f["rank"], "message": f"torchrun: {label(f['rank'])} {how}"
                             + (" (root cause)" if f["root_cause"] else "") + f"; {f['traceback']}"[:300],
                             "exit_code": f["exit_code"], "signal": f["signal"]})
        parts = []
        for r in culprits:
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
            if f and f["signal"] and hbs.get(r, {}).get("exit") == "clean":
                # killed after its atexit hooks ran (the heartbeat's last word): in the interpreter's teardown
                parts.append(f"{label(r)} {how}{first} during its process's exit, after its last step "
                             f"({last_step(r)}): its training had ended" + _teardown_abort_cause(logs))
                continue
            parts.append(f"{label(r)} {how}{first} at step {step_of(r)}" + (f": {exc}" if exc else ""))
        others = sorted(set(known) - set(culprits))
        for r in others:
            d = dumps.get(r, {})
            snap = d.get("crash") or d.get("sigterm") or d.get("exception")
            if snap:
                c = snap.get("collective")
                inside = f" inside {c.get('op')} #{c.get('seq')} of group {c.get('group')}" if c else ""
                evidence.append({"kind": "state", "rank": r, "message": f"{label(r)} at step {snap.get('step')}"
                                 f"{inside}, at {where(snap) or '?'} (dump '{snap.get('request')}'"
                                 + (f": {snap.get('reason')}" if snap.get("request") == "exception" else "") + ")"})
        msg = "crash: " + ("; ".join(parts) if parts else f"the job exited with code {exit_code}; no rank named")
        if first_dead_ns and others:
            msg += f"; {len(others)} other rank(s)' state captured" if any(
                ({"crash", "sigterm", "exception"} & set(dumps.get(r, {}))) for r in others) else ""
        return result("crash", culprits, None, msg)

    # 4. interrupted
    cut = [n for n in (run.nodes if run is not None else []) if n.get("status") == "interrupted"]
    if cut:
        return result("interrupted", [], None, f"{cut[0]['status_reason']} ({', '.join(n['node'] for n in cut)}); "
                      f"the job's end was not recorded, so no straggler verdict is drawn from its timings")

    # 5. straggler
    if run is not None and len(rank_steps()):
        try:
            if stragglers is None:
                from dtprof.analyzers.summary import analyze

                stragglers = analyze(run).summary["stragglers"]
            slow = find_stragglers(stragglers)
        except Exception as e:  # the analysis failing must not hide the rest of the triage
            slow = []
            evidence.append({"kind": "error", "message": f"straggler analysis failed: {type(e).__name__}: {e}"})
        if slow:
            parts = []
            for s in slow:
                r = s["rank"]
                score = "n/a" if s["compute_score"] is None else f"{s['compute_score']:.2f}"
                evidence.append({"kind": "straggler", "rank": r, "message":
                                 f"{label(r)}: persistent straggler, {s['reason']}; compute score {score} (1.0 = "
                                 f"as fast as the fastest rank); its peers' arrival wait {s['time_lost_s']:.2f} s",
                                 **{k: v for k, v in s.items() if k not in ("rank", "nvml", "nvml_lines")}})
                ev = s["nvml"]
                if ev.get("gpu") is not None:
                    evidence.append({"kind": "nvml", "rank": r, "message": "; ".join(s["nvml_lines"]), **ev})
                parts.append(label(r) + (f" ({', '.join(ev['throttle_reasons'])})" if ev.get("throttle_reasons")
                                         else ""))
            return result("straggler", [s["rank"] for s in slow], None,
                          f"straggler: {', '.join(parts)} is persistently slower than its peers "
                          f"({slow[0]['reason']}; peers' arrival wait {sum(s['time_lost_s'] for s in slow):.2f} s)")
    n = len(known)
    failed = [r for r in run.restarts if r["status"] == "failed"] if run is not None else []
    again = "".join(f"; {label(r['rank'])} failed at step {r['step']} ({r['exception']}) and was restarted"
                    for r in failed)
    if restarted and not failed:
        again = f"; rank(s) {ranks_text({r['rank'] for r in run.restarts})} restarted"
    return result("healthy", [], None, f"healthy: no hang, crash, mismatch or persistent straggler found "
                                       f"({n} rank(s) examined){again}")


def format_text(res: dict) -> str:
    lines = [res["message"]]
    lines += [f"  - {e['message']}" for e in res["evidence"]]
    return "\n".join(lines)
