"""`dtprof import fr`: real Flight Recorder dumps from a 2-rank gloo torchrun job become collectives rows."""
from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from conftest import bare_job
from dtprof.cli import main
from dtprof.reader import open_run

JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])
    for _ in range(3):
        dist.all_reduce(torch.ones(256))                                  # 1024 bytes
    dist.broadcast(torch.zeros(16, dtype=torch.float64), src=0)           # 128 bytes
    out = [torch.zeros(4, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(out, torch.ones(4, dtype=torch.int64), group=sub)     # 32 bytes in, 64 out
    dist.barrier()
    d = sys.argv[1]
    if rank == 0:   # one pickle dump and one JSON dump: both forms are read
        open(os.path.join(d, "fr_trace_rank_0"), "wb").write(_dump_fr_trace())
    else:
        open(os.path.join(d, "fr_trace_rank_1.json"), "wb").write(_dump_fr_trace_json())
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return bare_job(tmp_path_factory.mktemp("fr"), JOB, "dumps")


@pytest.mark.slow
def test_fr_dumps_import_as_collectives(dumps, tmp_path):
    res = CliRunner().invoke(main, ["import", "fr", str(dumps), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    run = open_run(tmp_path / "run")
    c = run.collectives
    assert set(c["source"]) == {"flight_recorder"} and c.groupby("rank").size().to_dict() == {0: 6, 1: 6}
    r0 = c[c["rank"] == 0].sort_values("issue_ns")
    assert r0["op"].tolist() == ["all_reduce"] * 3 + ["broadcast", "all_gather", "barrier"]
    assert r0["in_bytes"].tolist() == [1024, 1024, 1024, 128, 32, 0]
    assert r0["out_bytes"].tolist() == [1024, 1024, 1024, 128, 64, 0]
    assert r0["dtype"].tolist()[:5] == ["float32"] * 3 + ["float64", "int64"]
    # the same instance (group, seq) is the same call on both ranks
    piv = c.pivot_table(index=["group", "seq"], columns="rank", values="in_bytes", aggfunc="first")
    assert len(piv) == 6 and (piv[0] == piv[1]).all()
    default = c[c["group"] == r0["group"].iloc[0]]
    assert sorted(default[default["rank"] == 1]["seq"]) == [1, 2, 3, 4, 5]
    assert set(c["group_size"]) == {2} and (c["issue_ns"] > 1.6e18).all()  # wall-clock ns
    assert set(run.groups["ranks"]) == {"0,1"}
    assert run.ranks["rank"].tolist() == [0, 1]


def test_fr_bad_dump_is_one_line_error(tmp_path):
    (tmp_path / "fr_trace_rank_0").write_bytes(b"not a dump")
    res = CliRunner().invoke(main, ["import", "fr", str(tmp_path / "fr_trace_rank_0"), "-o", str(tmp_path / "r")])
    assert res.exit_code == 2 and "fr_trace_rank_0" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "r").exists()
