#!/usr/bin/env bash
# What only a GPU can check, in one go on a machine with one CUDA GPU and this repo's requirements
# installed (a GPU is not needed by any test). In order, each with its share of SECONDS:
#   1. 2 processes (torchrun) on the one GPU, gloo with CUDA tensors (NCCL wants a GPU per rank):
#      train_lm.py, nce_train.py, negatives.py and estimate_ppl.py give one process's numbers, and
#      every tensor a collective is handed is on the GPU, as NCCL requires; fp16 + GradScaler with a
#      forced overflow: the step is skipped and --resume goes on exactly (the tests with
#      REBM_TEST_DEVICE=cuda); and the tests a first run on an H100 found failing there (resume with
#      dropout, the metric energy);
#   2. the quick main job on the GPU (--dtype auto: bf16 from compute capability 8.0);
#   3. the main job's stage times, as far as the time left allows (rerun: it resumes).
# OUT gets a few flat files (summary.txt, the logs, each job's timings.json); the jobs' folders are
# out/gpu_quick and out/gpu_main.
#     bash job/gpu_check.sh [OUT [SECONDS]]      # default out/gpu_check, 500
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/gpu_check}"
budget="${2:-500}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU: this check is for a GPU machine"
print("torch", torch.__version__, torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))'
} 2>&1 | tee "$out/summary.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
step() {  # name, seconds, command...: runs it within its seconds (and the budget), logs to $out/name.log
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    local left=$((budget - SECONDS - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -le 0 ] && { echo "$name: not run, no time left" | tee -a "$out/summary.txt"; return; }
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/summary.txt"
    tail -n 3 "$out/$name.log"
}
step multi_gpu_and_fp16 150 env REBM_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider test_all.py tests \
    -k "ddp or fp16_scaler or resume_is_exact or tailr_fine_tuning or metric_ebm or metric_energy" --durations=0
step quick 150 python -m job.reproduce --quick --quiet --out_dir out/gpu_quick
cp out/gpu_quick/timings.json "$out/quick_timings.json" 2>/dev/null
step main_job "$budget" python -m job.reproduce --quiet --out_dir out/gpu_main
cp out/gpu_main/timings.json "$out/main_timings.json" 2>/dev/null
cat "$out"/*timings.json 2>/dev/null
