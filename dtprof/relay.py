"""The job's output relay: ``python -m dtprof.relay FD LOG`` copies its stdin (one of the job's pipes) to file
descriptor FD (the terminal: 1 or 2) and to LOG as bytes arrive. Stdlib only, started by ``dtprof run``.

Why a process of its own and not a thread of the launcher: the job must never be harmed by dtprof's plumbing.
If the launcher is killed (kill -9), this process lives on and keeps draining the pipe, so a rank that prints
never dies of a broken pipe that only dtprof created and never blocks on a full pipe. It ignores SIGINT, SIGTERM
and SIGHUP for the same reason (Ctrl-C reaches the launcher's process group; the launcher forwards it to the job)
and ends when the job's side of the pipe closes.

The terminal gets every read at once; the log copy is buffered for up to LOG_WRITE_S (class _Log).
The terminal comes first: a failing log (a full disk) stops only the log, with one line on stderr, and the exit
code says why (``DISK_FULL_EXIT`` for ENOSPC/EDQUOT, ``LOG_FAILED_EXIT`` for any other write error) so the launcher
can record it. A closed terminal (``| head``) stops only the terminal copy.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

DISK_FULL_EXIT = 3
LOG_FAILED_EXIT = 4
CHUNK = 65536
LOG_WRITE_S = 0.5   # the log copy lags the terminal by at most about this much


def relay(in_fd: int, out_fd: int, log_path: str) -> int:
    log = _Log(log_path)
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
        log.add(chunk)
    return log.close()


class _Log:
    """The log copy, written in one go per LOG_WRITE_S (or per CHUNK bytes) instead of once per read: a job that
    prints a line per step costs one system call fewer per line (timed at ~20 % of the relay's CPU per line on the
    busy 2-core machine). A thread writes what a job that went quiet left in the buffer, so the log is never more
    than ~LOG_WRITE_S behind the terminal (a hung job's last lines reach it); the rest is written at the end."""

    def __init__(self, path: str):
        self.path, self.status = path, 0
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.last_write = time.monotonic()
        try:
            self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self.fd, self.status = None, _log_failed(path, e)
            return
        threading.Thread(target=self._catch_up, name="dtprof-relay-log", daemon=True).start()

    def add(self, chunk: bytes) -> None:
        with self.lock:
            if self.fd is None:
                return
            self.buf += chunk
            if len(self.buf) >= CHUNK or time.monotonic() - self.last_write >= LOG_WRITE_S:
                self._write()

    def _write(self) -> None:
        """Write the buffer (lock held); a failing log (a full disk) is closed for good, with one line on stderr."""
        self.last_write = time.monotonic()
        if not self.buf or self.fd is None:
            return
        try:
            _write_all(self.fd, bytes(self.buf), raise_errors=True)
        except OSError as e:
            os.close(self.fd)
            self.fd, self.status = None, _log_failed(self.path, e)
        self.buf.clear()

    def _catch_up(self) -> None:
        while self.fd is not None:
            time.sleep(LOG_WRITE_S)
            with self.lock:
                if self.buf and time.monotonic() - self.last_write >= LOG_WRITE_S:
                    self._write()

    def close(self) -> int:
        with self.lock:
            self._write()
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        return self.status


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
