"""The launcher's hang watchdog (``dtprof run --hang-timeout S``) and crash recorder. No torch import.

Runs as a thread in the ``dtprof run`` launcher process and reads what the ranks' heartbeat threads write
(``collectors/heartbeat.py``): ``node_dir/rank-<r>/heartbeat.json`` every ~0.5 s.

- **Hang**: when no rank has made progress (``last_progress_ns``, the newest over all ranks) for ``timeout_s``.
  The clock starts once training has: a rank past its first step, inside a collective, or whose progress moved
  since its first heartbeat; start-up before that (imports: Lightning's takes over 20 s on a loaded 2-core
  machine; rendezvous; data loading) is left to torchrun's and the process group's own timeouts. Once every rank
  has exited cleanly, a slow teardown is not a hang. Then it writes ``node_dir/dump-request-hang``, waits
  up to ``DUMP_WAIT_S`` for every live rank's ``dump-hang.json``, records ``node_dir/triage/hang.json``, calls
  ``stop_job()`` (the launcher's SIGTERM, then SIGKILL after a grace period) and sets ``fired``; ``dtprof run``
  then exits with 124.
- **Crash**: when a rank's process disappears while the job runs (exception, signal, OOM killer), it writes
  ``node_dir/dump-request-crash`` at once so the survivors dump their state before torchrun stops them (their
  SIGTERM dumps are the second chance), and records ``triage/crash.json``. ``on_job_exit(code)`` adds torchrun's
  own account of the failure, parsed from ``node_dir/stderr.log``, to ``triage/exit.json``.

- **A stalled heartbeat**: a live, runnable rank whose heartbeat is ``STALE_BEAT_S`` old while another rank's is
  under half that has a heartbeat thread that stopped (a fault of dtprof's own: the thread beats every 0.5 s
  whatever the training does); it is recorded once per rank in ``beat_faults`` (``dtprof run`` prints them) and
  as an events row.

Every finding is also an ``events`` row (source "watchdog") through NodeTableWriter. Files: docs/run-format.md.
"""
from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from dtprof.rundir.incident import read_heartbeats  # the one heartbeat reader
from dtprof.rundir.writer import RANK_PREFIX, NodeTableWriter, write_json_atomic

POLL_S = 0.25
# A rank that died of one of these lost a peer: it is collateral damage of an earlier death, not a root cause.
PEER_LOSS_RE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|remote process exited|"
                          r"communicator was aborted", re.I)
DUMP_WAIT_S = 8.0
HANG_EXIT_CODE = 124
# A heartbeat this old while another rank's is fresh (under half of it) is one that stopped: a rank's heartbeat
# thread beats every 0.5 s whatever its main thread does (analyzers/triage.py reads the same threshold)
STALE_BEAT_S = 5.0
# process states (/proc/<pid>/stat) in which no thread of the process runs: its heartbeat stopped with it
FROZEN_STATES = ("T", "t", "D")


def pid_alive(pid) -> bool:
    """True if the process exists and is not a zombie (a dead child not yet reaped by torchrun)."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def process_state(pid) -> str | None:
    """The one-letter state of a process (/proc/<pid>/stat: R running, S sleeping, T stopped, D in the kernel...),
    or None where it cannot be read (gone, another host's, not Linux)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, TypeError, IndexError):
        return None


def request_dumps(node_dir: Path, dump_id: str, reason: str) -> None:
    """Ask every rank of this node for a state dump (answered as rank-<r>/dump-<dump_id>.json)."""
    path = Path(node_dir) / f"dump-request-{dump_id}"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(reason + "\n")
    os.replace(tmp, path)


def wait_for_dumps(node_dir: Path, dump_id: str, ranks, timeout_s: float) -> dict[int, Path]:
    """Wait until each of ``ranks`` has answered dump ``dump_id`` (or the time is up); return what arrived."""
    deadline = time.monotonic() + timeout_s
    node_dir = Path(node_dir)
    while True:
        got = {r: node_dir / f"{RANK_PREFIX}{r}" / f"dump-{dump_id}.json" for r in ranks}
        got = {r: p for r, p in got.items() if p.exists()}
        if len(got) == len(ranks) or time.monotonic() >= deadline:
            return got
        time.sleep(0.1)


# torchrun's failure report (torch.distributed.elastic ChildFailedError), one block per failed local worker:
#   rank      : 1 (local_rank: 1)
#   exitcode  : -9 (pid: 1234)
#   traceback : Signal 9 (SIGKILL) received by PID 1234
_FAIL_BLOCK = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)"
    r"\s*\(pid:\s*(?P<pid>\d+)\)[^\n]*\n(?:\s*error_file\s*:[^\n]*\n)?\s*traceback\s*:\s*(?P<tb>[^\n]*)")


