"""How big and how fast is the HTML report of a large run?

Builds a synthetic 1,024-rank, 1,000-step DDP run (tests/synth.py), writes its report, and loads it in headless
Chromium. Prints the HTML size and the load times; the targets are at most 15 MB and loaded within 3 s.

    .venv/bin/python benchmarks/report_scale.py [--ranks 1024] [--steps 1000] [--keep DIR]

"loaded" = the page's load event; "drawn" = every chart drawn (body[data-charts=done]). The analysis is the real
``dtprof.analyzers.summary.analyze`` when installed, else the tests' stand-in (said in the output).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SIZE_TARGET_MB = 15.0
LOAD_TARGET_S = 3.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--keep", type=Path, default=None, help="build the run here and keep it")
    args = ap.parse_args()

    from dtprof.reader import open_run
    from dtprof.reports.html import write_report
    from fake_analysis import get_analysis
    from synth_report import build_report_run

    tmp = tempfile.TemporaryDirectory() if args.keep is None else None
    run_dir = (Path(tmp.name) if tmp else args.keep) / f"scale-{args.ranks}x{args.steps}"
    t = time.perf_counter()
    build_report_run(run_dir, world_size=args.ranks, steps=args.steps, hosts=max(1, args.ranks // 8),
                     slow_rank=args.ranks // 3, slow_factor=1.2, jitter_frac=0.03)
    print(f"built run: {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t:.1f} s")
    run = open_run(run_dir)
    t = time.perf_counter()
    analysis = get_analysis(run)
    real = type(analysis).__module__.startswith("dtprof")
    print(f"analysis ({'dtprof.analyzers' if real else 'tests/fake_analysis stand-in'}): "
          f"{time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    out = write_report(run_dir, analysis=analysis, progress=True)
    build_s = time.perf_counter() - t
    size_mb = out.stat().st_size / 1e6
    print(f"report written in {build_s:.1f} s: {out.stat().st_size:,} bytes ({size_mb:.1f} MB, "
          f"target <= {SIZE_TARGET_MB:.0f} MB)")

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        # side by side: a page holding only the inlined plotly.js, to tell our cost from the machine's speed
        from plotly.offline import get_plotlyjs
        base = run_dir / "plotly-only.html"
        base.write_text(f"<!DOCTYPE html><html><body><script>{get_plotlyjs()}</script></body></html>")
        bpage = browser.new_page()
        bpage.goto(base.as_uri(), wait_until="load")   # warm the disk cache once
        t = time.perf_counter()
        bpage.reload(wait_until="load")
        base_s = time.perf_counter() - t
        bpage.close()
        t = time.perf_counter()
        page.goto(out.as_uri(), wait_until="load")
        load_s = time.perf_counter() - t
        page.wait_for_selector("body[data-charts=done]", timeout=120_000)
        drawn_s = time.perf_counter() - t
        n = page.evaluate("document.querySelectorAll('div.chart[data-drawn]').length")
        browser.close()
    print(f"headless Chromium: loaded in {load_s:.2f} s, all {n} charts drawn in {drawn_s:.2f} s "
          f"(target <= {LOAD_TARGET_S:.0f} s); network requests beyond the file: {len(requests) - 1}; "
          f"console errors: {len(errors)}")
    ok = size_mb <= SIZE_TARGET_MB and load_s <= LOAD_TARGET_S and not errors and len(requests) == 1
    print(f"plotly.js alone loads in {base_s:.2f} s on this machine: report load / plotly-only load = "
          f"{load_s / base_s:.2f}, drawn / plotly-only = {drawn_s / base_s:.2f}")
    print(f"size ratio {size_mb / SIZE_TARGET_MB:.2f} of target, load ratio {load_s / LOAD_TARGET_S:.2f}, "
          f"drawn ratio {drawn_s / LOAD_TARGET_S:.2f}: {'OK' if ok else 'OVER TARGET'}")
    if tmp:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
