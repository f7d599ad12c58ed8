#!/usr/bin/env bash
# Every GPU test and benchmark in one call on a 2-GPU H200 machine (the device tool's
# nvidia-h200-x2, carrying .whl/): device time is scarce, so the single-GPU work runs on GPU 0 and
# GPU 1 side by side, then the FSDP2 run takes both. Each step has a time limit; what finished is
# kept. Results: JSON per benchmark and one log, under $OUT (default ./gpu_out).
#
#     bash benchmarks/gpu_suite.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
source benchmarks/gpu_setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/log.txt"

step() {  # step GPU SECONDS NAME CMD...: run CMD on GPU with a time limit, log under NAME
    local gpu=$1 limit=$2 name=$3
    shift 3
    local t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s" >> "$OUT/$name.log"
}

(  # (times of the session-3 run in brackets; session 4's on one H200)
    step 0 200 gpu_tests python -m pytest -q -m gpu tests  # (111 s)
    step 0 140 optimizer_step python benchmarks/optimizer_step.py --out "$OUT/optimizer_step.json"
    step 0 45 activation_host python benchmarks/activation_host.py --device cuda \
        --out "$OUT/activation_host_cuda.json"
    step 0 200 activation_memory_llama python benchmarks/activation_memory.py --arch llama \
        --compiled --out "$OUT/activation_memory_llama.json"  # (~90 s)
) &
(
    step 1 150 activation_memory python benchmarks/activation_memory.py --compiled \
        --out "$OUT/activation_memory.json"  # (64 s)
    step 1 50 plan_check python benchmarks/plan_check.py --out "$OUT/plan_check.json"
    step 1 270 fp8_linear_train python benchmarks/fp8_linear_train.py --budget-s 150 \
        --out "$OUT/fp8_linear_train.json"  # (248 s with --budget-s 400)
) &
wait
step 0,1 110 fsdp_train torchrun --standalone --nproc-per-node 2 benchmarks/fsdp_train.py \
    --steps 6 --warmup 2 --out "$OUT/fsdp_train.json"

for f in gpu_tests optimizer_step activation_memory activation_memory_llama plan_check activation_host fp8_linear_train fsdp_train; do
    { echo; echo "######## $f"; cat "$OUT/$f.log"; } >> "$OUT/log.txt" && rm -f "$OUT/$f.log"
done
grep -E "^== |passed|failed" "$OUT/log.txt"
