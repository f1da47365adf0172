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
GPU_RULES = ("gpu_elementwise", "gpu_misaligned_matmul", "gpu_launch_bound", "gpu_busy_slow",
             "low_mfu_no_kernel_sample")


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


# The HF Trainer's GPT-2 124M (bf16, 8 x 1024 tokens) on an H100 under `dtprof run` with its default kernel sample,
# eager and torch_compile=True (tests/data/gpu/README.md)
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict:
    out = {}
    for mode in ("eager", "compiled"):
        d = tmp_path_factory.mktemp("gpt2") / mode
        shutil.copytree(DATA / f"hf-gpt2-{mode}-h100", d)
        out[mode] = summary(d)
    return out


def test_eager_gpt2_on_an_h100_says_why_its_mfu_is_low(gpt2):
    s = gpt2["eager"]
    assert s["mfu"]["value"] < 0.1
    f = found(s)
    assert set(f) == {"gpu_elementwise", "gpu_misaligned_matmul", "gpu_launch_bound"}
    # half of the GPU's time is unfused elementwise/normalisation work: what compiling would fuse, at most
    ew = f["gpu_elementwise"]["evidence"]
    assert ew["saving_frac"] == s["gpu_time"]["class_frac"]["elementwise_norm"] > 0.5
    assert ew["saving_is_upper_bound"] and "torch.compile" in f["gpu_elementwise"]["recommendation"]
    lb = f["gpu_launch_bound"]["evidence"]
    assert lb["saving_frac"] == s["gpu_time"]["launch_idle_step_frac"] and lb["saving_is_upper_bound"]


def test_compiled_gpt2_shows_the_fusion(gpt2):
    eager, compiled = (gpt2[m]["gpu_time"] for m in ("eager", "compiled"))
    # Inductor fused the elementwise chains: fewer kernels a step, and a far smaller share of elementwise work
    assert compiled["kernels_per_step"] < 0.7 * eager["kernels_per_step"]
    assert compiled["class_frac"]["elementwise_norm"] < 0.5 * eager["class_frac"]["elementwise_norm"]
    assert gpt2["compiled"]["mfu"]["value"] > 1.5 * gpt2["eager"]["mfu"]["value"]


def test_an_ordinary_steps_launch_gaps_are_bounded_by_its_idle_time(gpt2):
    # The compiled job's traced steps ran ~52 ms against ~41 ms ordinary steps: the profiler slowed the host, and
    # their launch gaps (41 % of their GPU time) overstate an ordinary step's. Kernel durations do not change, so an
    # ordinary step idles at most its time less the kernels' busy time per traced step.
    s = gpt2["compiled"]
    g = s["ranks"][0]["gpu_time"]
    busy_per_step = g["kernel_time_s"] * (1 - g["idle_frac"]) / len(g["window"]["steps"])
    typical = s["steps"]["time_s"]["p50"]       # one rank: the job's step is the rank's
    assert g["typical_step_s"] == pytest.approx(typical)
    assert g["step_idle_frac"] == pytest.approx(1 - busy_per_step / typical)
    assert g["launch_idle_step_frac"] <= g["step_idle_frac"] < g["launch_idle_frac"] - 0.1
    lb = found(s)["gpu_launch_bound"]
    assert lb["evidence"]["saving_frac"] == pytest.approx(g["step_idle_frac"])   # the cap is what binds here
    assert "the traced steps, which the profiler slows, idle 41%" in lb["message"]


def test_the_hf_kernel_trace_imports_as_the_run_read_it(tmp_path, gpt2):
    # the same capture's torch.profiler trace through `dtprof import kineto`: the same kernels, the same classes
    run = import_kineto(tmp_path / "imported", DATA / "hf-gpt2-compiled-h100-trace-steps-10-11.json.gz")
    imported, recorded = summary(run)["gpu_time"], gpt2["compiled"]["gpu_time"]
    assert imported["kernels_per_step"] == recorded["kernels_per_step"] == 715
    for c, v in recorded["class_frac"].items():
        assert imported["class_frac"][c] == pytest.approx(v, abs=1e-9), c


