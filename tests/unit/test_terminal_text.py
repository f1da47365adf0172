"""`dtprof run` and `dtprof summary` print one terminal text (issue 46 point 3): the launcher prints
``format_summary_text`` of its analysis; `dtprof summary` prints the same, GPU lines included, for a stored H200
run with a kernel trace."""
from __future__ import annotations

import shutil

from click.testing import CliRunner

from conftest import TESTS
from dtprof.analyzers.summary import analyze
from dtprof.cli import main
from dtprof.options import resolve_options
from dtprof.reader import open_run
from dtprof.reports.terminal import format_summary_text


def test_summary_verb_prints_the_launchers_text_with_the_gpu_lines(tmp_path):
    run_dir = tmp_path / "ddp-h200"
    shutil.copytree(TESTS / "data/gpu/ddp-h200", run_dir)
    res = CliRunner().invoke(main, ["summary", str(run_dir), "--no-write"])
    assert res.exit_code == 0, res.output
    run = open_run(run_dir)
    text = format_summary_text(analyze(run, resolve_options(run)).summary)
    assert "GPU time (kernels" in text        # the kernel trace's lines are part of the one text
    assert res.output.rstrip("\n") == text.rstrip("\n")
