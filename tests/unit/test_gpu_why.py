"""Why is this GPU slow: GPU time by kernel class, launch gaps and the findings that name a cause and the gain of
its fix (docs/metrics.md "Why the GPU is slow"), on real kernel traces: our H200 DDP run (tests/data/gpu), the
HolisticTraceAnalysis traces recorded by others (the shared kineto data set) and the H100 run without a kernel
sample (the shared gpu-h100 data set; conftest.SHARED_DATA finds both)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from conftest import SHARED_DATA, TESTS, import_kineto
from dtprof.analyzers.kernels import kernel_class
from dtprof.cli import main

DATA = TESTS / "data/gpu"
SHARED = SHARED_DATA
needs_shared = pytest.mark.skipif(not SHARED.exists(), reason=f"shared data not found at {SHARED}")
GPU_RULES = ("gpu_elementwise", "gpu_launch_bound", "gpu_busy_slow", "low_mfu_no_kernel_sample")


def summary(run: Path, *args: str) -> dict:
    res = CliRunner().invoke(main, ["summary", str(run), "--json", "--no-write", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("why") / "ddp-h200"
    shutil.copytree(DATA / "ddp-h200", d)
    return d


def found(s: dict) -> dict:
    return {f["id"]: f for f in s["findings"] if f["id"] in GPU_RULES}


def test_kernel_classes_of_real_kernel_names():
    names = pd.Series([
        "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize256x128x8_stage3_warpsize4x2x1_ffma_aligna4_alignc4_execute",
        "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x256_8x4_nt_align1>(cutlass_80_simt_sgemm_128x256_8x4_nt)",
        "fmha_cutlassB_f32_aligned_128x64_k65536_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, float",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluBackwardCUDAKernelImpl(at::TensorIterator",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
        "Memcpy DtoD (Device -> Device)",
        "Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1_AFEM1_AFEM1_ASEM1_CLR1_CADS0",
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::detail",
    ])
    assert kernel_class(names).tolist() == ["matmul", "matmul", "attention", "elementwise_norm", "elementwise_norm",
                                            "communication", "memory", "matmul", "other"]


def test_fp32_job_at_good_mfu_gets_no_gpu_finding(ddp):
    # fp32 transformer on an H200, 63 % MFU against the fp32 peak it ran at: nothing to explain
    s = summary(ddp)
    assert s["mfu"]["value"] > 0.6 and not found(s)
    g = s["ranks"][0]["gpu_time"]
    cf = g["class_frac"]
    # one CUDA stream: the classes and the idle time tile the kernel time, and the computation classes are HTA's
    # computation
    assert g["window"]["streams"] == ["cuda:7"]
    assert sum(cf.values()) + g["idle_frac"] == pytest.approx(1, abs=1e-9)
    assert cf["matmul"] + cf["attention"] + cf["elementwise_norm"] + cf["other"] == pytest.approx(g["compute_frac"])
    assert cf["matmul"] > 0.7   # its top kernels are fp32 GEMMs
    assert g["kernels_per_step"] == 368 and 5e-6 < g["median_kernel_s"] < 20e-6
    # the GPU's launch gaps are its idle stretches the host was late for: HTA's host-wait share of the idle time
    assert g["launch_idle_frac"] == pytest.approx(g["idle_frac"] * g["idle_causes"]["host_wait"], rel=1e-6)


def test_busy_gpu_at_low_mfu_is_kernel_efficiency(ddp):
    # the same fp32 job judged against the bf16 peak (what an H200 offers with bf16): MFU 4 %, yet the GPU idles
    # 6 % of the time: the host is not the cause; the finding says so with an upper-bound gain of 1 - MFU. Its
    # elementwise and normalisation kernels (10 % of the GPU's time) are the fusion finding, with that gain
    s = summary(ddp, "--dtype", "bf16")
    mfu = s["mfu"]["value"]
    assert mfu < 0.05
    f = found(s)
    assert set(f) == {"gpu_busy_slow", "gpu_elementwise"}
    ev = f["gpu_busy_slow"]["evidence"]
    assert ev["saving_frac"] == pytest.approx(1 - mfu) and ev["saving_is_upper_bound"] is True
    assert "bf16" in f["gpu_busy_slow"]["recommendation"] and ev["derived"]
    ew = f["gpu_elementwise"]["evidence"]
    assert ew["saving_frac"] == s["gpu_time"]["class_frac"]["elementwise_norm"] and ew["saving_is_upper_bound"]
    assert "torch.compile" in f["gpu_elementwise"]["recommendation"]


@needs_shared
def test_hta_nccl_trace_is_launch_bound(tmp_path):
    # rank 0 of a 2-rank NCCL job recorded by others: HTA reads idle 77.78 % of the kernel time
    run = import_kineto(tmp_path / "nccl", SHARED / "kineto/nccl_single_rank.json.gz")
    s = summary(run)
    g = s["gpu_time"]
    assert 0.7 < g["idle_frac"] < 0.8 and g["launch_idle_frac"] <= g["idle_frac"]
    f = found(s)
    lb = f["gpu_launch_bound"]
    assert lb["evidence"]["saving_frac"] == g["launch_idle_frac"] > 0.7
    assert lb["evidence"]["saving_is_upper_bound"] is True and "MFU unknown" in lb["message"]
    assert "CUDA graphs" in lb["recommendation"]
    assert g["class_frac"]["communication"] == pytest.approx(g["comm_frac"])
    assert {k["class"] for k in s["kernels"][:3]} >= {"communication"}   # its NCCL all-reduce tops the list


@needs_shared
def test_low_mfu_without_a_kernel_sample_says_how_to_get_one():
    # the H100 GPT-2 run: MFU 8.9 %, recorded before the default kernel sample
    s = summary(SHARED / "gpu-h100/hf-gpt2-eager")
    assert s["gpu_time"] is None and s["mfu"]["value"] < 0.1
    f = found(s)
    assert set(f) == {"low_mfu_no_kernel_sample"} and "--trace-steps" in f["low_mfu_no_kernel_sample"]["recommendation"]
