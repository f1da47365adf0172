"""HolisticTraceAnalysis' own figures on the shared real traces, to compare dtprof's GPU time with (docs/interop.md).

Run with a Python that has HTA installed (never a dtprof dependency), e.g.
    python3 -m venv /tmp/hta && /tmp/hta/bin/pip install HolisticTraceAnalysis==0.5.0
    /tmp/hta/bin/python benchmarks/hta_figures.py [TRACE_DIR]   # default: the shared traces beside the checkout
Prints, per trace: HTA's temporal breakdown, comm/compute overlap and idle time breakdown (rank 0, every stream).
HTA wants a directory of rank files, so each trace is linked into a temporary one as rank-0.json.gz.
"""
import logging
import sys
import tempfile
from pathlib import Path

import pandas as pd
from hta.trace_analysis import TraceAnalysis

logging.disable(logging.WARNING)
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 20)
_repo = Path(__file__).resolve().parents[1]  # shared/ sits beside the repository (or a worktree two levels down)
shared = (Path(sys.argv[1]) if len(sys.argv) > 1 else
          next(p for p in (_repo.parent / "shared/data/kineto", _repo.parent.parent / "shared/data/kineto")
               if p.exists()))
for name in ("nccl_single_rank.json.gz", "amd_mi250_minitoy.json.gz"):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "rank-0.json.gz").symlink_to(shared / name)
        a = TraceAnalysis(trace_dir=d)
        print(f"== {name}")
        print(a.get_temporal_breakdown(visualize=False).to_string())
        print(a.get_comm_comp_overlap(visualize=False).to_string())
        idle = a.get_idle_time_breakdown(visualize=False)[0]
        print(idle.to_string())
        by_cause = idle.groupby("idle_category")["idle_time"].sum()
        print("idle causes over all streams:", (by_cause / by_cause.sum()).round(4).to_dict())
