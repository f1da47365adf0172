"""The ZeRO one-bucket what-if (analyzers/zero_bucket.py): where it is offered. Its prediction is checked against a
real alternating job in tests/jobs/test_deepspeed.py; here only what a GPU run (which this machine cannot record)
and runs without ZeRO-1/2 get."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from dtprof.analyzers import zero_bucket


def model_with(*stages: int) -> SimpleNamespace:
    meta = pd.DataFrame({"kind": ["deepspeed_zero"] * len(stages) + ["mesh"],
                         "value": [{"stage": s, "reduce_bucket_size": 4096, "overlap_comm": False,
                                    "contiguous_gradients": True, "step": 0} for s in stages] + [{"shape": [2]}]})
    return SimpleNamespace(meta=meta)


def test_gpu_zero2_run_is_told_why_there_is_no_one_bucket_prediction():
    entry, skipped = zero_bucket.what_if(model_with(2), on_gpu=True, measured_step_s=0.1)
    assert entry is None
    assert skipped["scenario"] == "zero_one_bucket" and "overlap_comm" in skipped["reason"], skipped


def test_runs_without_zero_1_or_2_get_nothing():
    assert zero_bucket.what_if(model_with(3), on_gpu=False, measured_step_s=0.1) == (None, None)
    assert zero_bucket.what_if(model_with(), on_gpu=False, measured_step_s=0.1) == (None, None)
    assert zero_bucket.zero_stages(model_with(1, 2).meta) == {1, 2}


def test_zero2_reduces_once_per_micro_batch_whatever_the_bucket():
    """ZeRO-2 reduces after each micro-batch's backward, ZeRO-1 once a step: with 4 micro-batches a ZeRO-2 step has
    at least 4 flushes at any bucket size, so only more than 4 leave something to merge."""
    meta = model_with(2).meta
    meta.loc[0, "value"]["gradient_accumulation_steps"] = 4
    assert zero_bucket.reduction_rounds(meta) == 4
    meta.loc[0, "value"]["stage"] = 1
    assert zero_bucket.reduction_rounds(meta) == 1
    assert zero_bucket.reduction_rounds(model_with(2).meta) == 1    # a run recorded before the key: one round
