"""The demo: `prove-jax demo` decodes HumanEval prompts with greedy AR and ProVe-lossless.

It prints, in order:
1. what holds on any machine: tokens committed per proposer forward, and that the lossless
   output equals greedy AR's token for token (checked on every prompt);
2. the speed on this machine, AR and lossless timed side by side, with the shipped 4.2M-parameter
   proposer inflated to a real model's shape (`--inflate`, default qwen2.5-0.5b: every added
   weight zero, so the same outputs at that shape's cost per step), and a verdict in words;
3. one lossless completion with each forward's commit marked (alternating colours on a
   terminal, `[...]` otherwise).

Why inflate: the shipped proposer's weights sit in a CPU's cache, where a 16-token step costs
3-4 one-token steps and lossless about breaks even (benchmarks/step_cost.md). At a real model's
size a step is bound by reading the weights, and lossless wins (benchmarks/decode_0.5b_shape.md).
`--lossy` adds the lossy modes (MARS threshold, ProVe with the verifier) with their agreement
with AR. `prove-jax benchmark` is the full measurement.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import jax

from prove_jax import assets
from prove_jax.cli.runner import fail, run_cli
from prove_jax.decoding.adaptive import ADAPTIVE_TABLES
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import COMMIT_RULES, CONFIDENCE_KINDS, DEFAULT_TAU
from prove_jax.errors import ProveJaxError
from prove_jax.evaluation.benchmark import run_settings
from prove_jax.evaluation.model_pair import has_commit_head, load_pair
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.runners import Measurement
from prove_jax.evaluation.sweep import (BenchError, Setting, ar_setting, lossless_setting,
                                        threshold_setting, verify_setting)
from prove_jax.evaluation import humaneval
from prove_jax.models.config import PRESETS

COLOURS = ("\x1b[1;32m", "\x1b[1;35m")  # bold green / bold magenta, alternating per step
RESET, DIM = "\x1b[0m", "\x1b[2m"
LOSSY_K = 8  # threshold and verify: the proposer's MARS block
LOSSY_OPTIONS = ("tau", "confidence", "commit_rule")  # read only by the lossy modes
# Below this speedup (and above its inverse) a one-run ratio on a shared machine is noise
# (docs/benchmarks.md: "differences under about 10% are noise").
NOISE = 1.1


def recommended_layout(platform: str) -> tuple[int, int]:
    """Lossless (K, groups) for batch 1: on CPU K=6, G=2, the fastest fixed layout at the
    Qwen2.5-0.5B shape (benchmarks/decode_0.5b_shape_batch1.md); on GPU/TPU the adaptive
    table's batch-1 row (benchmarks/h200/)."""
    if platform == "cpu":
        return 6, 2
    _, k, g = ADAPTIVE_TABLES.get(platform, ADAPTIVE_TABLES["gpu"])[0]
    return k, g


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=assets.DEMO_PROPOSER,
                    help="MARS proposer checkpoint dir (default: the shipped demo proposer)")
    ap.add_argument(
        "--verifier",
        default=assets.DEMO_VERIFIER,
        help="verifier checkpoint dir, for --lossy (default: the shipped demo verifier)",
    )
    ap.add_argument("--num-prompts", type=int, default=3,
                    help="first N HumanEval prompts to complete (default 3)")
    ap.add_argument(
        "--max-new-tokens", type=int, default=48, help="new tokens per prompt (default 48)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed passes per mode, interleaved; each mode's fastest is reported (default 2)",
    )
    ap.add_argument(
        "--inflate",
        default="qwen2.5-0.5b",
        choices=list(PRESETS) + ["none"],
        metavar="PRESET",
        help="run the proposer inflated to this shape (its outputs, that shape's cost per "
        "step), or 'none' for its own size; one of "
        + ", ".join(PRESETS)
        + " (default qwen2.5-0.5b)",
    )
    ap.add_argument("--block-size", type=int, default=None,
                    help="K, tokens proposed per forward, as in `prove-jax generate` (default: "
                         "lossless 6 on CPU, 8 on GPU/TPU; threshold and verify 8)")
    ap.add_argument("--groups", type=int, default=None,
                    help="lossless: mask groups, acceptance lengths served per step (default: 2 on "
                         "CPU, 8 on GPU/TPU; K when --block-size is given)")
    ap.add_argument("--lossy", action="store_true",
                    help="also run the lossy modes, MARS threshold and ProVe with the verifier")
    ap.add_argument("--tau", type=float, default=None,
                    help="threshold (--lossy): confidence needed to accept a token (default: " +
                         ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TAU.items()) + ")")
    ap.add_argument("--confidence", default=None, choices=CONFIDENCE_KINDS,
                    help="threshold (--lossy): the confidence statistic (default prob)")
    ap.add_argument("--commit-rule", default=None, choices=COMMIT_RULES,
                    help="verify (--lossy): how the verifier commits drafts (default head, the "
                         "trained commit head, when the verifier has one; else top1)")
    ap.add_argument(
        "--show", type=int, default=0, help="index of the prompt whose completion is shown"
    )
    return ap.parse_args(argv)


