"""An OpenAI-compatible server: `prove-jax serve --mode lossless --port 8000`.

POST /v1/completions and /v1/chat/completions (stream: true sends server-sent events as the
loop commits tokens), GET /v1/models, /health (503 until the model is loaded and every program
compiled) and /metrics (Prometheus). Requests from every connection join the running batch
between chunks of decode steps; nothing compiles after start-up, so a request larger than the
compiled shapes (--max-prompt-tokens, --max-new-tokens) is refused with the reason. SIGTERM
stops accepting, gives the requests in flight --shutdown-timeout seconds, and exits 0.
Decoding flags are generate's (see `prove-jax generate --help`); the sampling flags are the
defaults a request's own fields override. Without --model the shipped demo pair serves.
docs/serving.md has examples with curl and the openai client.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys

from prove_jax import assets
from prove_jax.errors import ProveJaxError
from prove_jax.cli.generate import (
    add_decoding_arguments,
    add_sampling_arguments,
    check_mode_options,
    decode_options,
    default_params,
)
from prove_jax.cli.runner import fail, run_cli
from prove_jax.checkpoints.checkpoint import load_config, load_tokenizer
from prove_jax.decoding import MODES, DecodeError
from prove_jax.decoding.loading import build_decoder
from prove_jax.serving.engine import SAMPLERS, Engine, ServeOptions


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="prove-jax serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=assets.DEMO_PROPOSER,
        help="proposer checkpoint dir (default: the demo proposer)",
    )
    ap.add_argument(
        "--verifier",
        default=None,
        help="verifier checkpoint dir for --mode verify (default: the demo verifier)",
    )
    ap.add_argument(
        "--mode",
        default="lossless",
        choices=MODES,
        help="decoding mode (default lossless: AR's output)",
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: the --model folder's name)",
    )
    net = ap.add_argument_group("server")
    net.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    net.add_argument(
        "--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)"
    )
    net.add_argument("--batch-size", type=int, default=8,
                     help="rows decoded together; more requests wait for a free row (default 8)")
    net.add_argument("--max-prompt-tokens", type=int, default=512,
                     help="longest prompt a request may send, chat template included (default 512)")
    net.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="most new tokens a request may ask for, and what one without max_tokens gets "
        "(default 256)",
    )
    net.add_argument("--max-queue", type=int, default=256,
                     help="requests queued or decoding at once; more get 429 (default 256)")
    net.add_argument(
        "--chunk-steps",
        type=int,
        default=4,
        help="decode steps per device call; requests join and text goes out between calls "
        "(default 4)",
    )
    net.add_argument(
        "--sampling",
        default="full",
        choices=tuple(SAMPLERS),
        help="sampling the compiled step supports: full (temperature, top-k/top-p, min-p; "
        "default), temperature (no vocabulary sort), greedy (temperature 0 only: the fastest step)",
    )
    net.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="seconds requests in flight get to finish after SIGTERM (default 10)")
    net.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default warning; info logs every request)",
    )
    add_sampling_arguments(ap)  # generate's: the defaults a request's own fields override
    add_decoding_arguments(ap, calibrate=False)  # no --calibrate: it would time requests' prompts
    args = ap.parse_args(argv)
    # generate's, which serve does not take (it would time requests' own prompts)
    args.calibrate = False
    for flag in ("batch_size", "max_prompt_tokens", "max_new_tokens", "max_queue", "chunk_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.port < 65536:
        ap.error(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        ap.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    return args


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket at host:port (port 0: a free one), so the address is known before
    uvicorn starts and a taken port is one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DecodeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv=None) -> int:
    args = parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        check_mode_options(args)
        # blocks: stop strings, metrics
        options = dataclasses.replace(decode_options(args), record_steps=True)
        defaults = default_params(args)
        for flag, path in (("--model", args.model), ("--verifier", args.verifier)):
            if path is not None and not os.path.isdir(path):
                raise DecodeError(f"{flag} {path}: no such checkpoint directory")
        positions = load_config(args.model).max_position_embeddings
        if args.max_prompt_tokens + args.max_new_tokens > positions:
            raise DecodeError(
                f"--max-prompt-tokens {args.max_prompt_tokens} + --max-new-tokens "
                f"{args.max_new_tokens} is more than the model's {positions} positions"
            )
        tokenizer = load_tokenizer(args.model)
        if tokenizer is None:
            raise DecodeError(
                f"--model {args.model} has no tokenizer: the server needs one to read text "
                f"prompts and return text"
            )
        if not defaults.greedy and args.sampling == "greedy":
            raise DecodeError("--temperature > 0 needs --sampling full or temperature")
        if args.sampling == "temperature" and (
            defaults.top_k or defaults.top_p < 1 or defaults.min_p
        ):
            raise DecodeError("--top-k, --top-p and --min-p need --sampling full")
        serve_options = ServeOptions(rows=args.batch_size, max_prompt_tokens=args.max_prompt_tokens,
                                     max_new_tokens=args.max_new_tokens, max_queue=args.max_queue,
                                     chunk_steps=args.chunk_steps, sampling=args.sampling,
                                     shutdown_seconds=args.shutdown_timeout)
        verifier = args.verifier or (assets.DEMO_VERIFIER if args.mode == "verify" else None)
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        sock = _listen(args.host, args.port)
    except (ProveJaxError, ValueError, OSError) as e:
        return fail(e)
    import uvicorn  # the HTTP stack loads once the arguments are good
    from prove_jax.serving.app import build_app

    def load():
        say(f"loading {args.model} ...")
        decoder, _ = build_decoder(args.model, options, verifier_path=verifier, dtype=args.dtype,
                                   mesh_shape=args.mesh, tokenizer=tokenizer)
        return decoder, tokenizer

    engine = Engine(load, serve_options, seed=args.seed, log=say)
    app = build_app(engine, load_tokenizer(args.model), name, defaults, args.logprobs)
    class Server(uvicorn.Server):
        # SIGTERM, Ctrl-C: the requests in flight get their bound
        def handle_exit(self, sig, frame):
            engine.begin_stop()
            super().handle_exit(sig, frame)

    # uvicorn's own bound on the requests in flight is a backstop: the engine ends them first
    server = Server(uvicorn.Config(app, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout + 5))

    def failed(message: str) -> None:
        server.should_exit = True
    engine.on_error = failed
    host, port = sock.getsockname()[:2]
    say(f"serving {name} on http://{host if ':' not in host else f'[{host}]'}:{port} "
        f"(GET /health answers 200 once the model is compiled)")
    # uvicorn handles SIGTERM (stop accepting, wait for the requests in flight) and then raises
    # it again for the handler it found: with this one the process then exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[sock])
    if engine.error is not None:
        return fail(DecodeError(engine.error.strip().splitlines()[-1]))
    say("stopped")
    if engine.running:  # stopped while it compiled: leave without waiting for XLA's threads
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    run_cli(main)
