"""Compiled models stay compiled under `dtprof run`: Dynamo's own counters (graphs, graph breaks, recompiles) are
the bare job's for each way users compile, the forward runs compiled after dtprof's FLOP-counting step (the eager
ops of its fused parts do not run), nothing of dtprof's enters a graph (fullgraph=True would raise at a graph break;
compiled autograd compiles the backward around dtprof's backward wrapper), and dtprof still records the steps,
forward, backward, MFU, its memory ledger and, with its numerics part on (as always), every step's loss (both parts
at work while Dynamo's counters are read).
Real torch.compile on this CPU (inductor where the kernels matter, aot_eager where only Dynamo's counters do); torch's
own inductor cache (conftest ``compile_env``), so bare and profiled runs of a form build its kernels once.
The framework switches and sampling are in test_compiled_frameworks.py."""
import json
import sys

import pytest

from conftest import TESTS, bare_and_profiled, torchrun
from dtprof.reader import open_run

FORMS = TESTS / "compile_jobs" / "forms.py"
STEPS = 5


def _stats(out: str) -> list[dict]:
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("FORM ")]


def _job(form: str) -> list[str]:
    # inductor for the plain form (its fused kernels show that the forward ran compiled), aot_eager for the others:
    # the same graphs, breaks and recompiles without building C++ for each
    backend = "inductor" if form == "compile" else "aot_eager"
    if form in ("compile", "fullgraph_autograd", "method", "blocks"):
        return [sys.executable, str(FORMS), form, str(STEPS), backend]
    return torchrun(FORMS, form, STEPS, backend)


@pytest.mark.parametrize("form", ["compile", "fullgraph_autograd", "method", "blocks", "ddp_of_compiled",
                                  "compiled_ddp", "fsdp2"])
def test_dynamo_counters_equal_bare_and_under_dtprof(form, compile_env, tmp_path):
    bare, prof = bare_and_profiled(_job(form), compile_env, tmp_path)
    b, p = _stats(bare), _stats(prof)
    assert len(b) == len(p) == 1
    for sb, sp in zip(b, p):
        assert {k: sp[k] for k in ("graphs", "graph_breaks", "recompiles")} == \
               {k: sb[k] for k in ("graphs", "graph_breaks", "recompiles")}, (sb, sp)
        assert sb["graphs"] >= 1
        if form == "compile":
            assert sp["eager_ops"] == [] == sb["eager_ops"], "the forward ran eager after dtprof's FLOP-counting step"
        assert sp["loss"] == sb["loss"]
    run = open_run(tmp_path / "run")
    spans = run.spans
    assert set(run.steps["rank"]) == ({0} if len(_job(form)) == 5 else {0, 1})
    for kind in ("forward", "backward", "optimizer"):
        assert (spans["kind"] == kind).any(), kind
    # the numerics part (collectors/numerics.py) was on: every step's local loss read from the compiled model's
    # output, the last one the job's own (rank 0 prints it, rounded)
    h = run.health
    assert len(h) == len(run.steps) and h["loss"].notna().all(), h
    last = h[h["rank"] == 0].sort_values("step")["loss"].iloc[-1]
    assert round(float(last), 5) == sp["loss"], (last, sp["loss"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["flops_source"].startswith("executed FLOPs"), summary["mfu"]
    assert not (run.events["level"] == "error").any(), run.events
    # the memory ledger part counted its tensors in these compiled runs: the counters above are with it at work
    assert len(run.memory) and (run.memory["params_bytes"] > 0).all(), run.memory
