"""`dtprof run`'s default kernel sample (docs/cli-run.md): on by default, only a process that uses a GPU captures
(this machine has none: the CPU job captures nothing, and forcing the sample on a CPU shows it is the --trace-steps
capture), `--no-kernel-sample` and `--trace-steps` replace it; its cost is the traced steps' extra time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import EXAMPLES, dtprof
from dtprof import _inject
from dtprof.reader import open_run
from dtprof.rundir.writer import create_node_dir, create_run_dir

INJECT = Path(_inject.__file__).parent
JOB = ["--steps", "5", "--batch", "4", "--seq", "16", "--dim", "32", "--layers", "2"]


def _rank_job(tmp_path: Path, config: dict):
    """examples/train_ddp.py as one process (no torchrun) recorded with the rank options ``config``."""
    run_dir = create_run_dir(tmp_path / "run", {"test": "kernel sample"})
    node_dir = create_node_dir(run_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                   "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", DTPROF_NODE_DIR=str(node_dir),
               DTPROF_CONFIG=json.dumps({"flush_interval_s": 0.2, **config}),
               PYTHONPATH=os.pathsep.join([str(INJECT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    p = subprocess.run([sys.executable, str(EXAMPLES / "train_ddp.py"), *JOB], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return open_run(run_dir), node_dir


def _captures(run) -> list:
    return run.meta.loc[run.meta["kind"].astype(str) == "trace_capture", "value"].tolist()


def test_default_sample_captures_nothing_on_a_cpu_job(tmp_path):
    run, node_dir = _rank_job(tmp_path, {"kernel_sample": {"steps": "1:3", "gpu_only": True}})
    assert _captures(run) == [] and not (node_dir / "rank-0" / "kineto").exists()
    assert not (run.events["level"].astype(str) != "info").any(), run.events


def test_forced_sample_is_the_trace_capture_and_states_its_cost(tmp_path):
    run, node_dir = _rank_job(tmp_path, {"kernel_sample": {"steps": "1:3", "gpu_only": False}})
    (w,) = _captures(run)
    assert w["steps"] == [1, 2, 3]   # captured 1 and 2; the stop and export run in step 3's time
    assert (node_dir / "rank-0" / "kineto" / "trace.json").exists()
    from dtprof.analyzers.summary import analyze
    st = analyze(run).summary["steps"]
    assert st["traced_steps"] == [1, 2, 3] and not set(st["per_step_index"]) & {1, 2, 3}
    # the cost: the traced steps' extra time over the median measured step (the profiler's start, stop and export)
    job = analyze(run).steps.groupby("step")["duration_s"].max()
    measured = job[st["per_step_index"]]
    assert st["traced_cost_s"] == sum(job[s] - measured.median() for s in (1, 2, 3))
    assert st["traced_cost_s"] > 0


def _launcher_config(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    """(the rank options the job saw, node.json's config) of `dtprof run ARGS -- python job.py`."""
    tmp_path.mkdir()
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os
        open("seen.json", "w").write(os.environ["DTPROF_CONFIG"])
    """))
    p = dtprof("run", "--out", "run", "--no-report", "--no-count-flops", *args, "--", sys.executable, "job.py",
               cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr
    (node,) = (tmp_path / "run").glob("node-*")
    return json.loads((tmp_path / "seen.json").read_text()), json.loads((node / "node.json").read_text())["config"]


def test_launcher_asks_for_the_sample_by_default_and_not_when_told(tmp_path):
    seen, config = _launcher_config(tmp_path / "a")
    assert seen["kernel_sample"] == {"steps": "10:12", "gpu_only": True} and config["kernel_sample"] == "10:12"
    seen, config = _launcher_config(tmp_path / "b", "--no-kernel-sample")
    assert "kernel_sample" not in seen and "kernel_sample" not in config
    seen, config = _launcher_config(tmp_path / "c", "--trace-steps", "3:5")   # the user's window replaces it
    assert "kernel_sample" not in seen and seen["trace_steps"] == "3:5"


def _capture_seeing_teardown(tmp_path: Path) -> tuple[list, dict]:
    """A one-step capture in this process (torch.profiler on the CPU); what TEARDOWN_CUPTI was while the profiler
    stopped (Kineto reads it then), and the capture's capture.json."""
    from dtprof.collectors.trace_capture import TraceCapture

    cap = TraceCapture(tmp_path, 0, 1)           # window 0:1 starts at creation, stops at step 0's end
    seen, stop = [], cap.prof.stop
    cap.prof.stop = lambda: (seen.append(os.environ.get("TEARDOWN_CUPTI")), stop())
    cap.on_step_end(0)
    return seen, json.loads((tmp_path / "kineto" / "capture.json").read_text())


def test_the_capture_tears_cupti_down_for_its_stop_only(tmp_path, monkeypatch):
    # left attached, CUPTI costs every later kernel launch of the job (benchmarks/cupti_linger.py on a GPU)
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    seen, meta = _capture_seeing_teardown(tmp_path)
    assert seen == ["1"] and meta["cupti_teardown"] is True
    assert "TEARDOWN_CUPTI" not in os.environ      # the job's child processes inherit nothing of it


def test_a_teardown_setting_already_there_wins(tmp_path, monkeypatch):
    # torch sets 0 itself for CUDA graphs under torch.compile; a user may set either
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    seen, meta = _capture_seeing_teardown(tmp_path)
    assert seen == ["0"] and meta["cupti_teardown"] is False and os.environ["TEARDOWN_CUPTI"] == "0"
