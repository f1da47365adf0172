"""The output relay (dtprof/relay.py) as `dtprof run` uses it: a process reading one of the job's pipes, copying to
the terminal and the log. It copies frequent output in bursts (to spend one wake-up per burst, not per line), so
these check what a user would notice if that went wrong: a lost, reordered or late line, a line only at exit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time


def start_relay(stdin, log):
    return subprocess.Popen([sys.executable, "-m", "dtprof.relay", "1", str(log)], stdin=stdin,
                            stdout=subprocess.PIPE)


def arrivals(relay):
    """(monotonic time, line) of each line the relay writes to its terminal, read in a thread."""
    got = []

    def read():
        for line in relay.stdout:
            got.append((time.monotonic(), line))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return got, t


def test_every_byte_in_order_to_terminal_and_log(tmp_path):
    # a chatty writer (lines of every length, some over the pipe's size, written in odd pieces) and a last line
    # without its newline: all of it, in order, in both copies
    data = b"".join(f"line {i} ".encode() + b"x" * (i * 37 % 3000) + b"\n" for i in range(20000))
    data += b"x" * (3 << 20) + b"\n" + b"last, no newline"
    r, w = os.pipe()
    relay = start_relay(r, tmp_path / "out.log")
    os.close(r)
    out = []
    t = threading.Thread(target=lambda: out.append(relay.stdout.read()), daemon=True)
    t.start()
    view, i = memoryview(data), 0
    while i < len(view):
        i += os.write(w, view[i:i + 1 + i % 100_000])
    os.close(w)
    assert relay.wait(timeout=60) == 0
    t.join(timeout=60)
    assert out[0] == data
    assert (tmp_path / "out.log").read_bytes() == data


def test_lines_arrive_soon_whether_rare_or_frequent(tmp_path):
    # A line after a quiet spell goes out at once; lines every 10 ms wait at most about the relay's 0.1 s. The bound
    # checked is 1 s, generous for a busy 2-core machine (measured: at most ~0.1 s), and still far from "at exit".
    r, w = os.pipe()
    relay = start_relay(r, tmp_path / "out.log")
    os.close(r)
    got, reader = arrivals(relay)
    sent = []
    for i in range(100):
        time.sleep(0.5 if i in (0, 50) else 0.01)
        sent.append(time.monotonic())
        os.write(w, f"step {i}\n".encode())
    time.sleep(1.5)
    late = [i for i, (t, _) in enumerate(got) if t - sent[i] > 1.0]
    assert len(got) == 100 and not late, (len(got), late)
    os.close(w)
    assert relay.wait(timeout=30) == 0
    assert [line for _, line in got] == [f"step {i}\n".encode() for i in range(100)]


def test_a_job_killed_mid_output_loses_nothing(tmp_path):
    # the job dies of SIGKILL while printing (no flush of its own at exit): what it wrote reaches both copies
    job = textwrap.dedent("""
        import os, signal, sys
        for i in range(3000):
            os.write(1, f"line {i}\\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE)
    relay = start_relay(proc.stdout, tmp_path / "out.log")
    proc.stdout.close()
    out, _ = relay.communicate(timeout=60)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    want = "".join(f"line {i}\n" for i in range(3000)).encode()
    assert out == want and (tmp_path / "out.log").read_bytes() == want
