"""Rank-side heartbeat and on-demand state dumps, for hang and crash triage (docs/triage.md).

``start(rank_dir, state)`` starts one daemon thread in the rank that

- writes ``rank_dir/heartbeat.json`` every ~0.5 s (in place, see ``_BeatFile``) from the runtime's ``STATE``
  (rank, step, the collective the main thread is inside, ``last_progress_ns``; all times ``time.monotonic_ns()``);
- polls the node directory (``rank_dir.parent``) for ``dump-request-<id>`` files, written by the launcher's
  watchdog or by ``dtprof triage --live``, and answers each with ``rank_dir/dump-<id>.json``: Python stacks of all
  threads, the in-flight collective and PyTorch's Flight Recorder entries where available;
- on an uncaught exception writes ``dump-exception.json`` with the exception's type, message and traceback (then
  calls the previous ``sys.excepthook``), and at a
  normal interpreter exit marks the heartbeat ``"exit": "clean"``;
- on SIGTERM (torchrun stopping the survivors of a crash, or the watchdog stopping a hung job) writes
  ``dump-sigterm.json`` from this thread, then lets the signal do what it did before.

Why the SIGTERM dump is written from the heartbeat thread: a rank stuck in a collective is inside C++ and the
main thread never runs a Python signal handler. ``signal.set_wakeup_fd`` makes the C-level handler wake this
thread instead. If the previous disposition was the default (terminate), and the main thread has not run our
handler within ``_SIGTERM_GRACE_S``, this thread restores the default with libc ``signal()`` and re-raises, so the
process still dies of SIGTERM as it would have without dtprof. A previous Python handler (the user's) is called
from the main thread as before. If a wakeup fd is already in use (asyncio), SIGTERM is left alone entirely.

Nothing here raises into training: every fault disables the part that failed and is remembered in the
``Heartbeat``'s ``faults`` (written into the heartbeat file, so the launcher can record it). The Recorder owns its
``Heartbeat`` (``rec.heartbeat``); nothing is kept in this module.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dtprof.collectors.records import COLUMN

INTERVAL_S = 0.5
_SIGTERM_GRACE_S = 2.0
_FR_TIMEOUT_S = 3.0
_SIGTERM_DUMP_WAIT_S = _FR_TIMEOUT_S + 2.0   # a dump waits up to the Flight Recorder's timeout, then writes

def _write_json_atomic(path: Path, obj: Any) -> None:
    # one write of the whole text (json.dump would issue a write per token), and an unlink only after a failure:
    # this runs twice a second in every rank, measured at ~25 % less CPU than streaming plus an unlink every time;
    # os-level calls on strings: no Python file object, no Path arithmetic
    _write_bytes_atomic(os.fspath(path), json.dumps(obj, default=str).encode())


def _write_bytes_atomic(path: str, data: bytes) -> None:
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:                       # a large dump may take more than one write
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)   # a failed write (a full disk): leave nothing half-written behind
        except OSError:
            pass
        raise


class _BeatFile:
    """``heartbeat.json``, rewritten in place: the first beat creates it atomically, padded with spaces to a
    fixed size (JSON allows trailing white space), and every later beat that fits is one ``pwrite`` of that size
    at offset 0 into the open file (~0.37 ms of a ~0.5 ms beat was the create, write, close and rename, timed on the
    busy 2-core machine). A record that outgrows the file starts a new, larger one atomically. A reader that reads
    while a beat is written may see a mix of two beats: ``beat`` is both the first and the last key, so a mix
    shows as two different numbers (or as invalid JSON) and the reader reads again (``dtprof.watchdog``).
    Every writer of the file (the beat loop, SIGTERM, the exception hook, atexit) goes through ``write``."""

    SIZE = 2048

    def __init__(self, path: Path):
        self.path = os.fspath(path)
        self.fd: int | None = None
        self.size = 0
        self.beat = 0
        self.lock = threading.RLock()   # reentrant: a SIGTERM handler may interrupt the main thread's own write

    def write(self, record: dict) -> None:
        with self.lock:
            self.beat += 1
            data = json.dumps({"beat": self.beat, **record, "beat_end": self.beat}, default=str).encode()
            if self.fd is not None and len(data) <= self.size:
                os.pwrite(self.fd, data.ljust(self.size), 0)
                return
            size = max(self.SIZE, len(data) * 2)
            _write_bytes_atomic(self.path, data.ljust(size))
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self.fd, self.size = os.open(self.path, os.O_WRONLY), size


# STATE.collective is (a collectives row, or its columns up to issue_ns, in the schema's order; when the main thread
# entered the wait): a tuple the hot path has at hand, turned into the heartbeat's dict only here
_IN_FLIGHT_COLUMNS = [(name, COLUMN["collectives"][name]) for name in ("op", "group", "seq", "in_bytes", "dtype",
                                                                          "peer")]


def _jsonable_collective(c: Any) -> Any:
    if c is None:
        return None
    try:
        if isinstance(c, tuple):
            row, entered_ns = c
            c = {name: row[i] for name, i in _IN_FLIGHT_COLUMNS}
            c["entered_ns"] = entered_ns
        return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in dict(c).items()}
    except Exception:
        return str(c)


_HOST = socket.gethostname()


def snapshot(state: Any, beat: Heartbeat | None = None) -> dict:
    """The heartbeat record: what the rank is doing now (cheap: attribute reads only); ``beat``: the Heartbeat whose
    faults and exit it reports."""
    return {
        "rank": getattr(state, "rank", None),
        "pid": os.getpid(),
        "host": _HOST,
        "step": getattr(state, "step", None),
        "collective": _jsonable_collective(getattr(state, "collective", None)),
        "last_progress_ns": getattr(state, "last_progress_ns", None),
        "t_ns": time.monotonic_ns(),
        "wall_ns": time.time_ns(),
        "faults": list(beat.faults) if beat else [],
        "exit": beat.exit_status if beat else None,
        "sigterm_ns": beat.sigterm_ns if beat else None,
    }


def thread_stacks() -> list[dict]:
    """Python stacks of all threads, innermost frame last (as ``traceback`` prints them)."""
    names = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        t = names.get(ident)
        frames = [{"file": fs.filename, "line": fs.lineno, "func": fs.name, "code": fs.line or ""}
                  for fs in traceback.extract_stack(frame)]
        out.append({"thread_id": ident, "name": t.name if t else f"thread-{ident}",
                    "main": t is threading.main_thread() if t else False,
                    "daemon": t.daemon if t else None, "frames": frames})
    out.sort(key=lambda s: (not s["main"], s["name"]))
    return out


def flight_recorder_entries(timeout_s: float = _FR_TIMEOUT_S) -> tuple[Any, str | None]:
    """PyTorch's Flight Recorder dump as a dict (JSON form), or (None, reason). Never imports torch itself.

    The dump runs in its own thread with a time limit: if it blocks on a lock held by a stuck collective, the
    rest of the dump is still written.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch not imported in this process"
    result: dict = {}

    def work():
        try:
            c10d = torch._C._distributed_c10d
            if hasattr(c10d, "_dump_fr_trace_json"):
                raw = c10d._dump_fr_trace_json()
                result["fr"] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            elif hasattr(c10d, "_dump_fr_trace"):
                import pickle
                result["fr"] = pickle.loads(c10d._dump_fr_trace())
            else:
                result["error"] = "this torch has no Flight Recorder dump function"
        except Exception as e:  # FR disabled, not initialised, old torch: all acceptable
            result["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=work, name="dtprof-fr-dump", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None, f"Flight Recorder dump did not return within {timeout_s} s"
    return result.get("fr"), result.get("error")


def exception_record(exc_type, exc, tb) -> dict:
    """The uncaught exception itself: type, message and its traceback's frames (innermost last). The frames are
    the exception's own, not the stack of the hook that records it."""
    return {"type": exc_type.__name__, "message": str(exc)[:2000],
            "frames": [{"file": fs.filename, "line": fs.lineno, "func": fs.name, "code": fs.line or ""}
                       for fs in traceback.extract_tb(tb)]}


def write_dump(rank_dir: Path, state: Any, dump_id: str, reason: str, exception: dict | None = None,
               beat: Heartbeat | None = None) -> Path:
    """Write ``rank_dir/dump-<dump_id>.json``: heartbeat fields + stacks + Flight Recorder entries (+ the
    exception, for the ``exception`` dump)."""
    rec = snapshot(state, beat)
    rec["request"] = dump_id
    rec["reason"] = reason
    if exception is not None:
        rec["exception"] = exception
    rec["stacks"] = thread_stacks()
    fr, fr_error = flight_recorder_entries()
    rec["flight_recorder"] = fr
    rec["flight_recorder_error"] = fr_error
    path = Path(rank_dir) / f"dump-{dump_id}.json"
    _write_json_atomic(path, rec)
    return path


class Heartbeat:
    """One rank's heartbeat thread, dump answers and exit hooks (module docstring), and what it reports about
    itself."""

    def __init__(self, rank_dir: Path, state: Any):
        self.faults: list[str] = []
        # How the interpreter is ending: None while running, "exception: <type>: <msg>" after an uncaught
        # exception, "clean" at a normal interpreter exit (atexit). Written into the heartbeat so the watchdog can
        # tell a rank that finished from one that died (SIGKILL, abort, OOM killer never run atexit).
        self.exit_status: str | None = None
        # When the rank received SIGTERM (monotonic ns): torchrun stops the survivors of a crash that way, and the
        # watchdog must not take such a survivor for the rank that died first.
        self.sigterm_ns: int | None = None
        self.rank_dir = Path(rank_dir)
        self.node_dir = self.rank_dir.parent
        self.beat_file = _BeatFile(self.rank_dir / "heartbeat.json")
        self.state = state
        self.answered: set[str] = set()
        self.listed_mtime = None       # the node directory's mtime at the last listing (poll_requests)
        self.wake_r = None
        self.prev_handler: Any = None
        self.handler_ran = threading.Event()
        # Both the main thread's handler and this thread may try to dump; the first writes, the other waits for it
        # (bounded), so neither lets the process die while the other is half way through writing.
        self._sigterm_dump_claimed = threading.Lock()
        self._sigterm_dump_done = threading.Event()
        self._sigterm_dumper: int | None = None

    # -- SIGTERM -----------------------------------------------------------------------------------------------
    def install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.faults.append("heartbeat: not started from the main thread; no SIGTERM dump")
            return
        prev = signal.getsignal(signal.SIGTERM)
        if prev is signal.SIG_IGN or prev is None:
            return  # the job ignores SIGTERM (or it was set outside Python): leave it exactly as it is
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if old_fd != -1:  # someone (asyncio) owns the wakeup fd: give it back and skip the SIGTERM dump
            signal.set_wakeup_fd(old_fd)
            r.close()
            w.close()
            return
        self.wake_r, self._wake_w = r, w
        self.prev_handler = prev
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _sigterm_dump(self) -> bool:
        """Write dump-sigterm.json once; a caller from another thread waits (bounded) for the first one's dump.
        False for a second SIGTERM handled inside the thread that is writing it: that caller must return at once
        and leave the rest (the dump, then the signal's action) to the first."""
        if self._sigterm_dump_claimed.acquire(blocking=False):   # never released: one dump per process
            self._sigterm_dumper = threading.get_ident()
            self.sigterm_ns = time.monotonic_ns()
            try:
                write_dump(self.rank_dir, self.state, "sigterm", "SIGTERM received", beat=self)
                self.beat_file.write(snapshot(self.state, self))
            except Exception:
                pass
            finally:
                self._sigterm_dump_done.set()
            return True
        if self._sigterm_dumper == threading.get_ident():
            return False
        self._sigterm_dump_done.wait(_SIGTERM_DUMP_WAIT_S)
        return True

    def _on_sigterm(self, signum, frame):
        """Runs in the main thread when it reaches the interpreter: defer to what was there before."""
        self.handler_ran.set()
        if not self._sigterm_dump():
            return
        prev = self.prev_handler
        if callable(prev):
            return prev(signum, frame)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _sigterm_from_thread(self) -> None:
        """The C-level handler woke us: dump now (the main thread may be stuck in C++), then make sure the
        default action still happens if the main thread cannot run Python."""
        self._sigterm_dump()
        if callable(self.prev_handler) and not getattr(self.prev_handler, "dtprof_default_action", False):
            return   # the user's own handler decides (dtprof's runtime flush handler stands for the default)
        if not self.handler_ran.wait(_SIGTERM_GRACE_S):
            try:
                import ctypes
                libc = ctypes.CDLL(None)
                libc.signal(signal.SIGTERM, 0)  # 0 == SIG_DFL, process-wide, allowed from any thread
                os.kill(os.getpid(), signal.SIGTERM)
            except Exception:
                os._exit(128 + signal.SIGTERM)

    def _drain_wakeup(self) -> bool:
        if self.wake_r is None:
            return False
        try:
            data = self.wake_r.recv(64)
        except (BlockingIOError, OSError):
            return False
        return bytes([signal.SIGTERM]) in data

    # -- exit ---------------------------------------------------------------------------------------------------
    def install_exit_hooks(self) -> None:
        import atexit
        prev_hook = sys.excepthook

        def excepthook(exc_type, exc, tb):
            try:
                self.exit_status = f"exception: {exc_type.__name__}: {exc}"[:500]
                write_dump(self.rank_dir, self.state, "exception", self.exit_status,
                           exception_record(exc_type, exc, tb), beat=self)
                self.beat_file.write(snapshot(self.state, self))
            except Exception:
                pass
            prev_hook(exc_type, exc, tb)

        def at_exit():
            try:
                if self.exit_status is None:
                    self.exit_status = "clean"
                self.beat_file.write(snapshot(self.state, self))
            except Exception:
                pass

        sys.excepthook = excepthook
        atexit.register(at_exit)

    # -- loop --------------------------------------------------------------------------------------------------
    def poll_requests(self) -> None:
        # A request is a new file in the node directory, which changes its mtime: one stat per beat, and a listing
        # only after a change (a beat costs ~0.6 ms of CPU on a busy 2-core machine, ~60 us of it the listing). An
        # mtime under a second old is listed again: a file created later within the same clock tick keeps it.
        mtime = os.stat(self.node_dir).st_mtime_ns
        if mtime == self.listed_mtime and time.time_ns() - mtime > 1_000_000_000:
            return
        self.listed_mtime = mtime
        for name in os.listdir(self.node_dir):
            if not name.startswith("dump-request-"):
                continue
            dump_id = name[len("dump-request-"):]
            if dump_id in self.answered or dump_id.startswith("."):
                continue
            self.answered.add(dump_id)
            try:
                reason = (self.node_dir / name).read_text().strip() or "requested"
            except OSError:
                reason = "requested"
            write_dump(self.rank_dir, self.state, dump_id, reason, beat=self)

    def run(self) -> None:
        import select
        while True:
            try:
                self.beat_file.write(snapshot(self.state, self))
                self.poll_requests()
            except Exception as e:  # keep beating: a full disk now may be fine later
                msg = f"heartbeat: {type(e).__name__}: {e}"
                if msg not in self.faults:
                    self.faults.append(msg)
            try:
                if self.wake_r is not None:
                    ready, _, _ = select.select([self.wake_r], [], [], INTERVAL_S)
                    if ready and self._drain_wakeup():
                        self._sigterm_from_thread()
                else:
                    time.sleep(INTERVAL_S)
            except Exception as e:
                self.faults.append(f"heartbeat wait: {type(e).__name__}: {e}")
                time.sleep(INTERVAL_S)


    def start(self) -> bool:
        """Install the exit hooks and the SIGTERM dump, start the thread. False if it could not start."""
        try:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
            try:
                self.install_exit_hooks()
            except Exception as e:
                self.faults.append(f"heartbeat: exit hooks disabled ({type(e).__name__}: {e})")
            try:
                self.install_sigterm()
            except Exception as e:
                self.faults.append(f"heartbeat: SIGTERM dump disabled ({type(e).__name__}: {e})")
            threading.Thread(target=self.run, name="dtprof-heartbeat", daemon=True).start()
            return True
        except Exception as e:
            self.faults.append(f"heartbeat: disabled ({type(e).__name__}: {e})")
            return False


def start(rank_dir, state) -> bool:
    """Start a heartbeat for ``state`` (a process without a Recorder: the Recorder starts and keeps its own).
    Returns False if it could not start."""
    return Heartbeat(rank_dir, state).start()
