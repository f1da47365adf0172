"""Rank-side overhead of dtprof: training step time bare vs under dtprof vs under torch.profiler (reference).

One process, started the way `dtprof run` starts a rank (the injected sitecustomize on PYTHONPATH), trains the
example TinyLM on CPU (compute-bound, one thread, steps of tens of ms). It alternates short blocks of steps in three
modes, rotating their order, so the machine's noise (other jobs) hits every mode alike:
- bare: dtprof's training hooks removed (``runtime.STATE.remove_train_hooks``); its idle flusher thread stays.
- dtprof: hooks installed and recording (steps, forward/backward/optimizer/data_wait spans, flushed every 1 s).
- torch.profiler: CPU activities, entered before the block (not timed) and left after it; no trace export.
The first step of each block is discarded. Reported: the median step per mode and, the figure to judge by, the
median over blocks of each block's median step divided by the adjacent bare block's median (paired ratio).
Target (issue 2): dtprof <= 1 %.

    .venv/bin/python benchmarks/overhead.py [--blocks 12] [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("bare", "dtprof", "torch.profiler")


def worker(blocks: int, steps: int) -> None:
    import torch

    from dtprof.collectors import runtime

    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM, lm_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=192, layers=3, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 512, (16, 8, 65), generator=g)

    def train(n):
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            x, y = data[i % 16, :, :-1], data[i % 16, :, 1:]
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out[1:]

    train(5)                                            # warm-up (with dtprof on, as it starts)
    installed = True
    results = []
    for b in range(blocks):
        for mode in MODES[b % 3:] + MODES[: b % 3]:
            want = mode == "dtprof"
            if want != installed:
                (runtime.STATE.install_train_hooks if want else runtime.STATE.remove_train_hooks)()
                installed = want
            if mode == "torch.profiler":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    t = train(steps + 1)
                    prof.step()
            else:
                t = train(steps + 1)
            results.append({"block": b, "mode": mode, "times": t})
    # Absolute cost per step, measured where it is not drowned by compute: a tiny model (as many modules as TinyLM)
    # whose step is ~1 ms; it is made a root module like TinyLM, so each step runs dtprof's forward hooks on the
    # root, its backward wrapper and its optimizer hooks, and writes the step and span rows.
    tiny = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(sum(1 for _ in model.modules()))])
    runtime.STATE.note_root(tiny)
    if installed:
        runtime.STATE.remove_train_hooks()
        runtime.STATE.install_train_hooks()
    topt = torch.optim.SGD(tiny.parameters(), lr=1e-3)
    xt = torch.randn(4, 8)
    tiny_res = {"bare": [], "dtprof": []}
    for b in range(60):
        for mode in ("bare", "dtprof") if b % 2 else ("dtprof", "bare"):
            want = mode == "dtprof"
            if want != installed:
                (runtime.STATE.install_train_hooks if want else runtime.STATE.remove_train_hooks)()
                installed = want
            t0 = time.perf_counter()
            for _ in range(100):
                tiny(xt).sum().backward()
                topt.step()
            tiny_res[mode].append((time.perf_counter() - t0) / 100)
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    print(json.dumps({"blocks": results, "tiny": tiny_res,
                      "module_calls_per_step": sum(1 for _ in model.modules())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per block")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a.blocks, a.steps)

    import dtprof._inject
    from dtprof.runformat import create_node_dir, create_run_dir

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
        env["OMP_NUM_THREADS"] = "1"
        env["DTPROF_NODE_DIR"] = str(create_node_dir(create_run_dir(Path(tmp) / "run", {"benchmark": "overhead"})))
        env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 1.0})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(dtprof._inject.__file__).parent), env.get("PYTHONPATH", "")])
        print(f"running {a.blocks} blocks x {len(MODES)} modes x {a.steps} steps ...", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, "--worker", "--blocks", str(a.blocks), "--steps",
                              str(a.steps)], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        data = json.loads(out.stdout.strip().splitlines()[-1])
        results = data["blocks"]

    med = {(r["block"], r["mode"]): statistics.median(r["times"]) for r in results}
    print(f"{'mode':15s} {'median step (ms)':>17s} {'paired ratio vs bare':>21s}   blocks x steps")
    ratios = {}
    all_bare = [t for r in results if r["mode"] == "bare" for t in r["times"]]
    for m in MODES:
        all_t = [t for r in results if r["mode"] == m for t in r["times"]]
        ratios[m] = statistics.median(med[(b, m)] / med[(b, "bare")] for b in range(a.blocks))
        print(f"{m:15s} {statistics.median(all_t) * 1e3:17.3f} {ratios[m]:21.4f}   {a.blocks} x {a.steps}")
    print(f"dtprof overhead: {(ratios['dtprof'] - 1) * 100:+.2f} % of the step (paired median; target <= 1 %); "
          f"torch.profiler: {(ratios['torch.profiler'] - 1) * 100:+.2f} %")
    tiny = data["tiny"]
    added = statistics.median(d - b for d, b in zip(tiny["dtprof"], tiny["bare"]))
    print(f"absolute: dtprof adds {added * 1e6:.1f} us per step (root-module forward hooks, one backward, one "
          f"optimizer step, {data['module_calls_per_step']} modules; "
          f"tiny-model step {statistics.median(tiny['bare']) * 1e6:.0f} us bare) "
          f"= {added / 0.010 * 100:.2f} % of a 10 ms step, {added / statistics.median(all_bare) * 100:.2f} % of "
          f"the TinyLM step above")


if __name__ == "__main__":
    main()
