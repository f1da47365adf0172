#!/usr/bin/env bash
# What one session on a lent GPU machine (the device tool: 16 cores, one H100/H200, ~15 minutes in all) runs, in
# one command, for docs/validation.md. Nothing is installed: the machine's python3 has torch (CUDA), numpy, pandas,
# pyarrow, click and nvidia-ml-py; dtprof runs from this checkout (its subpackages linked in as the installed
# package has them). Everything it writes goes to $OUT/device.tar.gz (the tool brings back few files).
#
#   CPU part, on cores 0-7: benchmarks/overhead.py's A/B runs of the four issue-14 jobs (DDP, FSDP2, a pipeline,
#     Lightning) on CPU/gloo, the four at once, each job pinned to two cores of its own (the two cores of the
#     machine the issue measured on, without the other tenants' load); GPU hidden (CUDA_VISIBLE_DEVICES="").
#   GPU part, on cores 8-15 at the same time, the steps GPU names, in this order:
#     cupti        benchmarks/cupti_linger.py: a kernel launch's host time before and after a trace, CUPTI left
#                  attached and torn down
#     tutorial     the DDP tutorial's shape on CUDA (examples/train_tiny.py: Linear(20, 1), batch 32, NCCL, one
#                  rank, 30 epochs of 64 steps), bare and under `dtprof run`, interleaved twice, then once under
#                  `dtprof run --full-detail`: the job's clock (rank 0's line at each epoch's end); TUTORIAL_RUNS
#                  ("bare dtprof bare dtprof full-detail"): the runs, in order (nosample: --no-kernel-sample;
#                  bare_timing: bare with TORCH_NCCL_ENABLE_TIMING=1, as dtprof run sets it; dtprof_notiming: dtprof
#                  run with it 0; nonvml: dtprof run --no-nvml; bare_nvml: bare beside dtprof's NVML sampler alone,
#                  benchmarks/nvml_beside.py; nvml_1s: dtprof run --nvml-interval 1)
#     hf-eager     the Hugging Face Trainer's GPT-2 124M (bf16, 8 x 1024 tokens) under `dtprof run` with its
#                  default kernel sample, 60 steps: the run comes back (runs/hf-eager)
#     hf-compiled  the same with torch_compile=True, HF_STEPS (150) steps, bare and under `dtprof run` in turn while the
#                  deadline allows (two pairs at least); the first dtprof run comes back (runs/hf-compiled)
#     ddp, fsdp2   dtprof run of a one-rank DDP job (NCCL, CUDA-event spans, NVML, a two-step torch.profiler trace)
#                  and of a one-rank FSDP2 job
#     calibrate    `dtprof calibrate`
#     ab           the A/B runs of the DDP job on the GPU (benchmarks/overhead.py --jobs ddp-gpu)
#   Each job's output is in log/; benchmarks/step_clock.py reads the job clocks out of them.
#
#   OUT=/tmp/out [CPU_JOBS="ddp fsdp2 pipeline lightning-wide"] [GPU="tutorial hf-eager hf-compiled"] [GPU_AB_JOBS=ddp-gpu,fsdp2-gpu] bash benchmarks/device_check.sh [CPU A/B seconds per job]
#       [GPU A/B seconds] [deadline seconds]
#
# CPU_JOBS names the CPU part's jobs, two cores each from core 0 (at most 8 with the GPU part off, 4 with it on;
# CPU_JOBS="": none). GPU names the GPU part's steps (GPU=none: no GPU part). Wheels in .whl/ (the device tool's way to bring a missing
# package: duckdb, which the image lacks) are installed first. Each job gets a port of its own (PET_MASTER_PORT):
# some torch versions' torchrun listens on 29500 for every one-node job, and jobs run side by side here.
#
# SMOKE=1 (a smoke run of the GPU part on a machine without one, with a stand-in nvidia-smi on the PATH): the same
# steps, a few seconds each (fewer steps, the HF job's tiny GPT-2).
#
# Every step's timeout ends by the deadline (default 480 s after the start), so the results are packed inside the
# device call's limit even when a step hangs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
CPU_AB_S=${1:-300}
GPU_AB_S=${2:-150}
DEADLINE=${3:-480}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/log"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
GPU=${GPU-tutorial hf-eager hf-compiled}
LINKED=()
for p in collectors analyzers reports; do [ -e "dtprof/$p" ] || { ln -s "../$p" "dtprof/$p" && LINKED+=("dtprof/$p"); }; done
# the links go when the script ends: left in a working checkout (a smoke run) they would be linted as a second copy
trap 'rm -f "${LINKED[@]}"' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=$(command -v "${PY:-python3}")
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# within S: S seconds, or what is left before the deadline if less (at least 1)
within() { local left=$(( DEADLINE - ($(date +%s) - T0) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
# pin CORES COMMAND...: on the cores named where the machine has 16 (a smoke run elsewhere runs unpinned)
pin() { if [ "$(nproc)" -ge 16 ] && command -v taskset >/dev/null; then taskset -c "$@"; else shift; "$@"; fi; }

{
  date -u; uname -a; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|MHz' || true
  nvidia-smi || true
  "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"cuda available", torch.cuda.is_available()); import torch.cuda.nccl as n; print("nccl", n.version())
if torch.cuda.is_available(): print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))' || true
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|lightning|pytorch-lightning|nvidia-ml-py|numpy|pandas|pyarrow|click|duckdb) ' || true
} > "$W/log/env.txt" 2>&1
stamp "env done"

