"""The demo: `prove-jax demo` completes HumanEval prompts with the shipped proposer/verifier.

It decodes the same prompts with greedy AR, ProVe-lossless, MARS threshold and ProVe with the
verifier (batch 1), prints tokens per forward, throughput, speedup and agreement with AR, and
shows one lossless completion with the tokens of each proposer forward marked (alternating
colours on a terminal, `[...]` otherwise). `prove-jax benchmark` is the full measurement.
"""

from __future__ import annotations

import argparse
import sys

import jax

from prove_jax.errors import ProveJaxError
from prove_jax import assets
from prove_jax.cli.runner import run_cli
from prove_jax.evaluation import benchmark as bench_lib
from prove_jax.evaluation import humaneval

COLOURS = ("\x1b[1;32m", "\x1b[1;35m")  # bold green / bold magenta, alternating per step
RESET, DIM = "\x1b[0m", "\x1b[2m"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=assets.DEMO_PROPOSER,
                    help="MARS proposer checkpoint dir (default: the shipped demo proposer)")
    ap.add_argument("--verifier", default=assets.DEMO_VERIFIER,
                    help="verifier checkpoint dir (default: the shipped demo verifier)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--num-prompts", type=int, default=6,
                    help="first N HumanEval prompts to complete (default 6)")
    ap.add_argument("--block-size", type=int, default=8,
                    help="K proposed per forward by threshold and verify (default 8, the MARS block)")
    ap.add_argument("--lossless-block-size", type=int, default=4,
                    help="K of ProVe-lossless (default 4; its step holds K*K tokens)")
    ap.add_argument("--tau", type=float, default=0.9, help="threshold mode: top-1 probability to accept a token (default 0.9)")
    ap.add_argument("--show", type=int, default=0, help="index of the prompt whose completion is shown")
    return ap.parse_args(argv)


def block_texts(tokenizer, ids: list[int], commits: list[int]) -> list[str]:
    """Text committed by each step. Decodes growing prefixes, so a character split across
    steps (byte-level BPE) appears whole in the step that completes it."""
    texts, prev, end = [], "", 0
    for n in commits:
        end += n
        text = tokenizer.decode(ids[:end], skip_special_tokens=False)
        texts.append(text[len(prev):])
        prev = text
    return texts


def render_blocks(texts: list[str], colour: bool) -> str:
    if colour:
        return "".join(COLOURS[i % 2] + t + RESET for i, t in enumerate(texts))
    return "".join(f"[{t}]" for t in texts)


def summary_table(records: list[dict]) -> str:
    rows = [("mode", "setting", "tokens/forward", "tok/s", "speedup vs ar", "agreement with ar")]
    for r in records:
        rows.append((r["mode"], r["setting"], f"{r['tokens_per_forward']:.2f}",
                     f"{r['tokens_per_second']:.1f}", f"{r['speedup_vs_ar']:.2f}x",
                     f"{100 * r['agreement_with_ar']:.1f}%"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.num_prompts < 1:
            raise bench_lib.BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if not 0 <= args.show < args.num_prompts:
            raise bench_lib.BenchError(f"--show must be in [0, {args.num_prompts}), got {args.show}")
        humaneval.load_problems(limit=args.num_prompts)  # more than HumanEval has: said now, not after the run
        bench_lib.log(f"loading proposer {args.model} and verifier {args.verifier} ...")
        pair = bench_lib.load_pair(args.model, args.verifier)
        if pair.tokenizer is None:
            raise bench_lib.BenchError(f"{args.model} has no tokenizer files: the demo needs text")
        problems = humaneval.load_problems(limit=args.num_prompts)
        prompts = [pair.tokenizer.encode(p["prompt"], add_special_tokens=False) for p in problems]
        lossless = bench_lib.lossless_setting(args.lossless_block_size, record_steps=True)
        # K=6 with 2 groups too: a step as wide as K=4's that commits more (benchmarks/decode_batch1.md)
        settings = [bench_lib.ar_setting(), lossless, bench_lib.lossless_setting(6, 2),
                    bench_lib.threshold_setting(args.tau, args.block_size),
                    bench_lib.verify_setting("top1", args.block_size)]
        bench_lib.log(f"decoding {len(prompts)} HumanEval prompts x {args.max_new_tokens} tokens "
                      f"in {len(settings)} modes (batch 1; each mode compiles once first)")
        records, ms = bench_lib.run_settings(pair, settings, prompts, args.max_new_tokens, [1], repeats=1)
    except (ProveJaxError, ValueError, OSError) as e:  # ValueError: a library's bad-input error
        print(f"error: {e}", file=sys.stderr)
        return 2

    print()
    print(f"ProVe demo: {len(prompts)} HumanEval prompts, {args.max_new_tokens} new tokens, batch 1 "
          f"(compile time excluded)")
    print(summary_table(records))
    if jax.devices()[0].platform == "cpu":
        print("(on a 2-core CPU a lossless step of this small proposer costs about 1.8x (K=2) to "
              "3-4.5x (16 tokens: K=4, or K=6 with 2 groups) an AR step, depending on the CPU, and "
              "on a shared machine the timings swing by 15-30% from run to run (AR's the most), so "
              "it needs more tokens per forward than that to win: benchmarks/step_cost.md and "
              "decode_batch1.md; `--calibrate` measures the machine at hand. The same proposer "
              "inflated to the Qwen2.5-0.5B shape, whose steps are bound by weight reads, runs "
              "lossless K=6,G=2 at about 2x AR: benchmarks/decode_0.5b_shape.md)")
    shown = ms[1]  # the lossless run
    ids, commits = shown.outputs[args.show], shown.step_commits[args.show]
    colour = sys.stdout.isatty()
    prompt_tail = "".join(problems[args.show]["prompt"].splitlines(keepends=True)[-4:])
    print()
    print(f"{problems[args.show]['task_id']}, {lossless.name}: {len(ids)} tokens in {len(commits)} "
          f"proposer forwards; each {'colour' if colour else '[...]'} is one forward's commit "
          f"(identical to greedy AR):")
    print((DIM + "..." + prompt_tail + RESET) if colour else "..." + prompt_tail, end="")
    print(render_blocks(block_texts(pair.tokenizer, ids, commits), colour))
    return 0


if __name__ == "__main__":
    run_cli(main)
