"""Compiled models stay compiled under `dtprof run`: Dynamo's own counters (graphs, graph breaks, recompiles) are
the bare job's for each way users compile, the forward runs compiled after dtprof's FLOP-counting step (the eager
ops of its fused parts do not run), nothing of dtprof's enters a graph (fullgraph=True would raise at a graph break;
compiled autograd compiles the backward around dtprof's backward wrapper), and dtprof still records the steps,
forward, backward and MFU.
Real torch.compile on this CPU (inductor where the kernels matter, aot_eager where only Dynamo's counters do); one
inductor cache for the module, so bare and profiled runs of a form build its kernels once."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES, TESTS, dtprof, torchrun
from dtprof.reader import open_run
from torch_abort import returncode

FORMS = TESTS / "compile_jobs" / "forms.py"
STEPS = 5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
    e.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path_factory.mktemp("inductor")), OMP_NUM_THREADS="1",
             PYTHONWARNINGS="ignore")
    return e


def _stats(out: str) -> list[dict]:
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("FORM ")]


def _job(form: str) -> list[str]:
    # inductor for the plain form (its fused kernels show that the forward ran compiled), aot_eager for the others:
    # the same graphs, breaks and recompiles without building C++ for each
    backend = "inductor" if form == "compile" else "aot_eager"
    if form in ("compile", "fullgraph_autograd", "method", "blocks"):
        return [sys.executable, str(FORMS), form, str(STEPS), backend]
    return torchrun(FORMS, form, STEPS, backend)


def _bare_and_profiled(job: list[str], env: dict, cwd) -> tuple[str, str]:
    """The job's stdout bare and under `dtprof run` (its run in ``cwd/run``)."""
    bare = subprocess.run(job, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert returncode(bare) == 0, bare.stderr[-3000:]
    prof = dtprof("run", "--out", cwd / "run", "--no-report", "--no-nvml", "--", *job, cwd=cwd, env=env, timeout=600)
    assert returncode(prof) == 0, prof.stderr[-3000:]
    return bare.stdout, prof.stdout


@pytest.mark.parametrize("form", ["compile", "fullgraph_autograd", "method", "blocks", "ddp_of_compiled",
                                  "compiled_ddp", "fsdp2"])
def test_dynamo_counters_equal_bare_and_under_dtprof(form, env, tmp_path):
    bare, prof = _bare_and_profiled(_job(form), env, tmp_path)
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
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["flops_source"].startswith("executed FLOPs"), summary["mfu"]
    assert not (run.events["level"] == "error").any(), run.events


@pytest.mark.parametrize("script,args", [
    ("train_hf_trainer.py", ("--steps", 8, "--compile")),     # TrainingArguments(torch_compile=True)
    ("train_lightning.py", ("--steps", 12, "--compile")),     # a LightningModule with a compiled network
])
def test_framework_compile_switch_keeps_its_graphs(script, args, env, tmp_path):
    job = torchrun(EXAMPLES / "frameworks" / script, *args)
    bare, prof = _bare_and_profiled(job, dict(env, HF_HUB_OFFLINE="1"), tmp_path)

    def lines(out):
        return sorted(ln for ln in out.splitlines() if "dynamo:" in ln)

    assert lines(bare) and lines(prof) == lines(bare)
    assert "graphs 0 " not in lines(bare)[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["value"] is not None and summary["steps"]["count"] > 0


def test_sampling_switches_keep_the_graphs(env, tmp_path):
    """Sampling takes dtprof's hooks out and puts them back every few steps (from step 32): no recompile, no graph
    break, the same losses."""
    job = torchrun(FORMS, "ddp_of_compiled", 48, "aot_eager")
    bare = subprocess.run(job, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert returncode(bare) == 0, bare.stderr[-3000:]
    prof = dtprof("run", "--out", tmp_path / "run", "--no-report", "--no-nvml", "--sample-every", 8, "--", *job,
                  cwd=tmp_path, env=env, timeout=600)
    assert returncode(prof) == 0, prof.stderr[-3000:]
    assert _stats(prof.stdout) == _stats(bare.stdout)
    steps = open_run(tmp_path / "run").steps
    assert (steps["detail"] == 0).sum() == 2 * len([s for s in range(32, 48) if s % 8 >= 4])