cpu_job() {   # job cores port slot
  PET_MASTER_PORT=$3 CUDA_VISIBLE_DEVICES="" pin "$2" timeout "$(within $((CPU_AB_S + 150)))" "$PY" benchmarks/overhead.py --jobs "$1" \
    --rounds 1 --ab-runs 100 --ab-seconds "$CPU_AB_S" --hook-blocks 0 --keep-lines "$W/lines-$1-$4" \
    > "$W/log/ab-$1-$4.txt" 2>&1
  echo "exit $?" >> "$W/log/ab-$1-$4.txt"
}
i=0
for job in ${CPU_JOBS-ddp fsdp2 pipeline lightning-wide}; do   # a job may be named twice: more runs of it
  cpu_job "$job" "$((2 * i)),$((2 * i + 1))" "$((29510 + 10 * i))" "$i" &
  i=$((i + 1))
done

# clocked NAME SECONDS [dtprof run options --] JOB...: one timed run of a job, its output in log/NAME.txt
clocked() {
  local name=$1 s=$2; shift 2
  stamp "gpu $name"
  pin 8-15 timeout "$(within "$s")" "$@" > "$W/log/$name.txt" 2>&1; echo "exit $?" >> "$W/log/$name.txt"
}
gpu() {
  export CUDA_VISIBLE_DEVICES=0 PET_MASTER_PORT=29550
  local model=(--dim 1024 --layers 4 --seq 512 --batch 8 --vocab 8192)
  local torchrun=("$(dirname "$PY")/torchrun" --nproc_per_node=1) dtprof=("$PY" -m dtprof.cli run --no-report)
  mkdir -p "$W/runs"
  if [[ " $GPU " == *" cupti "* ]]; then
    clocked cupti 60 "$PY" benchmarks/cupti_linger.py
  fi
  if [[ " $GPU " == *" tutorial "* ]]; then
    local tiny=(examples/train_tiny.py --steps "$([ -n "${SMOKE:-}" ] && echo 256 || echo 1920)" --print-time
                --print-every 64) run n=0
    for run in ${TUTORIAL_RUNS:-bare dtprof bare dtprof full-detail}; do
      n=$((n + 1))
      case $run in
        bare) clocked "tutorial-bare-$n" 90 "${torchrun[@]}" "${tiny[@]}" ;;
        bare_timing) TORCH_NCCL_ENABLE_TIMING=1 clocked "tutorial-bare_timing-$n" 90 "${torchrun[@]}" "${tiny[@]}" ;;
        dtprof_notiming) TORCH_NCCL_ENABLE_TIMING=0 clocked "tutorial-dtprof_notiming-$n" 90 "${dtprof[@]}" \
          --out "$W/runs/tutorial-notiming-$n" -- "${torchrun[@]}" "${tiny[@]}" ;;
        dtprof) clocked "tutorial-dtprof-$n" 90 "${dtprof[@]}" --out "$W/runs/tutorial-$n" -- "${torchrun[@]}" "${tiny[@]}" ;;
        nonvml) clocked "tutorial-nonvml-$n" 90 "${dtprof[@]}" --no-nvml --out "$W/runs/tutorial-nonvml-$n" \
          -- "${torchrun[@]}" "${tiny[@]}" ;;
        bare_nvml) clocked "tutorial-bare_nvml-$n" 90 "$PY" benchmarks/nvml_beside.py -- "${torchrun[@]}" "${tiny[@]}" ;;
        nvml_1s) clocked "tutorial-nvml_1s-$n" 90 "${dtprof[@]}" --nvml-interval 1 --out "$W/runs/tutorial-nvml_1s-$n" \
          -- "${torchrun[@]}" "${tiny[@]}" ;;
        nosample) clocked "tutorial-nosample-$n" 90 "${dtprof[@]}" --no-kernel-sample --out "$W/runs/tutorial-nosample-$n" \
          -- "${torchrun[@]}" "${tiny[@]}" ;;
        full-detail) clocked "tutorial-full-detail-$n" 90 "${dtprof[@]}" --full-detail --out "$W/runs/tutorial-full-$n" \
          -- "${torchrun[@]}" "${tiny[@]}" ;;
      esac
    done
  fi
  local hf=(examples/frameworks/train_hf_trainer.py --print-time) hf_steps=(60 "${HF_STEPS:-150}")
  if [ -n "${SMOKE:-}" ]; then hf_steps=(14 14); else hf+=(--gpt2-124m); fi
  if [[ " $GPU " == *" hf-eager "* ]]; then
    clocked hf-eager-dtprof 150 "${dtprof[@]}" --out "$W/runs/hf-eager" -- "${torchrun[@]}" "${hf[@]}" --steps "${hf_steps[0]}"
  fi
  if [[ " $GPU " == *" hf-compiled "* ]]; then
    local i=1
    # the first bare run compiles cold; the runs after it read Inductor's cache, as a user's second run does
    while (( i <= 2 || $(within 999) > 120 )) && (( i <= 4 )); do
      clocked "hf-compiled-bare-$i" 240 "${torchrun[@]}" "${hf[@]}" --steps "${hf_steps[1]}" --compile
      clocked "hf-compiled-dtprof-$i" 240 "${dtprof[@]}" --out "$W/runs/hf-compiled-$i" -- "${torchrun[@]}" "${hf[@]}" \
        --steps "${hf_steps[1]}" --compile
      i=$((i + 1))
    done
  fi
  if [[ " $GPU " == *" ddp "* ]]; then
    stamp "gpu ddp run"
    pin 8-15 timeout "$(within 150)" "$PY" -m dtprof.cli run --out "$W/gpu-ddp" --no-report --dtype fp32 --trace-steps 10:12 \
      -- "$(dirname "$PY")/torchrun" --nproc_per_node=1 examples/train_ddp.py "${model[@]}" --steps 40 \
      > "$W/log/gpu-ddp.txt" 2>&1; echo "exit $?" >> "$W/log/gpu-ddp.txt"
  fi
  if [[ " $GPU " == *" fsdp2 "* ]]; then
    stamp "gpu fsdp2 run"
    pin 8-15 timeout "$(within 120)" "$PY" -m dtprof.cli run --out "$W/gpu-fsdp2" --no-report --dtype fp32 \
      -- "$(dirname "$PY")/torchrun" --nproc_per_node=1 examples/train_fsdp.py "${model[@]}" --steps 30 \
      > "$W/log/gpu-fsdp2.txt" 2>&1; echo "exit $?" >> "$W/log/gpu-fsdp2.txt"
  fi
  if [[ " $GPU " == *" calibrate "* ]]; then
    stamp "gpu calibrate"
    HOME=$W timeout "$(within 60)" "$PY" -m dtprof.cli calibrate > "$W/log/calibrate.txt" 2>&1; echo "exit $?" >> "$W/log/calibrate.txt"
  fi
  if [[ " $GPU " == *" ab "* ]]; then
    stamp "gpu A/B"
    pin 8-15 timeout "$(within $((GPU_AB_S + 150)))" "$PY" benchmarks/overhead.py --jobs "${GPU_AB_JOBS:-ddp-gpu}" --rounds 1 --ab-runs 100 \
      --ab-seconds "$GPU_AB_S" --hook-blocks 0 --keep-lines "$W/lines-gpu" > "$W/log/ab-gpu.txt" 2>&1
    echo "exit $?" >> "$W/log/ab-gpu.txt"
  fi
  stamp "gpu done"
}
if [ "$GPU" != none ] && nvidia-smi -L >/dev/null 2>&1; then gpu > "$W/log/gpu-steps.txt" 2>&1 & fi
# what is there so far, packed every minute: if the call is cut short (its limit shrinks when the machine's start
# took long), the last pack still comes back
pack() { tar -C "$W" -czf "$OUT/.device.tar.gz" . 2>/dev/null && mv "$OUT/.device.tar.gz" "$OUT/device.tar.gz"; }
( while sleep 60; do pack; done ) & PACKER=$!
RUNNING=$(jobs -p | grep -vx "$PACKER")
[ -z "$RUNNING" ] || wait $RUNNING      # a bare wait would wait for the packer too, which never ends
# the packer's sleep would outlive it and hold the call's output open for up to a minute of device time
kill -STOP "$PACKER"; pkill -P "$PACKER"; kill -KILL "$PACKER"
stamp "all done" >> "$W/log/env.txt"
pack && ls -la "$OUT"
