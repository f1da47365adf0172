"""The job's output relay: ``python -m dtprof.relay FD LOG`` copies its stdin (one of the job's pipes) to file
descriptor FD (the terminal: 1 or 2) and to LOG. Stdlib only, started by ``dtprof run``.

Why a process of its own and not a thread of the launcher: the job must never be harmed by dtprof's plumbing.
If the launcher is killed (kill -9), this process lives on and keeps draining the pipe, so a rank that prints
never dies of a broken pipe that only dtprof created and never blocks on a full pipe. It ignores SIGINT, SIGTERM
and SIGHUP for the same reason (Ctrl-C reaches the launcher's process group; the launcher forwards it to the job)
and ends when the job's side of the pipe closes (at the job's exit or crash: everything written before is copied).

Copied in bursts: a wake-up of this process costs ~40-70 us of CPU on a busy 2-core VM whatever it copies, and the
ranks share those cores, so a job that prints a line per step would pay that per step. A read that waited less
than COALESCE_S for its data is followed by a sleep of COALESCE_S, so what the job prints meanwhile waits in the
pipe (grown to PIPE_BYTES) and the next read takes all of it: output that comes often is copied once per COALESCE_S
(a line waits at most about that), output that comes now and then at once, at one wake-up per read. A read that
fills half the buffer or more is followed by the next read at once, so a job that prints a lot is drained as fast
as it writes and blocks on a full pipe no more than before. Each read is written to the terminal and to the log in
one call each, so a stream's order is kept; stdout and stderr are two pipes and two relays, so lines of the one
may reach the terminal up to about COALESCE_S before lines the job printed earlier to the other.

The terminal comes first: a failing log (a full disk) stops only the log, with one line on stderr, and the exit
code says why (``DISK_FULL_EXIT`` for ENOSPC/EDQUOT, ``LOG_FAILED_EXIT`` for any other write error) so the launcher
can record it. A closed terminal (``| head``) stops only the terminal copy.
"""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import sys
import time

DISK_FULL_EXIT = 3
LOG_FAILED_EXIT = 4
PIPE_BYTES = 1 << 20     # Linux's default pipe-max-size: room for what a chatty job prints within COALESCE_S
COALESCE_S = 0.1         # reads closer than this are followed by a sleep this long (module docstring)


def relay(in_fd: int, out_fd: int, log_path: str) -> int:
    status = 0
    try:
        log_fd: int | None = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        log_fd, status = None, _log_failed(log_path, e)
    buf = bytearray(_grow_pipe(in_fd))
    view = memoryview(buf)
    terminal_ok = True
    while True:
        ready = time.monotonic()
        try:
            n = os.readv(in_fd, [buf])
        except InterruptedError:
            continue
        except OSError:
            break
        if not n:
            break
        if terminal_ok:
            terminal_ok = _write_all(out_fd, view[:n])
        if log_fd is not None:
            try:
                _write_all(log_fd, view[:n], raise_errors=True)
            except OSError as e:
                os.close(log_fd)
                log_fd, status = None, _log_failed(log_path, e)
        if n < len(buf) // 2 and time.monotonic() - ready < COALESCE_S:   # output comes often: let it gather
            time.sleep(COALESCE_S)
    if log_fd is not None:
        os.close(log_fd)
    return status


def _grow_pipe(fd: int) -> int:
    """Grow the pipe to PIPE_BYTES where the system allows; its size in bytes (the read buffer's size)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:              # not a pipe (a file, a terminal), or over the system's limit: read as it is
        try:
            return max(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ), 65536)
        except OSError:
            return 65536


def _write_all(fd: int, data, raise_errors: bool = False) -> bool:
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
