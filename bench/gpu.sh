#!/usr/bin/env bash
# Every GPU check of minscope in one go, on a CUDA machine with requirements.txt installed
# (and a CUDA build of torch), inside a time budget:
#
#   0. bench/laptop.py: the README's laptop commands (numbers on Qwen3-0.6B, then P4G Population
#      Co-Training with a 4-bit simulator population), each with its peak GPU memory and step
#      time; a command that runs out of memory prints the flag to lower (LAPTOP_POLICY: the model,
#      default Qwen/Qwen3-0.6B, a local folder on an offline machine);
#   1. the Triton kernels' tests: the numeric checks on the compiled kernels on the GPU,
#      the ahead-of-time compile checks, and the log-prob tests;
#   2. bench/logprobs.py at the reference shapes (N=16,384 x H=2,048 and 4,096 x 1,024,
#      bf16, V=151,936): minscope's triton and cublas paths, forward + backward and forward
#      only, against cuBLAS's bounds, the naive path, TRL's ChunkedLogProbFunction and Liger's
#      LigerFusedLinearGRPOLoss (a peer that does not import gets a row saying why);
#   3. bench/memory.py: one Population Co-Training step at Qwen3-1.7B then 0.6B shapes, the
#      target configuration first, then a plain HF QLoRA step for contrast, then each
#      memory feature turned off in turn;
#   4. bench/tiles.py: the two fused GRPO kernels timed at 8 candidate tile configs each
#      (one 1,024-token chunk, Qwen3-1.7B head) against cuBLAS, to tune `tile_config`;
#   5. bench/step.py: one Population Co-Training step (rollout + update) at the Qwen3-1.7B
#      shape, 4-bit, batch 32, 10+10 turns of 85 tokens, with the kept KV cache and with
#      re-prefilling every turn (run second: it has never been measured on a GPU; the
#      memory step, already measured, takes what is left).
#
# Usage:  bash bench/gpu.sh [OUT_DIR]        (default: runs/gpu-YYYYMMDD)
#   The big-card checks are sized to the card: below 20 GB of GPU memory bench/step.py and
#   bench/memory.py run at the Qwen3-0.6B shape only (1.7B at batch 32 needs more).
#   GPU_STEPS     which steps, comma-separated (default laptop,tests,step,logprobs,memory,tiles);
#                 e.g. GPU_STEPS=tests,logprobs for the log-prob kernels alone.
#   LOGPROBS_CAP_S  the log-prob step's cap (default 180 s; give it ~400 when it runs alone).
#   GPU_BUDGET_S  seconds for all six steps (default 540, so that one run fits a
#                 10-minute command with room to start); each step gets at most its own
#                 cap and what is left; the benchmarks save their JSON after every
#                 measurement, so a step cut short keeps what it measured.
#   PYTHON        the interpreter (default python3).
#   .whl/*.whl    wheels installed first, one by one with --no-deps, if present: TRL,
#                 liger-kernel and TRL's small dependencies (datasets, dill, multiprocess,
#                 xxhash; a wheel for another Python version is skipped), bitsandbytes on a
#                 machine without it (without it every 4-bit configuration is skipped).
# Writes 12 files: gpu.txt (the GPU, driver, versions), laptop.{md,json}, tests.txt, tiles.{md,json},
# logprobs.{md,json}, memory.{md,json}, step.{md,json}. Each step runs even if an earlier one failed; the
# exit status is that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-$(date +%Y%m%d)}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${GPU_BUDGET_S:-540} ))
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
    # one at a time: a wheel built for another Python version fails alone, not the whole lot
    for whl in .whl/*.whl; do
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/minscope-site "$whl" >/dev/null 2>&1 \
            && echo "installed $(basename "$whl")" || echo "skipped $(basename "$whl") (not for this Python)"
    done
    export PYTHONPATH=/tmp/minscope-site${PYTHONPATH:+:$PYTHONPATH}
fi
steps=",${GPU_STEPS:-laptop,tests,step,logprobs,memory,tiles},"
# the card's memory in MiB (0 if nvidia-smi cannot say): below 20 GB the big shapes are left out
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1 | tr -dc '0-9')
mib=${mib:-0}
if [ "$mib" -ge 20000 ]; then step_shapes=1.7b; memory_shapes=1.7b,0.6b; else step_shapes=0.6b; memory_shapes=0.6b; fi
echo "GPU memory: ${mib} MiB; bench/step.py at $step_shapes, bench/memory.py at $memory_shapes"

step() {   # step KEY NAME FILE CAP_SECONDS COMMAND...: run within min(CAP, time left), keep its output
    local key=$1 name=$2 file=$3 cap=$4
    shift 4
    case "$steps" in *",$key,"*) ;; *) return ;; esac
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -lt "$cap" ] && cap=$left
    echo "== $name (at most ${cap} s): $*"
    if [ "$cap" -le 5 ]; then
        echo "!! $name skipped: the time budget is spent" | tee "$out/$file"
        [ "$status" -eq 0 ] && status=124
        return
    fi
    timeout "$cap" "$@" 2>&1 | tee "$out/$file"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ', out of time'))" | tee -a "$out/$file"
        [ "$status" -eq 0 ] && status=$rc
    fi
}

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import sys, torch, triton, transformers, peft; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
    "$PY" -c "
from importlib import metadata
for d in ('trl', 'liger-kernel', 'datasets', 'pyarrow'):
    try: print(d, metadata.version(d))
    except metadata.PackageNotFoundError: print(d, 'missing')" | paste -sd' ' -
    "$PY" -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" \
        || echo "bitsandbytes missing: the 4-bit configurations of bench/memory.py will be skipped"
} 2>&1 | tee "$out/gpu.txt"

step laptop "bench/laptop.py (the README's laptop commands)" laptop.md 240 \
    "$PY" bench/laptop.py --policy "${LAPTOP_POLICY:-Qwen/Qwen3-0.6B}" --json "$out/laptop.json"
step tests "Triton kernels and log-prob tests" tests.txt 120 \
    "$PY" -m pytest -q -rs tests/test_triton_logprobs.py tests/test_cublas_logprobs.py tests/test_logprobs.py
step step "bench/step.py" step.md 200 \
    "$PY" bench/step.py --device cuda --shapes "$step_shapes" --load-in-4bit --methods population --json "$out/step.json"
step logprobs "bench/logprobs.py" logprobs.md "${LOGPROBS_CAP_S:-180}" \
    "$PY" bench/logprobs.py --device cuda --timeout 90 --json "$out/logprobs.json"
# The memory step leaves 60 s for the tile sweep; its configurations run target-first.
step memory "bench/memory.py" memory.md $(( deadline - $(date +%s) - 60 )) \
    "$PY" bench/memory.py --device cuda --shapes "$memory_shapes" --repeats 1 --timeout 120 --json "$out/memory.json" \
    --configs all,hf-qlora,naive-logprobs,bf16-base,no-checkpointing,no-micro-batching
step tiles "bench/tiles.py" tiles.md 120 "$PY" bench/tiles.py --json "$out/tiles.json"
echo "results in $out"
exit $status