def test_the_launch_findings_evidence_reads_in_its_units(gpt2):
    # a count per step is a count (it once read "715 s"), a time per step a time
    from dtprof.reports.fmt import fmt_evidence

    text = fmt_evidence(found(gpt2["compiled"])["gpu_launch_bound"]["evidence"])
    assert "kernels_per_step 715 ·" in text and "median_kernel_s 12 µs" in text
    assert "launch_idle_step_frac 28.1 %" in text
    # the CPU-contention finding's per-step times (its s_per_step once read "0.5183")
    assert fmt_evidence({"s_per_step": 0.5183, "worst_s_per_step": 0.5194}) == \
        "s_per_step 518.3 ms · worst_s_per_step 519.4 ms"


def test_the_gpu_idle_card_bounds_an_ordinary_step(gpt2):
    from dtprof.reports.html import gpu_card_subs

    sub = gpu_card_subs(gpt2["compiled"])["gpu_idle"]
    assert "an ordinary step, which the profiler did not slow: at most 28.1 %" in sub


def test_two_identical_gpu_runs_compare_as_pass(tmp_path):
    # the compiled GPT-2 recorded twice on one H100, one after the other: the steps agree (-3 %), the GPU probe did
    # not move, the CPU probe ran 49 % slower after the second job (CPU jobs ran on the machine's other cores). The
    # GPU is busy ~73 % of an ordinary step, so both probes count; a slower CPU could only have slowed the head
    base, head = (tmp_path / n for n in ("base", "head"))
    shutil.copytree(DATA / "hf-gpt2-compiled-h100", base)
    shutil.copytree(DATA / "hf-gpt2-compiled-h100-2", head)
    res = CliRunner().invoke(main, ["compare", str(base), "--head", str(head), "--format", "json"])
    d = json.loads(res.stdout)           # stderr says each run was analysed afresh
    assert res.exit_code == 0, d["outcome"]
    assert d["bound"]["device"] == "both" and "an ordinary step" in d["bound"]["why"]
    assert d["probe"]["moved"] and d["probe"]["ratio"] > 1.2 and d["probe"]["explains_verdict"] is False
    assert not d["gpu_probe"]["moved"]


def test_matmuls_on_gpt2s_unaligned_vocabulary_are_named(gpt2, ddp):
    # GPT-2's vocabulary (50,257) is no multiple of 8: the LM head's three GEMMs ran on CUTLASS tensor-core kernels
    # built for 1-element alignment (cutlass_75_tensorop_bf16_s1688gemm_..._align1), a fifth of the eager GPU time;
    # Inductor pads two of them, and the compiled run keeps one
    from dtprof.analyzers.kernels import misaligned_matmul

    eager, compiled = (gpt2[m] for m in ("eager", "compiled"))
    mis = found(eager)["gpu_misaligned_matmul"]
    ev = mis["evidence"]
    assert ev["saving_frac"] == eager["gpu_time"]["misaligned_matmul_frac"] and 0.15 < ev["saving_frac"] < 0.3
    assert ev["saving_is_upper_bound"] is True and "50,304" in mis["recommendation"]
    assert 0.05 < compiled["gpu_time"]["misaligned_matmul_frac"] < 0.5 * ev["saving_frac"]
    top = [k["name"] for k in eager["kernels"][:3]]
    assert misaligned_matmul(pd.Series(top)).sum() == 2          # two of the top three kernels
    # the fp32 DDP job's SIMT GEMMs say align1 whatever the shapes (its dimensions are multiples of 1,024): not
    # counted
    s = summary(ddp)
    assert s["gpu_time"]["misaligned_matmul_frac"] == 0 and "gpu_misaligned_matmul" not in found(s)
    assert any("simt_sgemm" in k["name"] and "align1" in k["name"] for k in s["kernels"])
