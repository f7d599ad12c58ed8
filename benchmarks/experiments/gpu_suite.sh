#!/usr/bin/env bash
# The GPU tests and the step-time benchmarks in one device call (device time is scarce), in two
# lanes that fit the device's 600 s per call: on a 2-GPU machine (nvidia-h200-x2) `all` runs lane
# a on GPU 0 and lane b on GPU 1 side by side; on one GPU run `a` and `b` as two calls. `fsdp`
# (both GPUs) is the FSDP2 training run; `step` checks and times the fused optimizer step after a
# kernel change (one GPU); `defaults` times the activation recipes without tuning flags (one GPU);
# `fp8` times the FP8 recipes at the defaults and profiles CompiledActivations' kernels in them.
# Each step has a time limit; what finished is kept.
# Results: JSON per benchmark and one log, under $OUT (default ./gpu_out).
#
#     bash benchmarks/experiments/gpu_suite.sh all | a | b | step | defaults | fp8 | fsdp
set -u
LANE=${1:-all}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
source benchmarks/experiments/gpu_setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$OUT/log.txt"
TUNED=coordinate_descent_tuning=1

step() {  # step GPU SECONDS NAME CMD...: run CMD on GPU with a time limit, log under NAME
    local gpu=$1 limit=$2 name=$3
    shift 3
    local t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - t0)) s" >> "$OUT/$name.log"
    { echo; echo "######## $name"; cat "$OUT/$name.log"; } >> "$OUT/log.txt" && rm -f "$OUT/$name.log"
}

lane_a() {  # (H200 times in brackets)
    local g=$1
    step "$g" 280 gpu_tests python -m pytest -q -m gpu tests  # (~200 s)
    step "$g" 200 optimizer_step python benchmarks/optimizer_step.py --rounds 3 \
        --out "$OUT/optimizer_step.json"  # (3 rounds: 130 s; 5 ran past 150 s, torchao is slow)
    step "$g" 40 activation_kernels python benchmarks/experiments/activation_kernels.py \
        --out "$OUT/activation_kernels.json"  # (15 s)
}

lane_b() {
    local g=$1
    step "$g" 230 activation_memory_llama_tuned python benchmarks/activation_memory.py --arch llama \
        --cudagraphs --rounds 5 --steps 8 --inductor "$TUNED" \
        --variants "cudagraphs: none,cudagraphs: CompiledActivations" \
        --out "$OUT/activation_memory_llama_tuned.json"  # (GPT's: 182 s)
    step "$g" 330 fp8_linear_train_rounds_tuned python benchmarks/fp8_linear_train.py --rounds 5 \
        --steps 6 --inductor "$TUNED" --methods bf16,coatstate_compiled_ca,coatstate_compiled_graphs_all \
        --out "$OUT/fp8_linear_train_rounds_tuned.json"
}

lane_step() {  # the fused step after a kernel change: its GPU tests, then its time beside the peers
    local g=$1
    step "$g" 150 gpu_tests_step python -m pytest -q -m gpu tests/kernels/test_fp4_fused_step_gpu.py tests/kernels/test_triton_kernels.py \
        tests/optim/test_master_weights.py tests/optim/test_nonfinite.py
    step "$g" 420 whole_state_step python benchmarks/whole_state_step.py --rounds 3 \
        --which torch,flashoptim,torchao,coat --only "fp32 params,bf16 params,master 24,master_bits=24" \
        --configs 2x1r64,8x4,2x1r72,4x1r64,4x2r64,2x1 --out "$OUT/whole_state_step.json"
}

lane_defaults() {  # issue #34's figures at inductor's defaults (no tuning flags), 5 rounds each
    local g=$1 v="none,compress_activations,compiled: none,compiled: CompiledActivations"
    v="$v,cudagraphs: none,cudagraphs: CompiledActivations"
    step "$g" 240 activation_memory_gpt python benchmarks/activation_memory.py --arch gpt --cudagraphs \
        --rounds 5 --steps 8 --variants "$v" --out "$OUT/activation_memory.json"
    step "$g" 300 activation_memory_llama python benchmarks/activation_memory.py --arch llama --cudagraphs \
        --rounds 5 --steps 8 --variants "$v" --out "$OUT/activation_memory_llama.json"
}

lane_fp8() {  # the FP8 recipe the parity harness judged, beside its neighbours, at inductor's defaults
    local g=$1 m="bf16,coatstate_compiled,coatstate_compiled_graphs,coatstate_compiled_graphs_cg"
    step "$g" 300 fp8_linear_train_rounds python benchmarks/fp8_linear_train.py --rounds 5 --steps 6 \
        --methods "$m,coatstate_compiled_ca" --out "$OUT/fp8_linear_train_rounds.json"  # (137 s)
    step "$g" 120 kernel_breakdown_fp8_graphs python benchmarks/experiments/kernel_breakdown.py fp8 \
        --methods coatstate_compiled,coatstate_compiled_graphs --out "$OUT/kernel_breakdown_fp8_graphs.json"
}

case "$LANE" in
    all) lane_a 0 & lane_b 1 & wait ;;
    a) lane_a 0 ;;
    b) lane_b 0 ;;
    step) lane_step 0 ;;
    defaults) lane_defaults 0 ;;
    fp8) lane_fp8 0 ;;
    fsdp)
        step 0,1 110 fsdp_train torchrun --standalone --nproc-per-node 2 benchmarks/experiments/fsdp_train.py \
            --steps 6 --warmup 2 --out "$OUT/fsdp_train.json" ;;
    *) echo "usage: bash benchmarks/experiments/gpu_suite.sh all | a | b | step | defaults | fp8 | fsdp" >&2; exit 2 ;;
esac
grep -E "^== |passed|failed" "$OUT/log.txt"
