"""Run a command beside dtprof's NVML sampler and nothing else of dtprof: the sampler thread `dtprof run` starts in
its launcher (every GPU, the default 0.1 s period, its rows written to a scratch node directory), the command bare.

On a GPU machine this tells whether NVML's queries alone slow a job (the DDP tutorial's ~1.4 ms CUDA steps under
`dtprof run`: benchmarks/device_check.sh, TUTORIAL_RUNS' bare_nvml). Prints what the sampler found on stderr and
exits with the command's status.

Usage: python benchmarks/nvml_beside.py [--interval S] -- COMMAND...
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from dtprof.collectors.nvml import NvmlSampler
from dtprof.rundir.writer import create_node_dir, create_run_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.1, help="sampling period in seconds (dtprof run's default)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("a command to run is needed after --")
    with tempfile.TemporaryDirectory() as tmp:
        node = create_node_dir(create_run_dir(Path(tmp) / "run", {}), host="nvml-beside")
        sampler = NvmlSampler(node, interval_s=a.interval, host="nvml-beside")
        print(f"nvml_beside: sampler {sampler.start()}", file=sys.stderr)
        try:
            rc = subprocess.call(command)
        finally:
            print(f"nvml_beside: sampler stopped {sampler.stop()}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
