#!/usr/bin/env bash
# What only a GPU can check, in one go on a machine with one CUDA GPU and this repo's requirements
# installed (about 8 minutes on one H100; a GPU is not needed by any test):
#   1. the quick main job on the GPU (--dtype auto: bf16 from compute capability 8.0);
#   2. 2 processes (torchrun) on the one GPU, gloo with CUDA tensors (NCCL wants a GPU per rank):
#      train_lm.py, nce_train.py and negatives.py give one process's numbers, and every tensor a
#      collective is handed is on the GPU, as NCCL requires; fp16 + GradScaler with a forced
#      overflow: the step is skipped and --resume goes on exactly (the tests' REBM_TEST_DEVICE=cuda);
#   3. the main job's stage times (timings.json), as far as the time left allows (it resumes).
#     bash job/gpu_check.sh [OUT [SECONDS_FOR_THE_MAIN_JOB]]      # default out/gpu_check, 240
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/gpu_check}"
main_s="${2:-240}"
mkdir -p "$out"
python - <<'PY' | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), 'no CUDA GPU: this check is for a GPU machine'
print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
step() {  # name, seconds, command...: runs it, logs to $out/name.log, prints its status and time
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s (log: $out/$name.log)"
    tail -n 3 "$out/$name.log"
}
step quick 300 python job/reproduce.py --quick --quiet --out_dir "$out/quick"
step multi_gpu_and_fp16 300 env REBM_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider test_all.py \
    -k "ddp or fp16_scaler or negatives_under_ddp"
step main_job "$main_s" python job/reproduce.py --quiet --out_dir "$out/main"
cat "$out/quick/timings.json" "$out/main/timings.json" 2>/dev/null
