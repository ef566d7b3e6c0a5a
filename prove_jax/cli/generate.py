"""Batch inference: `prove-jax generate --model CKPT --mode lossless --input IN.jsonl --output OUT.jsonl`.

Input records: {"id", "prompt"} (text; needs the checkpoint's tokenizer) or {"id", "prompt_ids"},
optionally with their own temperature, top_k, top_p, min_p, seed, max_new_tokens, stop (strings)
and stop_token_ids, which override the flags of those names for that request.
Output records: {"id", "output_ids", "text", "finish_reason", "stats"} ("text" when the
checkpoint has a tokenizer; "stop" when a stop string ended it; "logprobs" with --logprobs), or
{"id", "error"} for a request that could not be decoded (the others still run; exit status 3;
--strict stops at the first); a one-line summary goes to stderr. --output is written atomically
(through a symlink, its target); a device, FIFO or /dev/stdout is written into.

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
import json
import os
import sys

import jax

from prove_jax.errors import ProveJaxError
from prove_jax import assets, distributed
from prove_jax.cli.runner import run_cli
from prove_jax.checkpoints.checkpoint import load_tokenizer
from prove_jax.models.config import DTYPES
from prove_jax.decoding import COMMIT_RULES, CONFIDENCE_KINDS, DEFAULT_TAU, MODES, DecodeError, DecodeOptions
from prove_jax.decoding.calibrate import calibrate_decoder
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.options import MAX_LOGPROBS
from prove_jax.decoding.requests import (ERROR_KEY, QUEUE_BATCHES, check_output_path, encode_prompts,
                                         read_requests, request_params, run_requests, write_outputs)
from prove_jax.decoding.sampling import SamplingParams

SOME_REQUESTS_FAILED = 3  # exit status when the job ran but some requests carry an error


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=assets.DEMO_PROPOSER,
                    help="proposer checkpoint dir (default: the shipped demo proposer)")
    ap.add_argument("--verifier", default=None,
                    help="verifier checkpoint dir for --mode verify (default: the shipped demo verifier)")
    ap.add_argument("--mode", default="ar", choices=None, help=f"one of {', '.join(MODES)} (default ar)")
    ap.add_argument("--input", required=True, help="JSONL of {id, prompt} or {id, prompt_ids}")
    ap.add_argument("--output", required=True,
                    help="JSONL to write (atomically) with output_ids, stats and, when the checkpoint "
                         "has a tokenizer, text; /dev/stdout, a FIFO or a device is written into")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request (default 128)")
    sample = ap.add_argument_group("sampling and stopping (a request's own fields of these names override them)")
    sample.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0: sample from softmax(logits / temperature)")
    sample.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    sample.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens holding probability p (default 1: all)")
    sample.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than min-p times the most likely (default 0)")
    sample.add_argument("--seed", type=int, default=0,
                        help="seeds the requests that give none: request i (its line) gets a seed "
                             "derived from this and i (default 0)")
    sample.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="cut the output before the first occurrence of TEXT (repeatable)")
    sample.add_argument("--stop-token-id", action="append", type=int, default=None, metavar="ID",
                        dest="stop_token_ids", help="end a request at this token, as at EOS (repeatable)")
    sample.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help=f"record each output token's log-probability and the N most likely "
                             f"alternatives (0-{MAX_LOGPROBS}), under the distribution it was "
                             f"committed from: AR's in ar and lossless")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="rows decoded together; the requests queue for them and a finished row "
                         "takes the next request at once (continuous batching; default 1)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="K, tokens proposed per proposer forward (default: 8; lossless 4, but 8 with "
                         "--adaptive or --calibrate, the widest layout their table or measurement "
                         "may choose); a step feeds "
                         "2K-1 tokens per row (lossless: 1 + (K-1) x (groups+1)), which must fit "
                         "the model's positions and 4096")
    ap.add_argument("--groups", type=int, default=None,
                    help="lossless: mask groups = acceptance lengths served per step (default K)")
    ap.add_argument("--adaptive", action="store_true",
                    help="lossless: shrink K and groups as the batch grows (never slower than AR; K up "
                         "to --block-size, default 8)")
    ap.add_argument("--calibrate", action="store_true",
                    help="lossless: adaptive with a layout measured here: acceptance on the first "
                         "prompts and step costs at --batch-size on this device rank K and groups "
                         "(K up to --block-size, default 8), short real decodes of the best few "
                         "against AR pick one, or AR when no layout wins")
    ap.add_argument("--tau", type=float, default=None,
                    help="threshold: accept a proposed token while its confidence is >= tau (prob: "
                         "top-1 probability, margin: top-1 minus top-2 probability) or its entropy "
                         "is <= tau nats (entropy); default " +
                         ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TAU.items()))
    ap.add_argument("--confidence", default=None, help=f"threshold: {', '.join(CONFIDENCE_KINDS)} (default prob)")
    ap.add_argument("--commit-rule", default=None, help=f"verify: {', '.join(COMMIT_RULES)} (default top1)")
    ap.add_argument("--tau-v", type=float, default=None,
                    help="verify/prob: verifier probability to commit (default 0.5)")
    ap.add_argument("--head-threshold", type=float, default=None,
                    help="verify/head: commit-head probability to commit (default: the head's own, "
                         "0.5); lower commits more tokens per forward, less often equal to AR")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens per prefill forward (default: 32 on CPU, 256 on GPU/TPU)")
    ap.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    ap.add_argument("--truncate", choices=("left", "right"), default=None,
                    help="cut a prompt too long for the buffer with --max-new-tokens: left drops its "
                         "start (keeps the end, what the model continues), right drops its end "
                         "(default: such a request fails with an error)")
    ap.add_argument("--strict", action="store_true",
                    help="stop the job at the first bad request (default: a request whose prompt is "
                         "missing, malformed, empty, out of vocabulary or too long gets an 'error' "
                         "field in its output record, the rest run, and the exit status is 3)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES,
                    help="compute/param dtype (default float32; bfloat16 halves weight reads on "
                         "TPU/GPU, where lossless can then differ from AR at a near-tie)")
    ap.add_argument("--mesh", default=None,
                    help="data,fsdp,tensor mesh shape, e.g. 4,1,2 (default: all devices on data; "
                         "multi-host: every host's devices)")
    distributed.add_arguments(ap)
    return ap.parse_args(argv)


# Options that only some modes read (and, for verify's, only some commit rules): given to any
# other, they would be silently ignored, so the run would not be the one asked for.
MODE_OPTIONS = {"block_size": ("threshold", "lossless", "verify"), "groups": ("lossless",),
                "adaptive": ("lossless",), "calibrate": ("lossless",), "tau": ("threshold",),
                "confidence": ("threshold",), "verifier": ("verify",), "commit_rule": ("verify",),
                "tau_v": ("verify",), "head_threshold": ("verify",)}
RULE_OPTIONS = {"tau_v": "prob", "head_threshold": "head"}


def check_mode_options(args) -> None:
    """Refuse an option the chosen mode (or commit rule) does not read, naming where it applies."""
    for name, modes in MODE_OPTIONS.items():
        value = getattr(args, name)
        if value not in (None, False) and args.mode in MODES and args.mode not in modes:
            what = "--calibrate chooses lossless layouts: use it" if name == "calibrate" else \
                f"--{name.replace('_', '-')} applies"
            raise DecodeError(f"{what} with --mode {' or '.join(modes)}, not --mode {args.mode}")
    chosen_rule = args.commit_rule or DecodeOptions.commit_rule  # the dataclass default
    for name, rule in RULE_OPTIONS.items():
        if getattr(args, name) is not None and args.mode == "verify" and chosen_rule != rule:
            raise DecodeError(f"--{name.replace('_', '-')} applies with --commit-rule {rule}, "
                              f"not {chosen_rule}")


def decode_options(args) -> DecodeOptions:
    """The validated DecodeOptions the parsed arguments ask for (after check_mode_options).

    K defaults to 8, and to 4 for fixed-layout lossless (a K=4 step holds 16 tokens); adaptive
    and calibrated lossless default to 8, the widest layout of the GPU/TPU table (K only caps
    what they choose)."""
    if args.block_size is not None:  # 0 is an error, not "default"
        block = args.block_size
    else:
        block = 4 if args.mode == "lossless" and not (args.adaptive or args.calibrate) else 8
    given = {k: v for k, v in (("confidence", args.confidence), ("commit_rule", args.commit_rule),
                               ("tau_v", args.tau_v)) if v is not None}  # else DecodeOptions'
    return DecodeOptions(mode=args.mode, block_size=block if args.mode != "ar" else 1,
                         max_groups=args.groups, adaptive=args.adaptive or args.calibrate, tau=args.tau,
                         head_threshold=args.head_threshold, prefill_chunk=args.prefill_chunk,
                         logprobs=args.logprobs, **given).validate()


def default_params(args) -> SamplingParams:
    """The command line's SamplingParams, which request fields override."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ()),
                          stop_token_ids=tuple(args.stop_token_ids or ())).validate()


