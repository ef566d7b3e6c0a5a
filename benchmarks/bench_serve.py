"""Latency users feel through `prove-jax serve`: time to first token, time per output token and
throughput at concurrency 1, 4 and 16, ar against lossless, on loopback.

    nice .venv/bin/python benchmarks/bench_serve.py [--inflate qwen2.5-0.5b] [--concurrency 1,4,16] \
        [--modes ar,lossless] [--max-tokens 64] [--out benchmarks]

For each mode and concurrency c a server is started with c rows (`--batch-size c`, greedy
`--sampling`, lossless K=6 G=2) and driven open-loop: requests arrive on a fixed schedule,
whatever the server's pace, one every L/(c x load) seconds, where L is the first mode's mean
latency of a request alone (so both modes are offered the same load; --load 0.5 by default, as
a c-row step costs more than a one-row step and a full load would only grow the queue), each a
streamed completion of a HumanEval prompt. Counts and time are bounded (--requests per c, --level-seconds). Per request
it records the time to the first text, the time per output token after it ((last - first) /
(tokens - 1)) and the whole latency; throughput is generated tokens over the level's span.
Outputs of the modes are compared text for text. `--inflate PRESET` serves the shipped proposer
embedded in a real Qwen2.5 shape (a real model's step cost, the same outputs), saved to a
temporary checkpoint first.

Writes serve.json and serve.md (or serve_<preset>_shape.*) under --out (default runs/benchmarks/).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "runs", "benchmarks")
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inflate", default=None, metavar="PRESET", help="serve the proposer inflated to this shape")
    p.add_argument("--modes", default="ar,lossless", help="modes, the first sets the offered load (default ar,lossless)")
    p.add_argument("--concurrency", default="1,4,16", help="concurrency levels = server rows (default 1,4,16)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: 2 x concurrency, at least 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--load", type=float, default=0.5,
                   help="offered load: c x this requests per first-mode latency alone (default 0.5; 1 "
                        "keeps c rows busy only if a c-row step cost what a one-row step does)")
    p.add_argument("--level-seconds", type=float, default=300.0,
                   help="no request starts later than this into a level (default 300)")
    p.add_argument("--block-size", type=int, default=6, help="lossless K (default 6)")
    p.add_argument("--groups", type=int, default=2, help="lossless mask groups (default 2)")
    p.add_argument("--out", default=RESULTS, help="folder for the results (default runs/benchmarks/; "
                                                  "--out benchmarks updates the committed ones)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.requests < 0:
        p.error("--concurrency, --max-tokens must be >= 1 and --requests >= 0")
    return args


def start_server(model: str, mode: str, rows: int, args, max_prompt: int) -> tuple[subprocess.Popen, str, list]:
    cmd = [sys.executable, "-m", "prove_jax", "serve", "--model", model, "--port", "0", "--mode", mode,
           "--batch-size", str(rows), "--max-prompt-tokens", str(max_prompt), "--max-new-tokens",
           str(args.max_tokens), "--sampling", "greedy", "--served-model-name", "bench"]
    if mode == "lossless":
        cmd += ["--block-size", str(args.block_size), "--groups", str(args.groups)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    url = None
    for line in proc.stderr:
        found = re.search(r"on (http://\S+)", line)
        if found:
            url = found.group(1)
            break
    if url is None:
        raise SystemExit(f"the server did not start: {proc.stderr.read()}")
    log = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    while True:
        if proc.poll() is not None:
            raise SystemExit("the server exited:\n" + "".join(log))
        try:
            conn = http.client.HTTPConnection(*_hostport(url), timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, url, log
        except OSError:
            pass
        time.sleep(0.5)


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one completion; the times of its first and last text and its token count."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(*_hostport(url), timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]}")
    first = last = None
    text, tokens = [], 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        body = json.loads(line[6:])
        if body.get("usage"):
            tokens = body["usage"]["completion_tokens"]
        for choice in body.get("choices", []):
            if choice.get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(choice["text"])
    end = time.perf_counter()
    first = first or end
    return {"start": start, "ttft": first - start, "tpot": (last - first) / (tokens - 1) if tokens > 1 and last else 0.0,
            "latency": end - start, "tokens": tokens, "text": "".join(text), "end": end}


def run_level(url: str, prompts: list[str], interval: float, args) -> list[dict]:
    """Open loop: request i is sent at i * interval, whatever happened to the others."""
    results: list[dict | None] = [None] * len(prompts)
    threads = []
    t0 = time.perf_counter()

    def send(i):
        results[i] = one_request(url, prompts[i], args.max_tokens)

    for i in range(len(prompts)):
        due = t0 + i * interval
        if due - t0 > args.level_seconds:
            break
        time.sleep(max(0.0, due - time.perf_counter()))
        th = threading.Thread(target=send, args=(i,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return [r for r in results if r is not None]


def metric(url: str, name: str) -> float:
    conn = http.client.HTTPConnection(*_hostport(url), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return float(re.search(rf"^prove_jax_{name} (\S+)$", text, re.M).group(1))


def summarize(results: list[dict], interval: float, forwards: float, generated: float) -> dict:
    p = lambda xs, q: statistics.quantiles(xs, n=10)[q - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tokens"] > 1]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "interval_s": interval, "tokens": tokens,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": p(ttft, 9),
            "tpot_p50_s": statistics.median(tpot), "tpot_p90_s": p(tpot, 9),
            "latency_p50_s": statistics.median(r["latency"] for r in results),
            "throughput_tok_s": tokens / span, "tokens_per_forward": generated / forwards if forwards else 0.0}


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from prove_jax import assets
    from prove_jax.checkpoints.checkpoint import load_tokenizer, save_model
    from prove_jax.decoding.requests import encode_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.report import cpu_description
    from prove_jax.evaluation import humaneval

    tok = load_tokenizer(assets.DEMO_PROPOSER)
    records = humaneval.prompt_records(humaneval.load_problems())
    ids = encode_prompts(records, tok)
    max_prompt = 256
    pool = [r["prompt"] for r, i in zip(records, ids) if len(i) <= max_prompt]
    model, tmp = assets.DEMO_PROPOSER, None
    if args.inflate:
        tmp = tempfile.mkdtemp(prefix="bench-serve-")
        pair = load_pair(assets.DEMO_PROPOSER, inflate_to=args.inflate)
        model = os.path.join(tmp, "proposer")
        print(f"saving the inflated proposer to {model} ...", file=sys.stderr, flush=True)
        save_model(model, pair.proposer, tokenizer_dir=assets.DEMO_PROPOSER)
        del pair
    levels, texts = {}, {}
    alone = None  # the first mode's mean latency of one request alone: the offered load's scale
    try:
        for mode in args.modes:
            for c in args.concurrency:
                n = args.requests or max(4, 2 * c)
                prompts = [pool[i % len(pool)] for i in range(n)]
                print(f"{mode} c={c}: starting a {c}-row server ...", file=sys.stderr, flush=True)
                proc, url, _ = start_server(model, mode, c, args, max_prompt)
                try:
                    one_request(url, pool[-1], args.max_tokens)  # the programs' first run
                    if alone is None:
                        alone = statistics.mean(one_request(url, pool[-1 - k], args.max_tokens)["latency"]
                                                for k in range(2))
                    interval = alone / (c * args.load)
                    f0, g0 = metric(url, "proposer_forwards_total"), metric(url, "generated_tokens_total")
                    results = run_level(url, prompts, interval, args)
                    forwards = metric(url, "proposer_forwards_total") - f0
                    generated = metric(url, "generated_tokens_total") - g0
                finally:
                    proc.terminate()
                    proc.wait(timeout=120)
                levels[f"{mode} c={c}"] = summarize(results, interval, forwards, generated) | {"mode": mode,
                                                                                               "concurrency": c}
                texts[(mode, c)] = [r["text"] for r in results]
                print(json.dumps(levels[f"{mode} c={c}"]), file=sys.stderr, flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    base = args.modes[0]
    agree = {f"{m} c={c}": texts[(m, c)] == texts[(base, c)][: len(texts[(m, c)])]
             for m in args.modes for c in args.concurrency}
    for key, same in agree.items():
        levels[key]["same_text_as_" + base] = same
    meta = {"inflated_to": args.inflate, "max_tokens": args.max_tokens, "load": args.load, "lossless": f"K={args.block_size},G={args.groups}",
            "alone_latency_s": alone, "cpu": cpu_description(),
            "jax": jax.__version__, "backend": jax.default_backend()}
    name = "serve" if not args.inflate else f"serve_{args.inflate.split('-')[-1]}_shape"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"meta": meta, "levels": levels}, f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(report(meta, levels))
    print(report(meta, levels))
    return 0


def report(meta: dict, levels: dict) -> str:
    shape = f"the shipped proposer inflated to the {meta['inflated_to']} shape" if meta["inflated_to"] \
        else "the shipped demo proposer at its own size (4M parameters)"
    lines = [f"# Serving latency (`benchmarks/bench_serve.py`)", "",
             f"`prove-jax serve` on loopback, {shape}, {meta['backend'].upper()} ({meta['cpu']}), greedy, max_tokens "
             f"{meta['max_tokens']}, lossless {meta['lossless']}; a server with c rows per level, driven open-loop "
             f"(one request every {meta['alone_latency_s']:.2f}/({meta['load']:g} c) s: the first mode's latency "
             f"alone over {meta['load']:g} c). "
             f"TTFT: arrival to first text; TPOT: (last - first text) / (tokens - 1).", "",
             "| mode | c | requests | TTFT p50 (s) | TTFT p90 (s) | TPOT p50 (ms) | TPOT p90 (ms) | latency p50 (s) "
             "| tok/s | tokens/forward | same text |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, v in levels.items():
        same = [x for k, x in v.items() if k.startswith("same_text_as_")]
        lines.append(f"| {v['mode']} | {v['concurrency']} | {v['requests']} | {v['ttft_p50_s']:.3f} | "
                     f"{v['ttft_p90_s']:.3f} | {1000 * v['tpot_p50_s']:.1f} | {1000 * v['tpot_p90_s']:.1f} | "
                     f"{v['latency_p50_s']:.2f} | {v['throughput_tok_s']:.0f} | {v['tokens_per_forward']:.2f} | "
                     f"{'yes' if same and same[0] else 'no'} |")
    modes = list(dict.fromkeys(v["mode"] for v in levels.values()))
    if len(modes) > 1:
        lines += ["", f"TPOT p50 of {modes[0]} over that of each other mode (above 1: the other is faster per "
                      f"token), and throughput against {modes[0]}'s, per concurrency:", ""]
        for c in sorted({v["concurrency"] for v in levels.values()}):
            base = levels.get(f"{modes[0]} c={c}")
            for m in modes[1:]:
                other = levels.get(f"{m} c={c}")
                if base and other and other["tpot_p50_s"]:
                    lines.append(f"- c={c}: {m} {base['tpot_p50_s'] / other['tpot_p50_s']:.2f}x per token, "
                                 f"{other['throughput_tok_s'] / base['throughput_tok_s']:.2f}x the throughput")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
