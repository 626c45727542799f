#!/usr/bin/env bash
# The addition job's GPU recipe on one CUDA GPU, timed from nothing (the data prepared too), then its
# two energies on the selection split (the check that the recipe buys what the CPU recipe buys:
# docs/addition.md, "On a GPU"). OUT gets summary.txt, the GPU's utilization every 0.5 s and
# run.tar.gz (the run's JSON, tables and logs; no checkpoints).
#     bash job/gpu_addition.sh [OUT [JOBS]]      # default out/gpu_addition, 6; JOB_LIMIT=480 s
#     SELECT_EVAL= bash job/gpu_addition.sh     # the job alone, no selection-split scoring
#     JOB_FLAGS=--deterministic bash job/gpu_addition.sh   # more flags of job.reproduce
#     JOB_FLAGS=--compile bash job/gpu_addition.sh         # the trainers' models under torch.compile
#     GRAPHS= bash job/gpu_addition.sh          # no CUDA-graph bench of the LM's and BALM's step after
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-out/gpu_addition}"
jobs="${2:-6}"
run=out-addition-gpu
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU: this check is for a GPU machine"
print("torch", torch.__version__, torch.cuda.get_device_name(0), "cpus", __import__("os").cpu_count())'
} 2>&1 | tee "$out/summary.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
data=data/addition_gpu  # its own problems (the job's, drawn again): a user's data/addition is left alone
rm -rf "$data" "$run"  # from nothing, as a new user
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 \
    > "$out/gpu_utilization.csv" 2>&1 &
smi=$!
t0=$(date +%s.%N)
timeout "${JOB_LIMIT:-480}" python3 -m job.reproduce --data addition --recipe gpu --jobs "$jobs" --quiet \
    --out_dir "$run" --data_dir "$data" ${JOB_FLAGS-} > "$out/job.log" 2>&1
rc=$?
t1=$(date +%s.%N)
kill $smi
echo "job: exit $rc, wall $(python3 -c "print(f'{$t1 - $t0:.1f}')") s (--jobs $jobs)" | tee -a "$out/summary.txt"
tail -n 40 "$out/job.log"
python3 - "$out/gpu_utilization.csv" <<'EOF' | tee -a "$out/summary.txt"
import sys
u = [int(l.split(',')[1].split()[0]) for l in open(sys.argv[1]) if l.count(',') == 2 and '%' in l]
print(f"GPU utilization over the job: mean {sum(u) / max(len(u), 1):.1f}% of {len(u)} readings every 0.5 s, "
      f"busy (> 0%) in {sum(x > 0 for x in u) / max(len(u), 1):.0%}")
EOF
for e in ${SELECT_EVAL-bit unit}; do  # the energies on 1,000 selection problems (docs/addition.md)
    [ -f "$run/$e/best.pt" ] || continue
    timeout 45 python3 -m extensions.addition_eval --lm "$run/lm/best.pt" --energy "$run/$e/best.pt" \
        --split select --ns 64 --beam 8 --quiet --out "$run/select_$e.json" > "$run/select_$e.log" 2>&1
    echo "select $e: exit $?" | tee -a "$out/summary.txt"
    grep -E "greedy|Algorithm 1|joint mode" "$run/select_$e.txt" | tee -a "$out/summary.txt"
done
for model in ${GRAPHS-lm:96 balm:144}; do  # the LMs' step eager vs CUDA graphs (job.bench's graphs section)
    name=${model%:*}
    timeout 240 python3 -m job.bench --device cuda --sections graphs --quiet --data_dir "$data" --n_layer 3 \
        --n_head 3 --n_embd "${model#*:}" --energy_embd 96 --block_size 66 --batch_size 32 --prefix_len 14 \
        --gen_len 8 --out "$out/graphs_$name.json" > /dev/null 2> "$out/graphs_$name.log"
    echo "graphs $name: exit $?" | tee -a "$out/summary.txt"
    python3 -c 'import json, sys; print({k: round(v, 4) if isinstance(v, float) else v
                for k, v in json.load(open(sys.argv[1])).items() if k.startswith("graphs_")})' \
        "$out/graphs_$name.json" 2>&1 | tee -a "$out/summary.txt"
done
tar czf "$out/run.tar.gz" --exclude='*.pt' --exclude='*.bin' "$run"