def parse_torchrun_failures(text: str) -> list[dict]:
    """torchrun's per-rank failure report: rank, exit code (negative = signal), pid, and whether it is the root
    cause (the block under "Root Cause (first observed failure)")."""
    root_at = text.rfind("Root Cause")
    out: dict[int, dict] = {}
    for m in _FAIL_BLOCK.finditer(text):
        code = int(m["code"])
        sig = _signal_name(-code) if code < 0 else None
        rank = int(m["rank"])
        rec = {"rank": rank, "local_rank": int(m["local"]), "exit_code": code, "pid": int(m["pid"]),
               "signal": sig, "root_cause": root_at >= 0 and m.start() > root_at, "traceback": m["tb"].strip()}
        prev = out.get(rank)
        out[rank] = {**rec, "root_cause": rec["root_cause"] or bool(prev and prev["root_cause"])}
    return sorted(out.values(), key=lambda r: (not r["root_cause"], r["rank"]))


def _signal_name(num: int) -> str:
    import signal
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class Watchdog:
    """See the module docstring. ``stop_job`` is the launcher's way of stopping the whole job."""

    def __init__(self, node_dir: Path, timeout_s: float, stop_job: Callable[[], None]):
        self.node_dir = Path(node_dir)
        self.timeout_s = float(timeout_s)
        self.stop_job = stop_job
        self.fired = False
        self.crashed: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: NodeTableWriter | None = NodeTableWriter(self.node_dir, "events")
        self._host = socket.gethostname()
        self._started_ns = time.monotonic_ns()
        self._seen: dict[int, dict] = {}
        self.beat_faults: list[str] = []   # one line per rank whose heartbeat thread stopped while it ran
        self._stalled: set[int] = set()
        self._first_progress: dict[int, int | None] = {}   # each rank's last_progress_ns in its first heartbeat seen
        self._training_ns: int | None = None                # when the watchdog first saw the job training

    # -- public ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._started_ns = time.monotonic_ns()
        self._thread = threading.Thread(target=self._loop, name="dtprof-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set() and self._events is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=DUMP_WAIT_S + 5)
        if self._events is not None:
            self._events.flush()

    def on_job_exit(self, exit_code: int) -> None:
        """Record how the job ended; for a failed job, add torchrun's own account of which rank failed how."""
        self.stop()
        try:
            failures: list[dict] = []
            for name in ("stderr.log", "stdout.log"):
                p = self.node_dir / name
                if p.exists():
                    failures = parse_torchrun_failures(p.read_text(errors="replace")) or failures
            hbs = read_heartbeats(self.node_dir)
            last = {r: {"step": hb.get("step"), "collective": hb.get("collective"),
                        "last_progress_ns": hb.get("last_progress_ns"), "t_ns": hb.get("t_ns")}
                    for r, hb in hbs.items()}
            rec = {"exit_code": exit_code, "hang_fired": self.fired, "t_ns": time.monotonic_ns(),
                   "torchrun_failures": failures, "ranks": last}
            self._write("exit.json", rec)
            if exit_code != 0 and not self.fired:
                root = [f for f in failures if f["root_cause"]] or failures
                what = ", ".join(f"rank {f['rank']} " + (f"killed by {f['signal']}" if f["signal"]
                                                         else f"exit code {f['exit_code']}") for f in root)
                self._event("error", f"job failed with exit code {exit_code}" + (f": {what}" if what else ""))
        except Exception as e:
            self._event("warning", f"watchdog could not record the job's exit: {type(e).__name__}: {e}")
        finally:
            if self._events is not None:
                self._events.close()
            self._events = None  # stop() and on_job_exit() may both be called, in either order

    # -- internals ---------------------------------------------------------------------------------------------
    def _write(self, name: str, obj: dict) -> None:
        d = self.node_dir / "triage"
        d.mkdir(exist_ok=True)
        write_json_atomic(d / name, obj)

    def _event(self, level: str, message: str) -> None:
        if self._events is None:
            return
        self._events.append([-1, self._host, time.monotonic_ns(), level, "watchdog", message])
        self._events.flush()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._check_crashes()
                self._check_beats()
                if self._check_hang():
                    return
            except Exception as e:  # the watchdog must never take the launcher down
                self._event("warning", f"watchdog error: {type(e).__name__}: {e}")

    def _beats(self) -> dict[int, dict]:
        """The heartbeats of this host's ranks: ranks that DeepSpeed's pdsh launch starts on other hosts record into
        this node directory too (dtprof/launch_deepspeed.py), and neither their pids nor their monotonic clocks mean
        anything here."""
        return {r: hb for r, hb in read_heartbeats(self.node_dir).items() if hb.get("host") in (None, self._host)}

    def _check_crashes(self) -> None:
        hbs = self._beats()
        self._seen.update(hbs)
        # A rank whose process is gone without the heartbeat's clean-exit mark died (exception, signal, OOM killer).
        dead = [r for r, hb in hbs.items() if r not in self.crashed and hb.get("exit") != "clean"
                and not pid_alive(hb.get("pid"))]
        if not dead:
            return
        # Several deaths seen in one poll (survivors die of the lost connection within milliseconds, or torchrun
        # stops them with SIGTERM; on a busy machine the poll can come after both): the first to die goes first.
        # Ranks that lost a peer come after the rest, ranks stopped by SIGTERM last, then earlier heartbeats first.
        def order(r):
            hb = hbs[r]
            how = 2 if hb.get("sigterm_ns") is not None else 1 if PEER_LOSS_RE.search(str(hb.get("exit") or "")) else 0
            return how, hb.get("t_ns") or 0
        dead.sort(key=order)
        now = time.monotonic_ns()
        first = not self.crashed
        for r in dead:
            hb = hbs[r]
            lost_peer = bool(PEER_LOSS_RE.search(str(hb.get("exit") or "")))
            self.crashed[r] = {"rank": r, "pid": hb.get("pid"), "detected_ns": now, "step": hb.get("step"),
                               "exit": hb.get("exit"), "lost_peer": lost_peer,
                               "collective": hb.get("collective"), "last_heartbeat_ns": hb.get("t_ns")}
        if first:  # the survivors' state at the moment of the first death
            request_dumps(self.node_dir, "crash", f"rank(s) {dead} exited")
        self._write("crash.json", {"dead": sorted(self.crashed.values(), key=lambda c: c["detected_ns"]),
                                   "dump_id": "crash"})
        for r in dead:
            self._event("error", f"rank {r} (pid {hbs[r].get('pid')}) exited at step {hbs[r].get('step')}")

    def _check_beats(self) -> None:
        """A rank that runs but whose heartbeat stopped while another's beats on: dtprof's own thread is stuck."""
        hbs = self._beats()
        now = time.monotonic_ns()
        ages = {r: (now - hb["t_ns"]) / 1e9 for r, hb in hbs.items() if hb.get("t_ns") and hb.get("exit") is None}
        for r, age in ages.items():
            fresh = [a for q, a in ages.items() if q != r]
            if r in self._stalled or age < STALE_BEAT_S or not fresh or min(fresh) >= age / 2:
                continue
            pid = hbs[r].get("pid")
            state = process_state(pid)
            if not pid_alive(pid) or state in FROZEN_STATES or state is None:
                continue   # gone (the crash check's) or frozen whole (the hang's)
            self._stalled.add(r)
            line = (f"dtprof: rank {r}'s heartbeat thread stopped beating {age:.0f} s ago while its process ran "
                    f"(state {state}) and the other ranks' beat on: a fault of dtprof's own in that rank; its state "
                    f"dumps are missing, the job runs on")
            self.beat_faults.append(line)
            self._event("error", line)

    def _check_hang(self) -> bool:
        hbs = self._beats()
        if self.crashed:
            return False  # a crashed job is torchrun's to stop; it is not a hang
        if not hbs:
            return False  # no rank has started yet: start-up and rendezvous are torchrun's to time out
        running = {r: hb for r, hb in hbs.items() if hb.get("exit") != "clean"}
        if not running:
            return False  # every rank finished; a slow interpreter exit is not a hang
        now = time.monotonic_ns()
        for r, hb in hbs.items():
            self._first_progress.setdefault(r, hb.get("last_progress_ns"))
        if self._training_ns is None:
            if not any((hb.get("step") or 0) > 0 or hb.get("collective")
                       or hb.get("last_progress_ns") != self._first_progress[r] for r, hb in hbs.items()):
                return False   # still starting up
            self._training_ns = now
        progress = [hb.get("last_progress_ns") or 0 for hb in hbs.values()]
        newest = max(*progress, self._training_ns)
        idle_s = (now - newest) / 1e9
        if idle_s < self.timeout_s:
            return False
        self.fired = True
        # Each rank's last beat and process state before the dump request: a frozen process (SIGSTOP, stuck in the
        # kernel) stops its heartbeat thread too, so its beat is the one that is old while the others' are fresh.
        # (None for a rank that exited: its heartbeat ended with it)
        frozen = {r: {"heartbeat_age_s": round((now - (hb.get("t_ns") or now)) / 1e9, 3)
                      if hb.get("exit") is None else None,
                      "process_state": process_state(hb.get("pid"))} for r, hb in hbs.items()}
        live = [r for r, hb in hbs.items() if pid_alive(hb.get("pid"))]
        request_dumps(self.node_dir, "hang", f"no rank progressed for {idle_s:.1f} s")
        got = wait_for_dumps(self.node_dir, "hang", live, DUMP_WAIT_S)
        rec = {"detected_ns": now, "timeout_s": self.timeout_s, "idle_s": idle_s, "dump_id": "hang",
               "ranks": {r: {"step": hb.get("step"), "collective": hb.get("collective"),
                             "last_progress_ns": hb.get("last_progress_ns"), "pid": hb.get("pid"),
                             "dumped": r in got, **frozen[r]} for r, hb in sorted(hbs.items())},
               "missing_dumps": sorted(set(live) - set(got))}
        self._write("hang.json", rec)
        self._event("error", f"hang: no rank progressed for {idle_s:.1f} s (--hang-timeout {self.timeout_s:g}); "
                             f"state dumped by {len(got)} of {len(hbs)} rank(s); stopping the job")
        try:
            self.stop_job()
        finally:
            self._write("hang.json", {**rec, "stopped_ns": time.monotonic_ns()})
        return True
