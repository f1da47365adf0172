"""Where dtprof's cost on the training thread goes: a perf differential of the A/B blocks.

Runs one of benchmarks/overhead.py's jobs under `dtprof run` with dtprof's hooks switched off and on in blocks of
steps (``DTPROF_AB_BLOCK_STEPS``, collectors/runtime.py) while ``perf record`` samples the whole machine on the
monotonic clock, then splits the ranks' training-thread samples into on and off blocks by the job's own step lines
(``--print-time``: time.monotonic() at each step) and prints, per step, what the on blocks spend more: by library
(libpython: dtprof's Python; libtorch; the kernel) and by symbol. This VM has no hardware counters; perf's software
clock works. Needs ``perf`` and root (or a perf_event_paranoid that allows system-wide sampling).

    .venv/bin/python benchmarks/perf_blocks.py --job pipeline [--steps 400] [--hz 1999] [--keep DIR]

Read the totals with their noise in mind: at 1999 Hz a sample is 0.5 ms, and a 400-step run's per-step difference
moves by a few hundred µs from run to run. On the pipeline job it put dtprof's training-thread cost in libpython (the
eval loop and frame set-up: dtprof's Python frames).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import AB, JOBS, REPO, STEP_LINE, ab_step_used, job_command  # noqa: E402


def record(job: str, steps: int, hz: int, out: Path) -> None:
    perf = subprocess.Popen(["perf", "record", "-a", "-k", "CLOCK_MONOTONIC", "-F", str(hz), "-o",
                             str(out / "perf.data"), "--", "sleep", "3600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    cmd, env = job_command(job, steps, out / "run", AB[job][0])
    try:
        with open(out / "stdout.txt", "w") as so:
            subprocess.run(cmd, cwd=REPO, env=env, stdout=so, stderr=subprocess.DEVNULL, check=False)
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    with open(out / "samples.txt", "w") as f:
        subprocess.run(["perf", "script", "-i", str(out / "perf.data"), "-F", "tid,time,ip,sym,dso"], stdout=f,
                       stderr=subprocess.DEVNULL, check=False)


def blocks(out: Path, block: int) -> list[tuple[float, float, bool]]:
    """(start, end, hooks on) of each step overhead.py's ab_pairs uses (ab_step_used), but in the first two blocks
    (warm-up)."""
    lines = []
    for line in (out / "stdout.txt").read_text().splitlines():
        m = STEP_LINE.match(line)
        if m:
            lines.append((int(m.group(1)), float(m.group(2))))
    return [(t0, t1, (n1 // block) % 2 == 0) for (n0, t0), (n1, t1) in zip(lines, lines[1:])
            if ab_step_used(n0, n1, block) and n1 // block >= 2]


def differential(out: Path, block: int, top: int, hz: int) -> None:
    steps = blocks(out, block)
    if not steps:
        sys.exit(f"perf_blocks: no step lines with times in {out / 'stdout.txt'}")
    n = collections.Counter(on for _, _, on in steps)
    starts = [s for s, _, _ in steps]
    ranks = {}
    for p in (out / "run").glob("*/rank-*/rank.json"):
        ident = json.loads(p.read_text())
        ranks[int(ident["pid"])] = int(ident["rank"])     # a rank's main thread: tid == pid
    by_lib: collections.Counter = collections.Counter()
    by_sym: collections.Counter = collections.Counter()
    with open(out / "samples.txt") as f:
        for line in f:
            p = line.split()
            if len(p) < 4 or not p[0].isdigit() or int(p[0]) not in ranks:
                continue
            t = float(p[1].rstrip(":"))
            i = bisect.bisect_right(starts, t) - 1
            if i < 0 or t > steps[i][1]:
                continue
            on, dso = steps[i][2], p[-1].strip("()").rsplit("/", 1)[-1]
            lib = "libpython" if "libpython" in dso else "libtorch" if dso.startswith(("libtorch", "libc10")) else dso
            by_lib[(ranks[int(p[0])], on, lib)] += 1
            by_sym[(on, " ".join(p[3:-1]) + " " + lib)] += 1
    ms = 1e3 / hz           # one sample, in ms

    def per_step(c, key_on, key_off):
        return (c[key_on] / n[True] - c[key_off] / n[False]) * ms

    print(f"{out}: {n[True]} on and {n[False]} off steps; on - off per step, ms of CPU:")
    for r in sorted(set(ranks.values())):
        libs = {lib for (rr, _, lib) in by_lib if rr == r}
        rows = sorted(((per_step(by_lib, (r, True, lib), (r, False, lib)), lib) for lib in libs), reverse=True)
        print(f"  rank {r}: total {sum(x for x, _ in rows):+.3f}; " +
              ", ".join(f"{lib} {x:+.3f}" for x, lib in rows if abs(x) >= 0.02))
    syms = {s for (_, s) in by_sym}
    rows = sorted(((per_step(by_sym, (True, s), (False, s)), s) for s in syms), reverse=True)
    print(f"  symbols, all ranks, most more with the hooks on (top {top}):")
    for x, s in rows[:top]:
        print(f"    {x:+.3f}  {s[:140]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default="pipeline", choices=[j for j in JOBS if not j.endswith("-gpu")])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--hz", type=int, default=1999)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--keep", type=Path, default=None, help="keep perf.data, the samples and the run here")
    a = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("perf_blocks: needs perf (linux-perf) on PATH")
    out = a.keep or Path(tempfile.mkdtemp(prefix="perf-blocks-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        record(a.job, a.steps, a.hz, out)
        differential(out, AB[a.job][0], a.top, a.hz)
    finally:
        if a.keep is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
