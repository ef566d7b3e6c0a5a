"""`prove-jax serve` through the official `openai` client on loopback: one server for the
module (the shipped demo proposer, lossless K=4, 4 rows), its answers checked against the
offline engine in this process (greedy AR for lossless, `generate` with the same seed for
sampling). Then many streaming clients at once, a client that goes away, bad requests, and
SIGTERM (last: it stops the server)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from prove_jax import assets
from prove_jax.decoding import DecodeOptions, SamplingParams
from prove_jax.decoding.loading import build_decoder
from tests.xla_flags import xla_flags

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 16
LONG = 96  # the server's --max-new-tokens: room for a request still running when its client leaves
ROWS = 4
PROMPTS = [f"def {name}(x):\n    " for name in (
    "add", "sub", "mul", "div", "mean", "median", "parse", "load", "save", "read", "write", "fetch", "merge",
    "split", "join", "sort", "find", "count", "clean", "check", "build", "render", "encode", "decode",
    "compress", "hash", "copy", "move", "scale", "rotate", "flip", "trim")]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metric(url: str, name: str) -> float:
    text = _get(url + "/metrics")[1]
    return float(re.search(rf"^prove_jax_{name} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def server():
    """(process, base URL): the server starts compiling while this process builds its oracles.
    --sampling temperature: no vocabulary sort in its step (the default's top-p/top-k cost it
    3x per step on this CPU, where the suite's time is tight)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(devices=1))
    proc = subprocess.Popen([sys.executable, "-m", "prove_jax", "serve", "--port", "0", "--mode", "lossless",
                             "--block-size", "4", "--batch-size", str(ROWS), "--max-prompt-tokens", "64",
                             "--max-new-tokens", str(LONG), "--chunk-steps", "2", "--logprobs", "3",
                             "--sampling", "temperature", "--shutdown-timeout", "3"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = None
    for line in proc.stderr:  # the first line names the address
        found = re.search(r"on (http://\S+)", line)
        if found:
            url = found.group(1)
            break
    assert url is not None, "the server printed no address"
    lines = []  # the rest of its log, read as it comes (a full pipe would stall the server)
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    proc.log = lines
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def oracle():
    """Greedy AR (the lossless reference) and lossless `generate` (the sampling reference) in
    this process, on one device, with the tokenizer the server uses."""
    ar, tok = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"), mesh_shape="1,1,1")
    return ar, tok


@pytest.fixture(scope="module")
def ready(server, greedy, sampled):
    """The server once /health answers 200 (503 until every program is compiled)."""
    proc, url = server
    codes = set()
    deadline = time.time() + 600
    while time.time() < deadline:
        assert proc.poll() is None, "".join(proc.log)
        code, _ = _get(url + "/health")
        codes.add(code)
        if code == 200:
            break
        time.sleep(0.2)
    assert codes <= {200, 503} and 200 in codes, codes
    return url


@pytest.fixture(scope="module")
def client(ready):
    return openai.OpenAI(base_url=ready + "/v1", api_key="unused", max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "def add(a, b):"}]


def _chat_ids(tok) -> list[int]:
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


SAMPLED = SamplingParams(temperature=0.9, seed=11, max_new_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def greedy(oracle):
    """Greedy AR's completion (ids, text) of every prompt, MAX_TOKENS new tokens, and last of
    the chat prompt CHAT through the template (one call: one compile)."""
    ar, tok = oracle
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS] + [_chat_ids(tok)]
    out = ar.generate(ids, MAX_TOKENS, batch_size=8).output_ids
    return [(o, tok.decode(o, skip_special_tokens=True)) for o in out]


@pytest.fixture(scope="module")
def sampled(oracle):
    """Lossless `generate`'s text of PROMPTS[1] sampled with SAMPLED (its seed)."""
    ar, tok = oracle
    lossless = ar.with_options(DecodeOptions("lossless", block_size=4))
    out = lossless.generate([tok.encode(PROMPTS[1], add_special_tokens=False)], MAX_TOKENS, params=SAMPLED)
    return tok.decode(out.output_ids[0], skip_special_tokens=True)


def test_bad_settings_fail_in_one_line_before_anything_loads(capsys):
    """Exit 2 and one `error:` line, before a port is taken or a weight read."""
    from prove_jax.cli import serve
    for argv, words in ((["--model", "/nonexistent"], "no such checkpoint directory"),
                        (["--max-prompt-tokens", "2000", "--max-new-tokens", "100"], "2048 positions"),
                        (["--temperature", "0.5", "--sampling", "greedy"], "--sampling full or temperature")):
        assert serve.main(argv + ["--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)


def test_health_models_and_metrics(ready, client):
    assert _get(ready + "/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))
    assert [m.id for m in client.models.list().data] == ["proposer"]
    text = _get(ready + "/metrics")[1]
    for name in ("requests_total", "queue_depth", "decode_steps_total", "tokens_per_forward_bucket",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_sum"):
        assert f"prove_jax_{name}" in text, name


def test_lossless_through_the_server_is_greedy_ar(client, greedy, oracle):
    """Completions, streamed and not, and chat (through the chat template): AR's text and token
    count; the streamed pieces add up to the non-streamed text; logprobs are those of the
    tokens returned (greedy: each is its position's most likely)."""
    ids, text = greedy[0]
    r = client.completions.create(model="proposer", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=2)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(ids)
    assert r.choices[0].finish_reason == ("stop" if ids[-1] in oracle[0].eos_ids else "length")
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and "".join(lp.tokens).startswith(text)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 2 and chosen == pytest.approx(max(top.values()), abs=1e-5)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="proposer", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stream=True)]
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1  # more than one piece

    want = greedy[-1][1]
    r = client.chat.completions.create(model="proposer", messages=CHAT, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(_chat_ids(oracle[1]))
    content = client.chat.completions.create(model="proposer", messages=CHAT, max_tokens=MAX_TOKENS, logprobs=True,
                                             top_logprobs=2).choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-5) for e in content)
    chunks = list(client.chat.completions.create(model="proposer", messages=CHAT, max_tokens=MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings_and_sampling_match_generate(client, greedy, sampled):
    """A stop string cuts the completion where AR's text holds it (streamed too); a seeded
    sampled request repeats itself and equals lossless `generate` with that seed."""
    _, text = next(g for g in greedy if len(g[1].strip()) > 6)
    prompt = PROMPTS[[g[1] for g in greedy].index(text)]
    stop = text.strip()[3:6]
    cut = text[: text.index(stop)]
    r = client.completions.create(model="proposer", prompt=prompt, max_tokens=MAX_TOKENS, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="proposer", prompt=prompt, max_tokens=MAX_TOKENS, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut

    got = [client.completions.create(model="proposer", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                     temperature=SAMPLED.temperature, seed=SAMPLED.seed).choices[0].text
           for _ in range(2)]
    assert got == [sampled, sampled] and sampled != greedy[1][1]


def test_32_streaming_clients_at_once_get_their_own_completions(ready, client, greedy):
    """More clients than rows: all join the running batch between chunks, each gets its own
    prompt's AR completion, nothing recompiles, and the whole lot takes a few seconds."""
    compiled = _metric(ready, "compiled_programs")

    def one(i):
        return "".join(c.choices[0].text for c in client.completions.create(
            model="proposer", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, stream=True))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(one, range(len(PROMPTS))))
    seconds = time.perf_counter() - start
    assert texts == [t for _, t in greedy[: len(PROMPTS)]]
    assert _metric(ready, "compiled_programs") == compiled
    assert seconds < 30, f"{len(PROMPTS)} streamed requests took {seconds:.1f}s"


def test_a_client_that_goes_away_frees_its_row(ready):
    """A streamed request dropped after its first event is cancelled: its row frees long before
    its budget would have run out."""
    host, port = ready.removeprefix("http://").split(":")
    before = _metric(ready, "requests_cancelled_total")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "proposer", "prompt": PROMPTS[2],
                                                        "max_tokens": LONG, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline and not (_metric(ready, "requests_cancelled_total") > before
                                          and _metric(ready, "running_requests") == 0):
        time.sleep(0.05)
    assert _metric(ready, "requests_cancelled_total") == before + 1
    assert _metric(ready, "running_requests") == 0


def test_bad_requests_get_openai_errors_and_disturb_nothing(ready, client, greedy):
    """Each refusal is an OpenAI error object naming its field (400; 404 for an unknown model);
    a request streaming meanwhile is unaffected."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: "".join(c.choices[0].text for c in client.completions.create(
            model="proposer", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, stream=True)))
        cases = [(dict(n=2), "n", "not supported"),
                 (dict(extra_body={"frobnicate": 1}), "frobnicate", "Unrecognized request argument"),
                 (dict(temperature=-1), "temperature", "temperature must be"),
                 (dict(max_tokens=LONG + 1), "max_tokens", "--max-new-tokens"),
                 (dict(prompt="x " * 200), "prompt", "--max-prompt-tokens"),
                 (dict(seed=2 ** 40), "seed", "seed must be"),
                 (dict(temperature=0.5, top_p=0.9), "top_p", "--sampling full")]
        for kwargs, param, words in cases:
            args = dict(model="proposer", prompt=PROMPTS[3], max_tokens=MAX_TOKENS) | kwargs
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(**args)
            assert e.value.status_code == 400 and e.value.param == param and words in e.value.message, kwargs
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="proposer", messages=[{"content": "no role"}], max_tokens=2)
        assert e.value.param == "messages"
        request = urllib.request.Request(ready + "/v1/completions", data=b"{not json", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"
        assert good.result(timeout=60) == greedy[3][1]


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(server, ready):
    """Last: SIGTERM stops accepting; a streamed request in flight finishes, or at the bound
    (--shutdown-timeout 3) ends with finish_reason "abort", either way with its [DONE]; the
    process exits 0 soon after."""
    proc, url = server
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "proposer", "prompt": PROMPTS[4],
                                                        "max_tokens": LONG, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest = response.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and re.search(r'"finish_reason": "(length|stop|abort)"', rest)
    assert proc.wait(timeout=60) == 0, "".join(proc.log)
    assert time.perf_counter() - start < 20
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)