def check_args(args) -> None:
    """One-line errors naming the flag, before anything loads."""
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--repeats", args.repeats, 1),
        ("--groups", args.groups, 1),
        ("--block-size", args.block_size, 2),  # lossless proposes K-1 drafts
    ):
        if value is not None and value < low:
            raise BenchError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= args.show < args.num_prompts:
        raise BenchError(f"--show must be in [0, {args.num_prompts}) (--num-prompts), "
                         f"got {args.show}")
    given = [o for o in LOSSY_OPTIONS if getattr(args, o) is not None]
    if given and not args.lossy:
        raise BenchError(f"--{given[0].replace('_', '-')} applies to the lossy modes: add --lossy")


def demo_settings(args, platform: str, have_head: bool) -> list[Setting]:
    """AR, lossless (recording each forward's commit) and, with --lossy, threshold and verify."""
    k, g = recommended_layout(platform)
    if args.block_size is not None:
        k, g = args.block_size, None
    g = args.groups if args.groups is not None else g
    settings = [ar_setting(), lossless_setting(k, g, record_steps=True)]
    if args.lossy:
        lossy_k = args.block_size or LOSSY_K
        confidence = args.confidence or "prob"
        tau = DEFAULT_TAU[confidence] if args.tau is None else args.tau
        rule = args.commit_rule or ("head" if have_head else "top1")
        if rule == "head" and not have_head:
            raise BenchError(f"--commit-rule head needs a commit head in {args.verifier} "
                             f"(commit_head/): use --commit-rule top1 or prob")
        settings += [threshold_setting(tau, lossy_k, confidence),
                     verify_setting(rule, lossy_k)]
    return settings


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


def para(text: str, indent: str = "  ", hang: str = "") -> str:
    """`text` wrapped to 100 columns, indented (continuation lines by `hang` more)."""
    return textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent + hang)


