"""The memory ledger's cost per step (collectors/memory.py), side by side: one process recorded by dtprof as `dtprof
run` records a rank, its training loop run in alternating blocks with the ledger part in and out of the rank's parts
(everything else of dtprof stays in), so both see the same machine. Reported per configuration: the median step
(wall) and the training thread's CPU per step (``time.thread_time``: far less sensitive to the rest of the machine)
with and without the ledger, their ratio (median over block pairs of with / without), the added CPU per step, and
the ledger's own clock of itself (``cost_ns`` per row it wrote).

Configurations: ``short`` (a one-layer 32-wide TinyLM, ~1-3 ms steps) and ``normal`` (3 layers, 192 wide, tens of
ms), each under dtprof's default sampling (a short step's detail, and so the ledger's counting, only on sampled
steps) and with ``full_detail`` (every step sampled: the cost of a sampled step).

    .venv/bin/python benchmarks/memory_cost.py [--blocks 10] [--block-steps 40] [--configs short,normal]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from torch_abort import once_more_on_exit_abort  # noqa: E402  (tests/torch_abort.py says why)

MODELS = {"short": dict(vocab=64, dim=32, layers=1, seq=16, batch=4),
          "normal": dict(vocab=512, dim=192, layers=3, seq=64, batch=8)}


def worker(model_name: str, blocks: int, block_steps: int) -> None:
    import torch

    from dtprof.collectors import runtime

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM, lm_loss

    cfg = MODELS[model_name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(vocab=cfg["vocab"], dim=cfg["dim"], layers=cfg["layers"], seq=cfg["seq"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg["vocab"], (16, cfg["batch"], cfg["seq"] + 1), generator=gen)

    def train(n):
        wall, cpu = [], []
        for i in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            x, y = data[i % 16, :, :-1], data[i % 16, :, 1:]
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        return wall[1:], cpu[1:]

    train(40)                 # warm-up, past the steps before sampling starts (collectors/sampling.py SAMPLE_FROM)
    rec = runtime.STATE
    assert rec.active, "dtprof did not start in the benchmark process"
    parts = rec.parts
    ledger = next(p for p in parts.parts if p.name == "memory")

    def switch(on: bool) -> None:
        if on and ledger not in parts.parts:
            parts.parts.insert(0, ledger)
        elif not on and ledger in parts.parts:
            parts.parts.remove(ledger)
        parts.rebind()

    results = []
    for b in range(blocks):
        for mode in ("with", "without") if b % 2 else ("without", "with"):
            switch(mode == "with")
            train(3)          # the first steps after a switch are not measured
            wall, cpu = train(block_steps + 1)
            results.append({"block": b, "mode": mode, "wall": wall, "cpu": cpu})
    switch(True)
    assert not rec.disabled and ledger in parts.parts, "dtprof or the ledger switched itself off"
    print(json.dumps({"blocks": results, "ledger_rows": ledger.rows, "ledger_cost_ns": ledger.cost_ns,
                      "steps": rec.ctx.step}))


def run(model_name: str, blocks: int, block_steps: int, full_detail: bool) -> dict:
    """The worker as `dtprof run` runs a rank (dtprof injected, recording into a throwaway run)."""
    from injected import rank_env

    cmd = [sys.executable, __file__, "--worker", model_name, str(blocks), str(block_steps)]

    def launch(attempt: int) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            return subprocess.run(cmd, env=rank_env(tmp, "memory", full_detail), capture_output=True, text=True)

    out = once_more_on_exit_abort(launch)
    if out.returncode:
        sys.exit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(data: dict) -> dict:
    blocks = data["blocks"]
    med = {(r["block"], r["mode"], k): statistics.median(r[k]) for r in blocks for k in ("wall", "cpu")}
    n = max(r["block"] for r in blocks) + 1

    def ratio(k):
        return statistics.median(med[(b, "with", k)] / med[(b, "without", k)] for b in range(n))

    def overall(mode, k):
        return statistics.median(t for r in blocks if r["mode"] == mode for t in r[k])

    added = statistics.median(med[(b, "with", "cpu")] - med[(b, "without", "cpu")] for b in range(n))
    rows = data["ledger_rows"]
    return {"step_without_ms": overall("without", "wall") * 1e3, "step_with_ms": overall("with", "wall") * 1e3,
            "wall_ratio": ratio("wall"), "cpu_ratio": ratio("cpu"), "cpu_added_us_per_step": added * 1e6,
            "ledger_rows": rows, "steps": data["steps"],
            "ledger_us_per_row": data["ledger_cost_ns"] / rows / 1e3 if rows else None,
            "ledger_us_per_step": data["ledger_cost_ns"] / data["steps"] / 1e3 if data["steps"] else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10, help="with/without block pairs")
    ap.add_argument("--block-steps", type=int, default=40, help="measured steps per block")
    ap.add_argument("--configs", default="short,normal")
    args = ap.parse_args()
    print(f"{'config':22s} {'step w/o (ms)':>13s} {'step with':>10s} {'wall ratio':>10s} {'CPU ratio':>9s} "
          f"{'+CPU/step (us)':>14s} {'ledger us/row':>13s} {'rows/steps':>10s}")
    for name in args.configs.split(","):
        for full in (False, True):
            s = summarise(run(name, args.blocks, args.block_steps, full))
            label = f"{name} ({'every step sampled' if full else 'default sampling'})"
            print(f"{label:22s} {s['step_without_ms']:13.3f} {s['step_with_ms']:10.3f} {s['wall_ratio']:10.4f} "
                  f"{s['cpu_ratio']:9.4f} {s['cpu_added_us_per_step']:14.1f} {s['ledger_us_per_row'] or 0:13.1f} "
                  f"{s['ledger_rows']:>4d}/{s['steps']:<5d}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
