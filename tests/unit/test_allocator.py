"""dtprof's command processes keep the memory they free for their next arrays (dtprof/allocator.py): a large array
freed stays in the process instead of going back to the kernel, to be faulted in and zeroed again."""
import subprocess
import sys

import pytest

PROBE = """
import os, sys
import numpy as np
if sys.argv[1] == "cli":   # a dtprof command, as a user runs one
    from click.testing import CliRunner
    from dtprof.cli import main
    assert CliRunner().invoke(main, ["summary", "--help"]).exit_code == 0
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
a = np.ones(1 << 25)   # 256 MiB, touched
held = rss()
del a
print(held, rss())
"""


def _rss_before_and_after_free(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    held, freed = map(int, out.stdout.split())
    return held, freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_a_dtprof_command_keeps_a_freed_array_for_reuse():
    held, freed = _rss_before_and_after_free("plain")
    assert freed < held - 200 * 2**20, (held, freed)   # a plain process gives the 256 MiB back at once
    held, freed = _rss_before_and_after_free("cli")
    assert freed > held - 16 * 2**20, (held, freed)    # a dtprof command keeps it
