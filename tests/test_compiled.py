"""Compiled models stay compiled under `dtprof run`: Dynamo's own counters (graphs, graph breaks, recompiles) are
the bare job's for each way users compile, the forward runs compiled after dtprof's FLOP-counting step (the eager
ops of its fused parts do not run), and dtprof still records the steps, forward, backward and MFU.
Real torch.compile with inductor on this CPU; one inductor cache for the session, so bare and profiled runs of a
form compile its graphs once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtprof.reader import open_run

HERE = Path(__file__).resolve().parent
FORMS = HERE / "compile_jobs" / "forms.py"
STEPS = 5
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
    e.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path_factory.mktemp("inductor")), OMP_NUM_THREADS="1",
             PYTHONWARNINGS="ignore")
    return e


def _stats(out: str) -> list[dict]:
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("FORM ")]


def _job(form: str) -> list[str]:
    if form in ("compile", "method", "blocks"):
        return [sys.executable, str(FORMS), form, str(STEPS)]
    return [str(BIN / "torchrun"), "--nproc_per_node=2", "--monitor-interval=0.2", str(FORMS), form, str(STEPS)]


@pytest.mark.parametrize("form", ["compile", "method", "blocks", "ddp_of_compiled", "compiled_ddp", "fsdp2"])
def test_dynamo_counters_equal_bare_and_under_dtprof(form, env, tmp_path):
    bare = subprocess.run(_job(form), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bare.returncode == 0, bare.stderr[-3000:]
    prof = subprocess.run([sys.executable, "-m", "dtprof.cli", "run", "--out", "run", "--no-report", "--no-nvml",
                           "--", *_job(form)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert prof.returncode == 0, prof.stderr[-3000:]
    b, p = _stats(bare.stdout), _stats(prof.stdout)
    assert len(b) == len(p) == 1
    for sb, sp in zip(b, p):
        assert {k: sp[k] for k in ("graphs", "graph_breaks", "recompiles")} == \
               {k: sb[k] for k in ("graphs", "graph_breaks", "recompiles")}, (sb, sp)
        assert sb["graphs"] >= 1
        assert sp["eager_ops"] == [] == sb["eager_ops"], "the forward ran eager after dtprof's FLOP-counting step"
        assert sp["loss"] == sb["loss"]
    run = open_run(tmp_path / "run")
    spans = run.spans
    assert set(run.steps["rank"]) == ({0} if form in ("compile", "method", "blocks") else {0, 1})
    for kind in ("forward", "backward", "optimizer"):
        assert (spans["kind"] == kind).any(), kind
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["flops_source"].startswith("executed FLOPs"), summary["mfu"]
    assert not (run.events["level"] == "error").any(), run.events


def test_hf_trainer_torch_compile_keeps_its_graphs(env, tmp_path):
    job = [str(BIN / "torchrun"), "--nproc_per_node=2", "--monitor-interval=0.2",
           str(HERE.parent / "examples" / "frameworks" / "train_hf_trainer.py"), "--steps", "8", "--compile"]
    e = dict(env, HF_HUB_OFFLINE="1")
    bare = subprocess.run(job, env=e, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bare.returncode == 0, bare.stderr[-3000:]
    prof = subprocess.run([sys.executable, "-m", "dtprof.cli", "run", "--out", "run", "--no-report", "--no-nvml",
                           "--", *job], env=e, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert prof.returncode == 0, prof.stderr[-3000:]

    def lines(out):
        return sorted(ln for ln in out.splitlines() if "dynamo:" in ln)

    assert lines(bare.stdout) and lines(prof.stdout) == lines(bare.stdout)
    assert "graphs 0 " not in lines(bare.stdout)[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["value"] is not None and summary["steps"]["count"] > 0
