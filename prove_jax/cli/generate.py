"""Batch inference:
`prove-jax generate --model CKPT --mode lossless --input IN.jsonl --output OUT.jsonl`.

Input records: {"id", "prompt"} (text; needs the checkpoint's tokenizer) or {"id", "prompt_ids"},
optionally with their own temperature, top_k, top_p, min_p, seed, max_new_tokens, stop (strings)
and stop_token_ids, which override the flags of those names for that request.
Output records: {"id", "output_ids", "text", "finish_reason", "stats"} ("text" when the
checkpoint has a tokenizer; "stop" when a stop string ended it; "logprobs" with --logprobs), or
{"id", "error"} for a request that could not be decoded (the others still run; exit status 3;
--strict stops at the first); a one-line summary goes to stderr. Each record is appended to
--output, a whole line, as its request finishes: a killed job loses only the requests in flight,
and the same command run again skips the ids already there (--sort puts the file in input
order at the end). A device, FIFO or /dev/stdout is written into.
`--prompt TEXT` decodes one prompt and prints the completion as it is committed (--show-blocks
marks each committed block).

Decoding is greedy by default (--temperature 0). With --temperature > 0, ar and lossless draw
from exactly AR sampling's distribution (lossless by speculative sampling); threshold and
verify sample their proposals and stay lossy.
Without --model / --verifier the shipped demo proposer / verifier are used.

Multi-host (a TPU pod slice, or GPU hosts with --coordinator ...): run the same command on
every host; the mesh spans all hosts' devices, every host reads the same input, and process 0
alone prints progress and writes --output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

from prove_jax.errors import ProveJaxError
from prove_jax import assets, distributed, storage
from prove_jax.cli.runner import fail, run_cli
from prove_jax.profiling import StepProfile
from prove_jax.checkpoints.checkpoint import load_tokenizer
from prove_jax.data.chat import chat_problem
from prove_jax.models.config import DTYPES
from prove_jax.decoding import (
    COMMIT_RULES,
    CONFIDENCE_KINDS,
    DEFAULT_TAU,
    MODES,
    DecodeError,
    DecodeOptions,
    LosslessRule,
    MemoryLayout,
    ThresholdRule,
    VerifyRule,
)
from prove_jax.decoding.calibrate import calibrate_decoder
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.options import MAX_LOGPROBS
from prove_jax.models.compute import ATTENTION_CHOICES, ComputeOptions
from prove_jax.decoding.request_run import QUEUE_BATCHES, RequestStream
from prove_jax.decoding.requests import (ERROR_KEY, encode_prompts, error_record, read_requests,
                                         request_controls, request_hash)
from prove_jax.decoding.results_file import ResultsFile, check_output_path, output_record
from prove_jax.decoding.sampling import SamplingParams

SOME_REQUESTS_FAILED = 3  # exit status when the job ran but some requests carry an error
BLOCK_COLOURS = ("\x1b[1;32m", "\x1b[1;35m")  # --show-blocks on a terminal: alternating per block
RESET = "\x1b[0m"


def add_sampling_arguments(ap) -> None:
    """The sampling and stopping flags, the defaults a request's own fields override (generate
    and serve)."""
    sample = ap.add_argument_group(
        "sampling and stopping (a request's own fields of these names override them)"
    )
    sample.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy; above 0: sample from softmax(logits / temperature)",
    )
    sample.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the k most likely tokens (default 0: all)",
    )
    sample.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the most likely tokens holding probability p (default 1: all)",
    )
    sample.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than min-p times the most likely (default 0)")
    sample.add_argument("--seed", type=int, default=0,
                        help="seeds the requests that give none: request i (its line) gets a seed "
                             "derived from this and i (default 0)")
    sample.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="cut the output before the first occurrence of TEXT (repeatable)")
    sample.add_argument(
        "--stop-token-id",
        action="append",
        type=int,
        default=None,
        metavar="ID",
        dest="stop_token_ids",
        help="end a request at this token, as at EOS (repeatable)",
    )
    sample.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help=f"record each output token's log-probability and the N most likely "
                             f"alternatives (0-{MAX_LOGPROBS}), under the distribution it was "
                             f"committed from: AR's in ar and lossless")


def add_decoding_arguments(ap, calibrate: bool = True) -> None:
    """The mode's options and the layout flags (dtype, mesh, scan, attention kernel, paged KV),
    as generate and serve take them; `calibrate`: also --calibrate (generate only)."""
    dec = ap.add_argument_group("decoding (the mode's options, the model's layout)")
    dec.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="K, tokens proposed per proposer forward (default: 8; lossless 4, but 8 with "
        "--adaptive or --calibrate, the widest layout their table or measurement may choose); a "
        "step feeds 2K-1 tokens per row (lossless: 1 + (K-1) x (groups+1)), which must fit the "
        "model's positions and 4096",
    )
    dec.add_argument("--groups", type=int, default=None,
                     help="lossless: mask groups = acceptance lengths served per step (default K)")
    dec.add_argument(
        "--adaptive",
        action="store_true",
        help="lossless: shrink K and groups as the batch grows (never slower than AR; K up "
        "to --block-size, default 8)",
    )
    if calibrate:
        dec.add_argument(
            "--calibrate",
            action="store_true",
            help="lossless: adaptive with a layout measured here: acceptance on the first "
            "prompts and step costs at --batch-size on this device rank K and groups "
            "(K up to --block-size, default 8), short real decodes of the best few "
            "against AR pick one, or AR when no layout wins",
        )
    dec.add_argument(
        "--tau",
        type=float,
        default=None,
        help="threshold: accept a proposed token while its confidence is >= tau (prob: "
        "top-1 probability, margin: top-1 minus top-2 probability) or its entropy "
        "is <= tau nats (entropy); default "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TAU.items()),
    )
    dec.add_argument(
        "--confidence",
        default=None,
        choices=CONFIDENCE_KINDS,
        help="threshold, and verify with --gate-tau: the confidence statistic (default prob)",
    )
    dec.add_argument(
        "--commit-rule",
        default=None,
        choices=COMMIT_RULES,
        help="verify: how the verifier accepts drafts (default top1)",
    )
    dec.add_argument("--tau-v", type=float, default=None,
                     help="verify/prob: verifier probability to commit (default 0.5)")
    dec.add_argument(
        "--relaxed-p",
        type=float,
        default=None,
        metavar="P",
        help="lossless, greedy: also commit a draft the proposer itself gives probability "
        ">= P (below 0.5 to matter); lossy, never fewer tokens per forward than exact "
        "lossless (default off: output identical to AR)",
    )
    dec.add_argument(
        "--head-threshold",
        type=float,
        default=None,
        help="verify/head: commit-head probability to commit (default: the head's own, "
        "0.5); lower commits more tokens per forward, less often equal to AR",
    )
    dec.add_argument(
        "--gate-tau",
        type=float,
        default=None,
        help="verify: also require the proposer's own confidence in each draft (--confidence "
        "statistic) to pass this, as threshold's --tau (default: the verifier alone)",
    )
    dec.add_argument("--prefill-chunk", type=int, default=None,
                     help="prompt tokens per prefill forward (default: 32 on CPU, 256 on GPU/TPU)")
    dec.add_argument("--dtype", default="float32", choices=DTYPES,
                     help="compute/param dtype (default float32; bfloat16 halves weight reads on "
                          "TPU/GPU, where lossless can then differ from AR at a near-tie)")
    dec.add_argument(
        "--mesh",
        default=None,
        help="data,fsdp,tensor mesh shape, e.g. 4,1,2 (default: tensor parallel over the "
        "kv heads as far as the weights need to fit, the rest on data; multi-host: "
        "every host's devices)",
    )
    dec.add_argument("--scan-layers", action="store_true",
                     help="run the layers as one lax.scan: compile time stops growing with depth "
                          "(for large models on TPU; on CPU a step costs more; docs/decoding.md)")
    dec.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_CHOICES,
        help="how cached attention reads the committed KV: auto (default: the Pallas kernel "
        "pallas_tpu on TPU, a --dry-run included; xla elsewhere), xla, or a Pallas "
        "kernel for that platform (docs/decoding.md)",
    )
    dec.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="keep the KV (the proposer's and the verifier's) in paged pools of pages of this "
        "many slots: each request owns the pages its own prompt and budget need, not the "
        "longest request's (default: one contiguous buffer per row; docs/decoding.md)",
    )
    dec.add_argument("--kv-pages", type=int, default=None,
                     help="--page-size: pages in the pool; a request waits until enough are free "
                          "(default: enough for every row at the longest request)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=assets.DEMO_PROPOSER,
                    help="proposer checkpoint dir (default: the shipped demo proposer)")
    ap.add_argument(
        "--verifier",
        default=None,
        help="verifier checkpoint dir for --mode verify (default: the shipped demo verifier)",
    )
    ap.add_argument(
        "--mode",
        default="lossless",
        choices=MODES,
        help="lossless (default: output identical to greedy AR, faster where a step is bound "
        "by weight reads), ar, threshold or verify",
    )
    src = ap.add_mutually_exclusive_group()  # one of them, unless --dry-run
    src.add_argument(
        "--input", help="JSONL of {id, prompt} or {id, prompt_ids} ('-': standard input)"
    )
    src.add_argument(
        "--prompt", help="one text prompt: its completion is printed as it is committed"
    )
    ap.add_argument(
        "--output",
        default=None,
        help="JSONL that gets each request's record as it finishes (output_ids, stats and, "
        "with a tokenizer, text); rerunning the same command skips the ids already there (its "
        "settings are kept in OUT.settings.json: a rerun with other settings or changed requests "
        "is refused). /dev/stdout, a FIFO or a device is written into",
    )
    ap.add_argument("--overwrite", action="store_true",
                    help="start --output over instead of resuming it")
    ap.add_argument(
        "--sort", action="store_true", help="rewrite --output in input order at the end"
    )
    ap.add_argument(
        "--show-blocks",
        action="store_true",
        help="--prompt: mark each committed block (colours on a terminal, [...] otherwise)",
    )
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar or status lines on stderr")
    ap.add_argument("--chunk-steps", type=int, default=16,
                    help="decode steps per device call between which the host writes results and "
                         "admits requests (default 16)")
    ap.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens per request (default 128)"
    )
    add_sampling_arguments(ap)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="rows decoded together; the requests queue for them and a finished row "
                         "takes the next request at once (continuous batching; default 1)")
    ap.add_argument(
        "--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template"
    )
    ap.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --chat: the chat template's thinking switch (Qwen3's enable_thinking; "
        "--no-enable-thinking answers without a thinking section; default: the template's own)",
    )
    ap.add_argument(
        "--truncate",
        choices=("left", "right"),
        default=None,
        help="cut a prompt too long for the buffer with --max-new-tokens: left drops its "
        "start (keeps the end, what the model continues), right drops its end "
        "(default: such a request fails with an error)",
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help="stop the job at the first bad request (default: a request whose prompt is "
        "missing, malformed, empty, out of vocabulary, too long, or too big for --kv-pages gets an "
        "'error' field in its output record, the rest run, and the exit status is 3)",
    )
    add_decoding_arguments(ap)
    dry = ap.add_argument_group("dry run: compile for a TPU slice from this machine (needs libtpu)")
    dry.add_argument(
        "--dry-run",
        default=None,
        metavar="ACCELERATOR",
        help="compile the whole decode program for a Cloud TPU slice, e.g. v5p-8 or v6e-8, "
        "and report per-chip memory, compile time and collectives instead of decoding; "
        "--model/--verifier may then be preset names (e.g. qwen2.5-32b)",
    )
    dry.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help="--dry-run: compile the programs generate streams instead (one decode step, the "
        "prefill, an admission) and write what each moves through HBM against what it must, "
        "its FLOPs and roofline time, as JSON; the same is printed as a table (docs/decoding.md)",
    )
    dry.add_argument(
        "--context",
        type=int,
        default=2048,
        help="--dry-run: tokens per row, prompt and --max-new-tokens together (default 2048)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a jax.profiler trace of a few chunks of decode steps after warm-up to DIR "
        "(xprof or TensorBoard's profile plugin; docs/decoding.md)",
    )
    distributed.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.report is not None and args.dry_run is None:
        ap.error("--report applies with --dry-run")
    if args.dry_run is None and args.input is None and args.prompt is None:
        ap.error("one of the arguments --input --prompt is required (or --dry-run)")
    if args.input is not None and args.output is None:
        ap.error("--input needs --output (the file that gets the records)")
    if args.sort and args.output is None:
        ap.error("--sort applies with --output")
    if args.overwrite and args.output is None:
        ap.error("--overwrite applies with --output")
    if args.chunk_steps < 1:
        ap.error(f"--chunk-steps must be >= 1, got {args.chunk_steps}")
    if args.enable_thinking is not None and not args.chat:
        ap.error(f"{_thinking_flag(args)} needs --chat (it is the chat template's thinking switch)")
    return args


def _thinking_flag(args) -> str:
    return "--enable-thinking" if args.enable_thinking else "--no-enable-thinking"


# Options that only some modes read (and, for verify's, only some commit rules): given to any
# other, they would be silently ignored, so the run would not be the one asked for.
MODE_OPTIONS = {
    "block_size": ("threshold", "lossless", "verify"),
    "groups": ("lossless",),
    "adaptive": ("lossless",),
    "calibrate": ("lossless",),
    "tau": ("threshold",),
    "confidence": ("threshold", "verify"),
    "gate_tau": ("verify",),
    "verifier": ("verify",),
    "commit_rule": ("verify",),
    "tau_v": ("verify",),
    "head_threshold": ("verify",),
    "relaxed_p": ("lossless",),
}
RULE_OPTIONS = {"tau_v": "prob", "head_threshold": "head"}


def check_mode_options(args) -> None:
    """Refuse an option the chosen mode (or commit rule) does not read, naming where it applies."""
    for name, modes in MODE_OPTIONS.items():
        value = getattr(args, name)
        if value not in (None, False) and args.mode in MODES and args.mode not in modes:
            what = "--calibrate chooses lossless layouts: use it" if name == "calibrate" else \
                f"--{name.replace('_', '-')} applies"
            raise DecodeError(f"{what} with --mode {' or '.join(modes)}, not --mode {args.mode}")
    chosen_rule = args.commit_rule or DecodeOptions.verify.commit_rule  # the dataclass default
    for name, rule in RULE_OPTIONS.items():
        if getattr(args, name) is not None and args.mode == "verify" and chosen_rule != rule:
            raise DecodeError(f"--{name.replace('_', '-')} applies with --commit-rule {rule}, "
                              f"not {chosen_rule}")


def decode_options(args) -> DecodeOptions:
    """The validated DecodeOptions the parsed arguments ask for (after check_mode_options); an
    error names the flag.

    K defaults to 8, and to 4 for fixed-layout lossless (a K=4 step holds 16 tokens); adaptive
    and calibrated lossless default to 8, the widest layout of the GPU/TPU table (K only caps
    what they choose)."""
    if args.block_size is not None:  # 0 is an error, not "default"
        block = args.block_size
    else:
        block = 4 if args.mode == "lossless" and not (args.adaptive or args.calibrate) else 8
    # the flags left unset take the rules' defaults
    threshold = {k: v for k, v in (("tau", args.tau), ("confidence", args.confidence))
                 if v is not None}
    verify = {k: v for k, v in (("commit_rule", args.commit_rule), ("tau_v", args.tau_v))
              if v is not None}
    if args.batch_size < 1:
        raise DecodeError(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        return DecodeOptions(
            mode=args.mode,
            block_size=block if args.mode != "ar" else 1,
            lossless=LosslessRule(max_groups=args.groups, adaptive=args.adaptive or args.calibrate,
                                  relaxed_p=args.relaxed_p),
            threshold=ThresholdRule(**threshold),
            verify=VerifyRule(head_threshold=args.head_threshold, gate_tau=args.gate_tau,
                              **verify),
            memory=MemoryLayout(scan_layers=args.scan_layers, page_size=args.page_size,
                                kv_pages=args.kv_pages, prefill_chunk=args.prefill_chunk),
            logprobs=args.logprobs,
            compute=_compute(args),
        ).validate()
    except DecodeError as e:  # the library's words for a setting -> the flag that set it
        message = str(e)
        for words, flag in OPTION_FLAGS.items():
            if message.startswith(words + " "):
                message = flag + message[len(words):]
        raise DecodeError(message) from None


def _compute(args) -> ComputeOptions:
    """--attention as ComputeOptions; "auto" is resolved on the host for the backend the program
    runs on when the Decoder is built (a --dry-run's, for TPU, when the dry run resolves its
    options), not here: a multi-host job has not joined yet, and asking for the backend would
    start it."""
    return ComputeOptions(attention=args.attention)


OPTION_FLAGS = {
    "block size": "--block-size",
    "max groups": "--groups",
    "prefill chunk": "--prefill-chunk",
    "tau": "--tau",
    "tau_v": "--tau-v",
    "head threshold": "--head-threshold",
    "logprobs": "--logprobs",
    "relaxed_p": "--relaxed-p",
    "page size": "--page-size",
    "gate_tau": "--gate-tau",
    "kv_pages": "--kv-pages",
}


def default_params(args) -> SamplingParams:
    """The command line's SamplingParams, which request fields override; an error names the
    flag (`--top-p`, not `top_p`)."""
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop or ()),
            stop_token_ids=tuple(args.stop_token_ids or ()),
        ).validate()
    except DecodeError as e:
        field = str(e).split(" ", 1)[0]
        flag = {"stop_token_ids": "--stop-token-id"}.get(field, "--" + field.replace("_", "-"))
        raise DecodeError(flag + str(e)[len(field):]) from None


# What shapes an output file's records: a resumed --output must have been written with the same.
SETTING_FLAGS = (
    "mode",
    "block_size",
    "groups",
    "adaptive",
    "calibrate",
    "tau",
    "confidence",
    "commit_rule",
    "tau_v",
    "relaxed_p",
    "head_threshold",
    "gate_tau",
    "dtype",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "chat",
    "truncate",
    "enable_thinking",
)


def job_settings(args) -> dict:
    """The settings an --output's records were decoded with: the models (resolved paths), the
    mode and its layout, the sampling defaults and the token budget."""
    verifier = args.verifier or (assets.DEMO_VERIFIER if args.mode == "verify" else None)
    settings = {name: getattr(args, name) for name in SETTING_FLAGS}
    return settings | {"model": _resolved(args.model), "verifier": verifier and _resolved(verifier)}


def _resolved(path: str) -> str:
    """A local path resolved (symlinks followed); a URL (gs://) as given."""
    return path if storage.is_url(path) else os.path.realpath(path)


def truncated(prompt, keep: int, side: str):
    """`prompt` cut to at most `keep` tokens (left: its last ones), or as it is (None, or
    already short enough). A budget with no room left (keep < 1) leaves it for the error."""
    if prompt is None or keep < 1 or len(prompt) <= keep:
        return prompt
    return prompt[-keep:] if side == "left" else prompt[:keep]


def main(argv=None) -> int:
    args = parse_args(argv)
    # a gs:// --input or --output goes through a local copy: read from it, and written back
    # whole by host 0 when the run ends, also a partial one, which a relaunch resumes
    # (docs/launch.md)
    try:
        with storage.local_file(args.input) as local_input, storage.local_file(
                args.output, upload=distributed.is_main_process,
                companions=(".settings.json",)) as local_output:
            args.input, args.output = local_input, local_output
            return _generate(args)
    except storage.StorageError as e:
        return fail(e)


def _generate(args) -> int:
    try:
        check_mode_options(args)
        options = decode_options(args)
        if args.dry_run is not None:
            from prove_jax.cli.decode_dry_run import run_dry_run
            return run_dry_run(args, options)
        defaults = default_params(args)
        distributed.initialize_from_args(args)  # before anything touches a device
        if args.calibrate and jax.process_count() > 1:
            raise DecodeError("--calibrate times this host's devices, so on several hosts each "
                              "would choose its own layout and their programs would differ; "
                              "give --block-size/--groups (or --adaptive) instead")
        main_process = distributed.is_main_process()
        say = (
            (lambda msg: print(msg, file=sys.stderr, flush=True))
            if main_process and args.progress
            else (lambda msg: None)
        )
        if args.mode == "lossless" and args.dtype != "float32" and main_process:
            print(f"note: lossless equals greedy AR token for token in float32; in {args.dtype} a "
                  f"wide step rounds differently from a one-token step, so a near-tie can flip "
                  f"(benchmarks/decode_bf16.md)", file=sys.stderr)
        # before any model loads; only the process that writes the outputs probes their directory
        if args.output is not None:
            check_output_path(args.output, args.input, probe=main_process)
        for flag, path in (("--model", args.model), ("--verifier", args.verifier)):
            if path is not None and not storage.isdir(path):
                raise DecodeError(
                    f"{flag} {path} is a file; give a checkpoint directory"
                    if storage.exists(path)
                    else f"{flag[2:]} checkpoint not found: {path}"
                )
        records = (
            [{"id": 0, "prompt": args.prompt}]
            if args.prompt is not None
            else read_requests(
                args.input, strict=args.strict, defaults=defaults, base_seed=args.seed
            )
        )
        params, logprobs = request_controls(records, defaults, args.logprobs, args.seed)
        asked = max((n for n in logprobs if n is not None), default=None)
        if asked is not None and (options.logprobs is None or options.logprobs < asked):
            # requests asking more than --logprobs
            options = dataclasses.replace(options, logprobs=asked)
        hashes = {rec["id"]: request_hash(rec) for rec in records}
        out = ResultsFile(args.output) if args.output is not None else None
        finished = {}
        if out is not None and main_process:
            out.lock()
            finished = out.start(job_settings(args), hashes, overwrite=args.overwrite)
        if finished and main_process:  # said even with --no-progress: it changes what runs
            unknown = len(set(finished) - {r["id"] for r in records})
            print(
                f"resuming: {len(finished) - unknown} of {len(records)} requests are already in "
                f"{args.output}; decoding the rest, failed ones again (--overwrite starts over)"
                + (f"; it also holds {unknown} id(s) not in {args.input}" if unknown else ""),
                file=sys.stderr,
            )
        if args.chat and main_process and not any("prompt" in r for r in records):
            print("note: --chat wraps text prompts only; every record here gives prompt_ids, "
                  "so it changes nothing", file=sys.stderr)
        # text prompts are encoded before any weight is read: a missing tokenizer or chat
        # template fails in a second, not after loading the model
        tokenizer = load_tokenizer(args.model)  # None: the checkpoint has none
        if args.enable_thinking is not None and tokenizer is not None and args.chat and (
                problem := chat_problem(tokenizer, args.enable_thinking)) is not None:
            raise DecodeError(f"{_thinking_flag(args)}: {problem}; drop the flag")
        prompts = encode_prompts(records, tokenizer, chat=args.chat, strict=args.strict,
                                 enable_thinking=args.enable_thinking)
        if tokenizer is None and any(p is not None and p.stop for p in params):
            raise DecodeError("stop strings need the checkpoint's tokenizer (this one has none); "
                              "use stop_token_ids")
        verifier = args.verifier or (assets.DEMO_VERIFIER if args.mode == "verify" else None)
        say(f"loading {args.model} ...")
        # the default mesh is sized for these rows' KV cache too, not the weights alone
        budgets = [args.max_new_tokens if p is None else p.max_new_tokens for p in params]
        kv_shape = (
            min(args.batch_size, max(len(prompts), 1)),
            max((len(p) for p in prompts if p is not None), default=0) + max(budgets, default=0),
        )
        decoder, _ = build_decoder(args.model, options, verifier_path=verifier, dtype=args.dtype,
                                   mesh_shape=args.mesh, tokenizer=tokenizer, kv_shape=kv_shape)
        # after the model load: its collective read is where a host that cannot start is noticed
        finished = _agreed_finished(finished, records)
        cut = [0] * len(prompts)  # prompt tokens --truncate dropped, per request
        if args.truncate is not None:
            kept = [
                truncated(p, decoder.max_buffer - budget, args.truncate)
                for p, budget in zip(prompts, budgets)
            ]
            cut = [0 if p is None else len(p) - len(k) for p, k in zip(prompts, kept)]
            prompts = kept
        if not args.strict:  # what only the loaded decoder can judge: vocabulary, buffer length
            for rec, prompt, budget in zip(records, prompts, budgets):
                problem = None if prompt is None else decoder.prompt_problem(prompt, budget)
                if problem is not None:
                    rec[ERROR_KEY] = f"the prompt {problem}"
        failed = [rec for rec in records if ERROR_KEY in rec]
        if out is not None and main_process:
            for rec in failed:
                if rec["id"] not in finished:
                    out.write(error_record(rec))
        live = [
            i for i, rec in enumerate(records) if ERROR_KEY not in rec and rec["id"] not in finished
        ]
        summary = {"mode": args.mode, "requests": 0}
        if live:
            live_prompts = [prompts[i] for i in live]
            if args.calibrate:
                decoder.check_prompts(
                    live_prompts, [budgets[i] for i in live], names=[records[i]["id"] for i in live]
                )
                calibrate_decoder(
                    decoder,
                    live_prompts,
                    args.batch_size,
                    args.max_new_tokens,
                    log=say,
                    num_requests=min(len(live), QUEUE_BATCHES * args.batch_size),
                )
            decoder.check_prompts(
                live_prompts, [budgets[i] for i in live], names=[records[i]["id"] for i in live]
            )
            if args.prompt is not None and args.show_blocks:
                decoder = decoder.with_options(
                    dataclasses.replace(decoder.options, record_steps=True)
                )
            job = RequestStream(
                decoder,
                live_prompts,
                args.max_new_tokens,
                args.batch_size,
                params=[params[i] for i in live],
                tokenizer=tokenizer,
                chunk_steps=1 if args.prompt is not None else args.chunk_steps,
                log=say,
            )
            job.stream.profile = StepProfile(args.profile, "decode_chunk")
            if args.prompt is not None:
                summary = _stream_to_terminal(
                    job, tokenizer, args.show_blocks and sys.stdout.isatty(), args.show_blocks
                )
            else:
                extras = [
                    _record_extras(hashes[records[i]["id"]], cut[i], logprobs[i]) for i in live
                ]
                summary = _run_job(
                    job,
                    [records[i] for i in live],
                    extras,
                    out if main_process else None,
                    tokenizer,
                    progress=main_process and args.progress,
                    total=len(records),
                    already=len(finished),
                )
            # a run shorter than the warm-up and traced chunks ends the trace here
            job.stream.profile.close()
        if out is not None and main_process:
            out.close()
            if args.sort:
                out.sort([r["id"] for r in records])
        failed_ids = {r["id"] for r in failed}  # an earlier run's failures were tried again
        summary.update(requests=len(records), failed=len(failed_ids))
    except KeyboardInterrupt:
        if args.output is not None:
            print(
                f"interrupted: the finished requests are in {args.output}; rerun the same command "
                f"to continue",
                file=sys.stderr,
            )
        raise
    except (ProveJaxError, ValueError, OSError) as e:  # ValueError: a library's bad-input error
        return fail(e)
    if main_process:
        if args.prompt is not None and summary.get("proposer_forwards"):
            print(
                f"({summary['generated_tokens']} tokens in {summary['proposer_forwards']} "
                f"forwards: {summary['tokens_per_forward']:.2f} tokens/forward, "
                f"{summary['tokens_per_second']:.0f} tok/s, {summary['setting']})",
                file=sys.stderr,
            )
        else:
            print(json.dumps(summary), file=sys.stderr)
        if args.adaptive and not args.calibrate and summary.get("setting") == "ar":
            print(
                f"note: --adaptive chose plain AR for batch size {args.batch_size} on this "
                f"{jax.default_backend().upper()}: its table expects no lossless layout to beat AR "
                f"here (--calibrate measures instead)",
                file=sys.stderr,
            )
        if failed_ids and args.prompt is not None:
            print(f"error: {failed[0][ERROR_KEY]}", file=sys.stderr)
        elif failed_ids:
            print(
                f"error: {len(failed_ids)} of {len(records)} requests failed; their records in "
                f"{args.output} carry '{ERROR_KEY}' (--strict stops at the first)",
                file=sys.stderr,
            )
        elif args.output is not None:
            print(f"wrote {len(records)} records to {args.output}", file=sys.stderr)
    return SOME_REQUESTS_FAILED if failed_ids else 0


def _agreed_finished(finished: dict, records) -> dict:
    """The ids already done, as process 0 read them, on every process (they skip the same)."""
    if jax.process_count() == 1:
        return finished
    from jax.experimental import multihost_utils
    done = np.asarray([r["id"] in finished for r in records], np.int32)
    done = np.asarray(multihost_utils.broadcast_one_to_all(done))
    return {r["id"]: {} for r, d in zip(records, done) if d}


def _record_extras(digest: str, truncated_tokens: int, logprobs: int | None) -> dict:
    """What a request's output record says beyond its result: the request's hash (a resumed job
    checks it), how many prompt tokens --truncate dropped, and its logprobs count."""
    extra = {"request_hash": digest, "logprobs": logprobs}
    if truncated_tokens:
        extra.update(truncated=True, truncated_tokens=truncated_tokens)
    return extra


def _run_job(
    job: RequestStream,
    records,
    extras,
    out: ResultsFile | None,
    tokenizer,
    progress: bool,
    total: int,
    already: int,
) -> dict:
    """Decode a file's requests, writing each record as it finishes; a progress bar on stderr."""
    bar = Progress(total=total, initial=already, enabled=progress)
    results = []
    for event, result in job:
        bar.tokens(len(event.new_ids))
        if result is None:
            continue
        results.append(result)
        if out is not None:
            out.write(
                output_record(records[event.index]["id"], result, tokenizer, **extras[event.index])
            )
        bar.finished(result.stats["proposer_forwards"])
    bar.close()
    return job.summary(results)


def _stream_to_terminal(job: RequestStream, tokenizer, colour: bool, marks: bool) -> dict:
    """Print one request's completion as its blocks are committed (alternately coloured, or in
    [...], with --show-blocks)."""
    ids, shown, block_index, result = [], "", 0, None
    for event, result in job:
        for n in event.blocks or [len(event.new_ids)]:
            block = event.new_ids[:n]
            event.new_ids = event.new_ids[n:]
            ids += block
            text = (
                tokenizer.decode(ids, skip_special_tokens=True)
                if tokenizer is not None
                else " ".join(map(str, ids))
            )
            stops = job.stops.get(0)
            if stops is not None and stops.stopped:
                text = stops.text
            piece, shown = text[len(shown):], text
            if marks and piece:
                piece = (
                    f"{BLOCK_COLOURS[block_index % 2]}{piece}{RESET}" if colour else f"[{piece}]"
                )
                block_index += 1
            sys.stdout.write(piece)
            sys.stdout.flush()
            if stops is not None and stops.stopped:
                break
    sys.stdout.write("\n")
    return job.summary([result] if result is not None else [])


class Progress:
    """Requests done / total, generated tokens per second, tokens per forward and ETA: a tqdm
    bar on a terminal, a plain line every PLAIN_EVERY seconds otherwise; nothing when off."""
    PLAIN_EVERY = 10.0

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.done, self.enabled = total, initial, enabled
        self.generated = self.forwards = 0
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="generate",
                unit="req",
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def tokens(self, n: int) -> None:
        self.generated += n

    def finished(self, forwards: int) -> None:
        self.done += 1
        self.forwards += forwards
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        per_forward = self.generated / self.forwards if self.forwards else 0.0
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"{self.generated / elapsed:.0f} tok/s, {per_forward:.2f} tok/fwd", refresh=False
            )
            self.bar.update(1)
        elif time.perf_counter() - self.last_line >= self.PLAIN_EVERY or self.done == self.total:
            self.last_line = time.perf_counter()
            print(f"[{self.done}/{self.total} requests] {self.generated / elapsed:.0f} tok/s, "
                  f"{per_forward:.2f} tok/fwd", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    run_cli(main)
