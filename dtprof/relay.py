"""The job's output relay: ``python -m dtprof.relay FD LOG`` copies its stdin (one of the job's pipes) to file
descriptor FD (the terminal: 1 or 2) and to LOG as bytes arrive. Stdlib only, started by ``dtprof run``.

Why a process of its own and not a thread of the launcher: the job must never be harmed by dtprof's plumbing.
If the launcher is killed (kill -9), this process lives on and keeps draining the pipe, so a rank that prints
never dies of a broken pipe that only dtprof created and never blocks on a full pipe. It ignores SIGINT, SIGTERM
and SIGHUP for the same reason (Ctrl-C reaches the launcher's process group; the launcher forwards it to the job)
and ends when the job's side of the pipe closes.

The terminal comes first: a failing log (a full disk) stops only the log, with one line on stderr, and the exit
code says why (``DISK_FULL_EXIT`` for ENOSPC/EDQUOT, ``LOG_FAILED_EXIT`` for any other write error) so the launcher
can record it. A closed terminal (``| head``) stops only the terminal copy.
"""
from __future__ import annotations

import errno
import os
import signal
import sys

DISK_FULL_EXIT = 3
LOG_FAILED_EXIT = 4
CHUNK = 65536


def relay(in_fd: int, out_fd: int, log_path: str) -> int:
    status = 0
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        log, status = None, _log_failed(log_path, e)
    terminal_ok = True
    while True:
        try:
            chunk = os.read(in_fd, CHUNK)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        if terminal_ok:
            terminal_ok = _write_all(out_fd, chunk)
        if log is not None:
            try:
                _write_all(log, chunk, raise_errors=True)
            except OSError as e:
                os.close(log)
                log, status = None, _log_failed(log_path, e)
    if log is not None:
        os.close(log)
    return status


def _write_all(fd: int, data: bytes, raise_errors: bool = False) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            if raise_errors:
                raise
            return False
        view = view[n:]
    return True


def _log_failed(log_path: str, e: OSError) -> int:
    disk_full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "disk full" if disk_full else (e.strerror or str(e))
    msg = f"dtprof: {log_path}: {why}; stopped saving the job's output there (it still reaches the terminal)\n"
    _write_all(2, msg.encode())
    return DISK_FULL_EXIT if disk_full else LOG_FAILED_EXIT


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    out_fd, log_path = int(sys.argv[1]), sys.argv[2]
    sys.exit(relay(0, out_fd, log_path))


if __name__ == "__main__":
    main()
