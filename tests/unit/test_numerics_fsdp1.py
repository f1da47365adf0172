"""The numerics part wraps FSDP1's own ``FullyShardedDataParallel.clip_grad_norm_`` whether the job imported FSDP
before the rank started recording or after (collectors/numerics_wraps.py, ``patch_fsdp1``), and puts the method back at
exit. In a fresh interpreter: this one may have imported FSDP already. (The norm it reads is checked on a real
FSDP1 job: tests/jobs/test_numerics.py.)"""
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch
from dtprof.collectors.numerics import NumericsSentinel
from dtprof.collectors.parts import RankContext

if {early}:
    import torch.distributed.fsdp
assert ("torch.distributed.fsdp" in sys.modules) == {early}
ctx = RankContext(0, "host", ".", {{}}, add=None, fault=None, event=None, meta=None)
part = NumericsSentinel()
part.install(ctx)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
print("wrapped", getattr(FSDP.clip_grad_norm_, "dtprof_numerics", False))
part.on_exit()
print("restored", not hasattr(FSDP.clip_grad_norm_, "dtprof_numerics"))
"""


@pytest.mark.parametrize("early", [True, False])
def test_fsdp1_clip_method_is_wrapped_whenever_fsdp_is_imported(early):
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(early=early)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["wrapped", "True", "restored", "True"]
