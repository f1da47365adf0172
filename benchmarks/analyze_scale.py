"""Analyse a synthetic 1,024-rank, 200-step run end to end (open_run + analyze) and print wall time and peak RSS.

~10 million spans + collectives: per rank and step 5 phase spans, 2 × 10 nested module spans and 25 DDP buckets.
Targets (issue 3): < 60 s and < 8 GiB on the 2-core development machine. The build time is printed apart.

    .venv/bin/python benchmarks/analyze_scale.py [--ranks 1024] [--steps 200]
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from synth import build_run  # noqa: E402


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hosts", type=int, default=128)
    args = ap.parse_args()
    from dtprof.analyzers.summary import analyze
    from dtprof.reader import open_run

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run"
        t0 = time.perf_counter()
        build_run(path, world_size=args.ranks, steps=args.steps, hosts=args.hosts, buckets=25, module_spans=10,
                  jitter_frac=0.05, slow_rank=7, slow_factor=1.3,
                  host_offset_ns=[i * 1_000_000 for i in range(args.hosts)])
        t_build = time.perf_counter() - t0
        rss_build = rss_gib()
        t1 = time.perf_counter()
        run = open_run(path)
        n_rows = len(run.spans) + len(run.collectives)
        t_read = time.perf_counter() - t1

        t_start = time.perf_counter()

        def progress(msg):
            print(f"  {time.perf_counter() - t_start:6.1f} s  {msg}", file=sys.stderr)

        a = analyze(run, progress=progress)
        t_total = time.perf_counter() - t1
    s = a.summary
    print(f"ranks {args.ranks}, steps {args.steps}, spans+collectives {n_rows:,}")
    print(f"build {t_build:.1f} s (peak RSS so far {rss_build:.2f} GiB)")
    print(f"open_run + table read {t_read:.1f} s; open_run + analyze {t_total:.1f} s (target < 60 s)")
    print(f"peak RSS {rss_gib():.2f} GiB (target < 8 GiB; includes the build)")
    print(f"stragglers found: {[x['rank'] for x in s['stragglers']]}; step p50 {s['steps']['time_s']['p50']:.4f} s")
    ok = t_total < 60 and rss_gib() < 8
    print("OK" if ok else "OVER TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
