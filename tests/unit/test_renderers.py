"""One renderer contract (docs/architecture.md "How to add a renderer"): every output of dtprof is
``render(analysis, options=None)`` of a module in reports/ (compare's: of its comparison result), and the commands
print what it returns (issue 46 point 3)."""
from __future__ import annotations

import gzip
import importlib
import inspect
import json

import pytest
from click.testing import CliRunner

from dtprof import cli
from dtprof.options import open_and_analyze
from synth import SynthSpec, build_run

OUTPUTS = ("terminal", "html", "summary_json", "triage", "perfetto", "compare_render")


@pytest.mark.parametrize("name", OUTPUTS)
def test_every_output_is_render_of_the_analysis_and_options(name):
    params = list(inspect.signature(importlib.import_module(f"dtprof.reports.{name}").render).parameters.values())
    assert [p.name for p in params][1:] == ["options"] and params[1].default is None
    assert params[0].default is inspect.Parameter.empty


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    path = build_run(tmp_path_factory.mktemp("r") / "run", SynthSpec(world_size=4, slow_rank=2, slow_factor=1.5))
    return path, open_and_analyze(path)[1]   # as the commands analyse it


def test_commands_print_what_the_renderers_return(straggler_run, tmp_path):
    from dtprof.reports import perfetto, summary_json, triage

    path, a = straggler_run
    res = CliRunner().invoke(cli.main, ["triage", str(path), "--json"])
    assert res.exit_code == 1 and json.loads(res.output) == json.loads(triage.render(a, {"json": True}))
    res = CliRunner().invoke(cli.main, ["triage", str(path)])
    assert res.output == triage.render(a) + "\n"
    res = CliRunner().invoke(cli.main, ["summary", str(path), "--json", "--no-write"])
    got = json.loads(res.output)
    want = json.loads(summary_json.render(a))
    assert got.pop("analysis_s") > 0 and want.pop("analysis_s") > 0 and got == want
    out = tmp_path / "trace.json.gz"
    res = CliRunner().invoke(cli.main, ["export", "perfetto", str(path), "-o", str(out)])
    assert res.exit_code == 0
    assert gzip.decompress(out.read_bytes()) == gzip.decompress(perfetto.render(a, {"gzip": True})) \
        == perfetto.render(a)