def table(rows: list[tuple[str, ...]], numbers: tuple[int, ...], indent: str = "  ") -> str:
    """Text columns, left-aligned except the `numbers` columns."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [indent + "  ".join(cell.rjust(w) if c in numbers else cell.ljust(w)
                                for c, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    return "\n".join(lines)


def first_difference(out: list[int], ref: list[int]) -> int | None:
    """Index of the first token where two outputs differ, None when equal."""
    for i, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return i
    return None if len(out) == len(ref) else min(len(out), len(ref))


def exactness_line(ms: list[Measurement]) -> str:
    ar, ll = ms[0], ms[1]
    diffs = [(i, first_difference(o, r)) for i, (o, r) in enumerate(zip(ll.outputs, ar.outputs))]
    diffs = [(i, d) for i, d in diffs if d is not None]
    n = len(ar.outputs)
    if not diffs:
        return f"yes, token for token ({n} of {n} prompts, {ar.generated_tokens} tokens, checked)"
    i, d = diffs[0]
    return f"NO: {n - len(diffs)} of {n} prompts equal; prompt {i} differs from token {d} on"


def holds_everywhere(ms: list[Measurement], records: list[dict]) -> str:
    rows = [
        ("mode", "setting", "tokens/forward", "same output as greedy AR"),
        ("ar", "-", "1.00", "(the reference)"),
        ("lossless", ms[1].setting.label, f"{ms[1].tokens_per_forward:.2f}", exactness_line(ms)),
    ]
    for m, r in zip(ms[2:], records[2:]):
        rows.append(
            (
                m.setting.mode,
                m.setting.label,
                f"{m.tokens_per_forward:.2f}",
                f"{100 * r['agreement_with_ar']:.1f}% of tokens, "
                f"{100 * r['exact_match_with_ar']:.0f}% of prompts (lossy)",
            )
        )
    return table(rows, numbers=(2,))


def speed_table(ms: list[Measurement]) -> str:
    ar = ms[0].fastest_tokens_per_second
    rows = [("mode", "setting", "tok/s", "vs AR", "compile s")]
    for m in ms:
        rows.append(
            (
                m.setting.mode,
                m.setting.label,
                f"{m.fastest_tokens_per_second:.1f}",
                f"{m.fastest_tokens_per_second / ar:.2f}x" if ar else "-",
                f"{m.compile_seconds:.1f}",
            )
        )
    return table(rows, numbers=(2, 3, 4))


def verdict(ms: list[Measurement], exact: bool) -> list[str]:
    """The plain-words verdict on lossless against AR, and why, from the fastest passes."""
    ar, ll = ms[0], ms[1]
    speedup = ll.fastest_tokens_per_second / ar.fastest_tokens_per_second
    tpf = ll.tokens_per_forward
    # time of one lossless forward in AR forwards (each side's fastest pass; prefill included)
    step_cost = (min(ll.seconds) / ll.proposer_forwards) / (min(ar.seconds) / ar.proposer_forwards)
    opts = ll.setting.options
    width = LosslessLayout.build(opts.block_size, opts.lossless.max_groups).width
    same = ("with the same output token for token" if exact
            else "but its output was not AR's (see above)")
    if speedup >= NOISE:
        head = f"ProVe-lossless decoded {speedup:.1f}x as fast as greedy AR here, {same}."
    elif speedup > 1 / NOISE:
        head = f"no real speedup here ({speedup:.2f}x AR, within a shared machine's noise), {same}."
    else:
        head = f"ProVe-lossless was slower than greedy AR here ({speedup:.2f}x), {same}."
    why = (
        f"Why: it ran {tpf:.1f}x fewer forwards, and one {width}-token forward cost about "
        f"{step_cost:.1f} one-token AR forwards here (prompt prefill included), "
        + (
            "so the fewer forwards won."
            if step_cost < tpf
            else "so the fewer forwards did not pay."
        )
    )
    return ["Verdict: " + head, why]


def main(argv=None) -> int:
    args = parse_args(argv)
    platform = jax.devices()[0].platform
    inflate = None if args.inflate == "none" else args.inflate
    try:
        check_args(args)
        # more than HumanEval has: said now
        problems = humaneval.load_problems(limit=args.num_prompts)
        have_head = args.lossy and has_commit_head(args.verifier)
        settings = demo_settings(args, platform, have_head)
        log(f"loading the proposer {args.model}"
            + (f" and the verifier {args.verifier}" if args.lossy else "") + " ...")
        pair = load_pair(args.model, args.verifier if args.lossy else None,
                         with_head=have_head, inflate_to=inflate)
        if pair.tokenizer is None:
            raise BenchError(f"{args.model} has no tokenizer files: the demo needs text")
        prompts = [pair.tokenizer.encode(p["prompt"], add_special_tokens=False) for p in problems]
        log(f"decoding {len(prompts)} HumanEval prompts x {args.max_new_tokens} tokens with "
            f"{', '.join(s.name for s in settings)} (batch 1; each compiles once, then "
            f"{args.repeats} timed pass(es))")
        records, ms = run_settings(pair, settings, prompts, args.max_new_tokens, [1],
                                   repeats=args.repeats)
    except (ProveJaxError, ValueError, OSError) as e:  # ValueError: a library's bad-input error
        return fail(e)

    cfg = pair.proposer.cfg
    exact = records[1]["exact_match_with_ar"] == 1.0
    print()
    print(
        f"ProVe demo: {len(prompts)} HumanEval prompts x {args.max_new_tokens} new tokens, greedy, "
        "batch 1"
    )
    print()
    print("1. On any machine: tokens per proposer forward, and exactness")
    print(holds_everywhere(ms, records))
    print()
    device = f"{platform}, {jax.device_count()} device(s)" if platform != "cpu" else "cpu"
    if inflate:
        print(f"2. Speed on this machine ({device}), the proposer inflated to the {inflate} shape")
        print(
            para(
                f"({cfg.num_params / 1e6:.0f}M parameters: the trained "
                f"{pair.source_params / 1e6:.1f}M with every added weight zero, so the same "
                "outputs at that shape's cost per step)",
                hang=" ",
            )
        )
    else:
        print(f"2. Speed on this machine ({device}), the proposer at its own size "
              f"({cfg.num_params / 1e6:.1f}M parameters)")
        if platform == "cpu":
            print(para("(its weights sit in the CPU cache, so a wide step costs several one-token "
                       "steps; the default --inflate qwen2.5-0.5b shows a real model's cost per "
                       "step)", hang=" "))
    print(speed_table(ms))
    print(
        para(
            f"(tok/s of each mode's fastest of {args.repeats} pass(es), run interleaved; compile "
            f"excluded)",
            hang=" ",
        )
    )
    for line in verdict(ms, exact):
        print(para(line, hang="  "))

    shown = ms[1]  # the lossless run
    ids, commits = shown.outputs[args.show], shown.step_commits[args.show]
    colour = sys.stdout.isatty()
    prompt_tail = "".join(problems[args.show]["prompt"].splitlines(keepends=True)[-4:])
    print()
    print(
        f"3. {problems[args.show]['task_id']}, lossless {shown.setting.label}: {len(ids)} tokens "
        "in "
        f"{len(commits)} forwards; each {'colour' if colour else '[...]'} is one forward's commit:"
    )
    print((DIM + "..." + prompt_tail + RESET) if colour else "..." + prompt_tail, end="")
    print(render_blocks(block_texts(pair.tokenizer, ids, commits), colour))
    return 0


if __name__ == "__main__":
    run_cli(main)
