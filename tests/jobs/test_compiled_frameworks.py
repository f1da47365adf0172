"""Compiled models stay compiled under `dtprof run` when a framework compiles them (the HF Trainer's
``torch_compile=True``, Lightning with a compiled network) and while sampling switches dtprof's hooks out and in:
Dynamo's counters and the losses are the bare job's. (The compile forms themselves: test_compiled.py; apart so that
the two files run on two test workers.)"""
import json
import re
import subprocess

import pytest

from conftest import EXAMPLES, TESTS, bare_and_profiled, dtprof, torchrun
from dtprof.reader import open_run
from torch_abort import bare_returncode, returncode

FORMS = TESTS / "compile_jobs" / "forms.py"


def _stats(out: str) -> list[dict]:
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("FORM ")]


@pytest.mark.parametrize("script,args", [
    ("train_hf_trainer.py", ("--steps", 8, "--compile")),     # TrainingArguments(torch_compile=True)
    ("train_lightning.py", ("--steps", 12, "--compile")),     # a LightningModule with a compiled network
])
def test_framework_compile_switch_keeps_its_graphs(script, args, compile_env, tmp_path):
    job = torchrun(EXAMPLES / "frameworks" / script, *args)
    # The framework compiles as its users ask it to (torch.compile through its own switch); the Dynamo counters
    # compared here (graphs, graph breaks, recompiles) come from Dynamo's tracing and guards, not the backend, so
    # every graph goes to aot_eager, as test_compiled.py's forms do where only the counters matter: inductor's C++
    # builds were most of the HF Trainer job's time (its bare job side by side: 553 s with inductor, 233 s with
    # aot_eager, the same counters, on a loaded machine). Torch's own per-graph backend override.
    env = dict(compile_env, HF_HUB_OFFLINE="1", TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager")
    bare, prof = bare_and_profiled(job, env, tmp_path)

    def lines(out):     # by pattern: two ranks' writes can share a line of torchrun's merged output
        return sorted(re.findall(r"rank \d+ dynamo: graphs \d+ graph_breaks \d+ recompiles \d+", out))

    assert lines(bare) and lines(prof) == lines(bare)
    assert "graphs 0 " not in lines(bare)[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"]["value"] is not None and summary["steps"]["count"] > 0


def test_sampling_switches_keep_the_graphs(compile_env, tmp_path):
    """Sampling takes dtprof's hooks out and puts them back every few steps (from step 32): no recompile, no graph
    break, the same losses."""
    job = torchrun(FORMS, "ddp_of_compiled", 48, "aot_eager")
    bare = subprocess.run(job, env=compile_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bare_returncode(bare) == 0, bare.stderr[-3000:]
    prof = dtprof("run", "--out", tmp_path / "run", "--no-report", "--no-nvml", "--sample-every", 8, "--", *job,
                  cwd=tmp_path, env=compile_env, timeout=600)
    assert returncode(prof) == 0, prof.stderr[-3000:]
    assert _stats(prof.stdout) == _stats(bare.stdout)
    steps = open_run(tmp_path / "run").steps
    assert (steps["detail"] == 0).sum() == 2 * len([s for s in range(32, 48) if s % 8 >= 4])