def params_of_records(records, defaults: SamplingParams, base_seed: int, strict: bool) -> list:
    """Each record's SamplingParams (None for a failed record); a bad field fails the request
    (or, with `strict`, the job)."""
    params = []
    for i, rec in enumerate(records):
        try:
            params.append(None if ERROR_KEY in rec else request_params(rec, defaults, i, base_seed))
        except DecodeError as e:
            if strict:
                raise DecodeError(f"request {rec['id']!r}: {e}") from None
            rec[ERROR_KEY] = f"the request's {e}"
            params.append(None)
    return params


def truncated(prompt, keep: int, side: str):
    """`prompt` cut to at most `keep` tokens (left: its last ones), or as it is (None, or
    already short enough). A budget with no room left (keep < 1) leaves it for the error."""
    if prompt is None or keep < 1 or len(prompt) <= keep:
        return prompt
    return prompt[-keep:] if side == "left" else prompt[:keep]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_mode_options(args)
        options = decode_options(args)
        defaults = default_params(args)
        distributed.initialize_from_args(args)  # before anything touches a device
        if args.calibrate and jax.process_count() > 1:
            raise DecodeError("--calibrate times this host's devices, so on several hosts each "
                              "would choose its own layout and their programs would differ; "
                              "give --block-size/--groups (or --adaptive) instead")
        main_process = distributed.is_main_process()
        if args.mode == "lossless" and args.dtype != "float32" and main_process:
            print(f"note: lossless equals greedy AR token for token in float32; in {args.dtype} a "
                  f"wide step rounds differently from a one-token step, so a near-tie can flip "
                  f"(benchmarks/decode_bf16.md)", file=sys.stderr)
        # before any model loads; only the process that writes the outputs probes their directory
        check_output_path(args.output, args.input, probe=main_process)
        for flag, path in (("--model", args.model), ("--verifier", args.verifier)):
            if path is not None and not os.path.isdir(path):
                raise DecodeError(f"{flag} {path} is a file; give a checkpoint directory" if os.path.exists(path)
                                  else f"{flag[2:]} checkpoint not found: {path}")
        records = read_requests(args.input, strict=args.strict)
        params = params_of_records(records, defaults, args.seed, args.strict)
        if args.chat and main_process and not any("prompt" in r for r in records):
            print("note: --chat wraps text prompts only; every record here gives prompt_ids, "
                  "so it changes nothing", file=sys.stderr)
        # text prompts are encoded before any weight is read: a missing tokenizer or chat
        # template fails in a second, not after loading the model
        tokenizer = load_tokenizer(args.model)  # None: the checkpoint has none
        prompts = encode_prompts(records, tokenizer, chat=args.chat, strict=args.strict)
        verifier = args.verifier or (assets.DEMO_VERIFIER if args.mode == "verify" else None)
        decoder, _ = build_decoder(args.model, options, verifier_path=verifier, dtype=args.dtype,
                                   mesh_shape=args.mesh, tokenizer=tokenizer)
        budgets = [args.max_new_tokens if p is None else p.max_new_tokens for p in params]
        if args.truncate is not None:
            prompts = [truncated(p, decoder.max_buffer - budget, args.truncate)
                       for p, budget in zip(prompts, budgets)]
        if not args.strict:  # what only the loaded decoder can judge: vocabulary, buffer length
            for rec, prompt, budget in zip(records, prompts, budgets):
                problem = None if prompt is None else decoder.prompt_problem(prompt, budget)
                if problem is not None:
                    rec[ERROR_KEY] = f"the prompt {problem}"
        if tokenizer is None and any(p is not None and p.stop for p in params):
            raise DecodeError("stop strings need the checkpoint's tokenizer (this one has none); "
                              "use stop_token_ids")
        live = [i for i, rec in enumerate(records) if ERROR_KEY not in rec]
        live_prompts = [prompts[i] for i in live]
        live_ids = [records[i]["id"] for i in live]
        results = [None] * len(records)
        summary = {"mode": args.mode}
        if live:
            if args.calibrate:
                decoder.check_prompts(live_prompts, [budgets[i] for i in live], names=live_ids)
                calibrate_decoder(decoder, live_prompts, args.batch_size, args.max_new_tokens,
                                  log=lambda msg: print(msg, file=sys.stderr, flush=True),
                                  num_requests=min(len(live), QUEUE_BATCHES * args.batch_size))
            live_results, summary = run_requests(
                decoder, live_prompts, args.max_new_tokens, args.batch_size, ids=live_ids,
                progress=main_process, params=[params[i] for i in live], tokenizer=tokenizer)
            for i, result in zip(live, live_results):
                results[i] = result
        failed = len(records) - len(live)
        summary.update(requests=len(records), failed=failed)
        if main_process:
            write_outputs(args.output, records, results, tokenizer)
    except (ProveJaxError, ValueError, OSError) as e:  # ValueError: a library's bad-input error
        print(f"error: {e}", file=sys.stderr)
        return 2
    if main_process:
        print(json.dumps(summary), file=sys.stderr)
        if args.adaptive and not args.calibrate and summary.get("setting") == "ar":
            print(f"note: --adaptive chose plain AR for batch size {args.batch_size} on this "
                  f"{jax.default_backend().upper()}: its table expects no lossless layout to beat AR "
                  f"here (--calibrate measures instead)", file=sys.stderr)
        if failed:
            print(f"error: {failed} of {len(records)} requests failed; their records in "
                  f"{args.output} carry '{ERROR_KEY}' (--strict stops at the first)", file=sys.stderr)
    return SOME_REQUESTS_FAILED if failed else 0


if __name__ == "__main__":
    run_cli(main)
