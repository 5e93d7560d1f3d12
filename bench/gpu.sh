#!/usr/bin/env bash
# Every GPU check of minscope in one go, on a CUDA machine with requirements.txt installed
# (and a CUDA build of torch):
#
#   1. the Triton kernels' tests, now compiled and run on the GPU (plus the CPU-side ones);
#   2. bench/logprobs.py at the reference shapes (N=16,384 x H=2,048 and 4,096 x 1,024,
#      bf16, V=151,936), with TRL and Liger when they are installed;
#   3. bench/memory.py: one Population Co-Training step at Qwen3-0.6B and 1.7B shapes,
#      with each memory feature turned off in turn, and a plain HF QLoRA step for contrast;
#   4. bench/tiles.py: the two fused GRPO kernels timed at 8 candidate tile configs each
#      (one 1,024-token chunk, Qwen3-1.7B head) against cuBLAS, to tune `tile_config`
#      (all candidates compile for sm_90 within its shared memory, checked on CPU).
#
# Usage:  bash bench/gpu.sh [OUT_DIR]        (default: runs/gpu-YYYYMMDD)
# Writes: gpu.txt (the GPU, driver, versions), tests.txt, logprobs.{md,json},
#         memory.{md,json}, tiles.{md,json}. Each step runs even if an earlier one failed; the exit status
#         is that of the first failure. About 10 minutes on an H100-class GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-$(date +%Y%m%d)}
mkdir -p "$out"
status=0
step() {   # step NAME FILE COMMAND...: run, show and keep its output, remember a failure
    local name=$1 file=$2
    shift 2
    echo "== $name"
    "$@" 2>&1 | tee "$out/$file"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!! $name failed (exit $rc)"
        [ "$status" -eq 0 ] && status=$rc
    fi
}

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
    python -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)"
} 2>&1 | tee "$out/gpu.txt"

step "Triton kernels and log-prob tests" tests.txt \
    python -m pytest -q -rs tests/test_triton_logprobs.py tests/test_logprobs.py
step "bench/logprobs.py" logprobs.md python bench/logprobs.py --device cuda --json "$out/logprobs.json"
step "bench/memory.py" memory.md python bench/memory.py --device cuda --json "$out/memory.json"
step "bench/tiles.py" tiles.md timeout 300 python bench/tiles.py --json "$out/tiles.json"
echo "results in $out"
exit $status
