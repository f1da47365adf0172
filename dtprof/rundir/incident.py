"""The incident files of a run: what triage reads beside the tables (heartbeats, rank dumps, the watchdog's
records, the job's output, Flight Recorder entries)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtprof.rundir.schema import (
    NODE_PREFIX,
    RANK_PREFIX,
)


@dataclass
class Incident:
    """The files of a run that say what happened to its ranks (docs/triage.md): each rank's ``heartbeat.json`` and
    ``dump-<id>.json`` (collectors/heartbeat.py), the watchdog's ``node_dir/triage/{hang,crash,exit}.json``
    (dtprof/watchdog.py), the job's output logs, and Flight Recorder entries (from the rank dumps, and from dump
    files given on the command line)."""

    heartbeats: dict = field(default_factory=dict)   # rank -> heartbeat.json
    dumps: dict = field(default_factory=dict)        # rank -> {dump id: dump}
    watchdog: dict = field(default_factory=lambda: {"hang": [], "crash": [], "exit": []})
    logs: str = ""                                   # the job's stderr and stdout, every node
    fr: Any = None                                   # Flight Recorder entries (dtprof/flight_recorder.COLUMNS)
    fr_given: bool = False                           # dump files were given: a snapshot taken at one moment


def _load_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def read_heartbeats(node_dir: Path) -> dict[int, dict]:
    """Every rank's latest heartbeat in one node directory, by rank."""
    out = {}
    for p in Path(node_dir).glob(f"{RANK_PREFIX}*/heartbeat.json"):
        hb = _read_heartbeat(p)
        if hb is None:
            continue
        try:
            out[int(hb.get("rank", p.parent.name[len(RANK_PREFIX):]))] = hb
        except (TypeError, ValueError):
            continue
    return out


def _read_heartbeat(path: Path, tries: int = 5) -> dict | None:
    """One heartbeat file, or None (vanished, foreign). The rank rewrites it in place (collectors/heartbeat.py,
    ``_BeatFile``): a read that overlaps a write can see parts of two beats, which shows as invalid JSON or as a
    ``beat`` that differs from ``beat_end``; such a read is taken again."""
    for _ in range(tries):
        try:
            hb = json.loads(path.read_text())
        except OSError:
            return None
        except ValueError:
            time.sleep(0.001)
            continue
        if isinstance(hb, dict) and hb.get("beat") == hb.get("beat_end"):
            return hb
        time.sleep(0.001)
    return None


def read_rank_files(run_dir: Path, node_dirs=None) -> tuple[dict, dict]:
    """(heartbeats by rank, dumps by rank: {dump_id: dump}) from every node directory of the run (``node_dirs``:
    those the reader keeps, without the earlier attempts of restarted ranks, ``Run.node_dirs``)."""
    hbs: dict = {}
    dumps: dict = {}
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")) if node_dirs is None else node_dirs:
        for rd in sorted(nd.glob(f"{RANK_PREFIX}*")):
            try:
                rank = int(rd.name[len(RANK_PREFIX):])
            except ValueError:
                continue
            hb = _read_heartbeat(rd / "heartbeat.json")
            if hb:
                hbs[rank] = hb
            for dp in rd.glob("dump-*.json"):
                d = _load_json(dp)
                if d:
                    dumps.setdefault(rank, {})[dp.name[len("dump-"):-len(".json")]] = d
    return hbs, dumps


def read_watchdog(run_dir: Path) -> dict:
    """The watchdog's findings of every node: {"hang": [...], "crash": [...], "exit": [...]}."""
    out: dict = {"hang": [], "crash": [], "exit": []}
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


def fr_entries_from_dumps(dumps: dict):
    """Flight Recorder entries carried in rank dumps -> one DataFrame (dtprof/flight_recorder.py columns)."""
    import pandas as pd

    from dtprof.flight_recorder import COLUMNS, entries_frame

    frames = []
    for rank, by_id in dumps.items():
        d = best_dump(by_id)
        if d and isinstance(d.get("flight_recorder"), dict):
            frames.append(entries_frame(d["flight_recorder"], rank, f"rank-{rank} dump"))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def read_incident(run_dir: Path | None, fr_paths=(), node_dirs=None) -> Incident:
    """The incident files of the run at ``run_dir`` (None: no run, only Flight Recorder files), with the entries of
    the Flight Recorder dump files or directories ``fr_paths``; the ranks' files from ``node_dirs`` only, when
    given (``Run.node_dirs``). Raises flight_recorder.DumpError for an unreadable dump file."""
    import pandas as pd

    inc = Incident()
    if run_dir is not None:
        inc.heartbeats, inc.dumps = read_rank_files(run_dir, node_dirs)
        inc.watchdog = read_watchdog(run_dir)
        inc.logs = read_logs(run_dir)
    inc.fr = fr_entries_from_dumps(inc.dumps)
    if fr_paths:
        from dtprof.flight_recorder import load_dumps

        ext = load_dumps(fr_paths)
        inc.fr = pd.concat([x for x in (inc.fr, ext) if len(x)], ignore_index=True) if len(ext) else inc.fr
        inc.fr_given = True
    return inc
