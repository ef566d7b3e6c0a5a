"""The host-driven loop (`Decoder.stream`) and the batch CLI built on it: outputs equal the
one-call engine's, tokens arrive before the job ends, a job killed with SIGKILL continues
where it stopped, and `--prompt` prints a completion as it is committed."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from prove_jax import assets
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.cli import generate
from prove_jax.decoding import DecodeOptions, Decoder, SamplingParams
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, ROOT


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


def _requests(n, seed=0):
    rs = np.random.RandomState(seed)
    prompts = [rs.randint(2, 90, int(k)).tolist() for k in rs.randint(1, 40, n)]
    budgets = [int(b) for b in rs.randint(2, 40, n)]
    return prompts, budgets


@pytest.mark.parametrize("mode,k,batch,chunk", [("ar", 1, 3, 4), ("lossless", 4, 4, 1), ("lossless", 3, 2, 64),
                                                ("verify", 4, 3, 5)])
def test_the_stream_gives_the_one_call_engines_outputs(model, mode, k, batch, chunk):
    """Mixed prompt and output lengths, rows refilled between chunks in batched admissions:
    the same tokens, finish reasons and per-request counters as `generate`; the yielded pieces
    add up to each output."""
    prompts, budgets = _requests(11)
    params = [SamplingParams(max_new_tokens=b) for b in budgets]
    dec = Decoder(model, [1], DecodeOptions(mode, k, record_steps=True), verifier=model if mode == "verify" else None)
    want = dec.generate(prompts, 40, batch_size=batch, params=params)
    stream = dec.stream(prompts, 40, batch_size=batch, params=params, chunk_steps=chunk)
    pieces, outputs = {}, {}
    for event in stream:
        pieces.setdefault(event.index, []).extend(event.new_ids)
        assert event.blocks is not None and sum(event.blocks) == len(event.new_ids)
        if event.output is not None:
            assert event.index not in outputs  # finished once
            outputs[event.index] = event.output
    assert [outputs[i].output_ids for i in range(len(prompts))] == want.output_ids
    assert [pieces[i] for i in range(len(prompts))] == want.output_ids
    assert [outputs[i].finish_reason for i in range(len(prompts))] == want.finish_reasons
    assert [outputs[i].forwards for i in range(len(prompts))] == want.forwards.tolist()
    assert [outputs[i].step_commits for i in range(len(prompts))] == want.step_commits
    assert stream.chunks > 1 and stream.seconds > 0


def test_the_stream_yields_tokens_before_the_job_ends(model):
    prompts, _ = _requests(6, seed=1)
    stream = Decoder(model, [-1], DecodeOptions("lossless", 4)).stream(prompts, 30, batch_size=2, chunk_steps=2)
    finished = set()
    first_tokens_while = None
    for event in stream:
        if event.new_ids and first_tokens_while is None:
            first_tokens_while = len(finished)
        if event.output is not None:
            finished.add(event.index)
    assert first_tokens_while == 0 and len(finished) == 6  # tokens came before any request finished


def _cli(*args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "prove_jax", "generate", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


def test_a_job_killed_with_sigkill_continues_where_it_stopped(tmp_path, model, capsys):
    """The rerun of the same command skips the records already written and cuts a torn line;
    the finished file holds the records of an uninterrupted run (any order). Only the killed
    job needs a process of its own: the uninterrupted run and the rerun call the command here."""
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model)
    prompts, budgets = _requests(40, seed=2)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p, "max_new_tokens": b}) + "\n"
                           for i, (p, b) in enumerate(zip(prompts, budgets))))
    common = ["--model", ckpt, "--input", str(inp), "--max-new-tokens", "40", "--batch-size", "2",
              "--chunk-steps", "1", "--no-progress"]
    full, killed = tmp_path / "full.jsonl", tmp_path / "killed.jsonl"
    assert generate.main([*common, "--output", str(full)]) == 0
    job = _cli(*common, "--output", str(killed))
    deadline = time.time() + 300
    while time.time() < deadline and (not killed.exists() or len(killed.read_text().splitlines()) < 5):
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    written = killed.read_text().splitlines()
    assert 5 <= len(written) < 40, "the kill came after the job ended: nothing to resume"
    with open(killed, "a") as f:
        f.write('{"id": "r9", "output_')  # as if the kill tore the next record
    capsys.readouterr()
    assert generate.main([*common, "--output", str(killed)]) == 0
    assert f"resuming: {len(written)} of 40 requests are already in" in capsys.readouterr().err
    records = lambda path: sorted(path.read_text().splitlines())  # noqa: E731
    assert len(records(killed)) == 40 and records(killed) == records(full)


def test_prompt_prints_the_completion_as_it_is_committed_with_blocks_marked(capsys):
    """--prompt with the shipped pair: stdout is the completion, [...] around each committed
    block off a terminal; its text equals the batch path's record."""
    text = "def add(a, b):\n"
    code = generate.main(["--prompt", text, "--max-new-tokens", "24", "--show-blocks", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    blocks = out.rstrip("\n").split("][")
    assert len(blocks) >= 3 and out.startswith("[") and "tokens/forward" in err
    from prove_jax.checkpoints.checkpoint import load_tokenizer
    from prove_jax.decoding.loading import build_decoder
    dec, tok = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"))
    want = tok.decode(dec.generate([tok.encode(text, add_special_tokens=False)], 24).output_ids[0],
                      skip_special_tokens=True)
    assert out.rstrip("\n")[1:-1].replace("][", "") == want
    assert load_tokenizer(assets.DEMO_PROPOSER) is not None


def test_decode_seconds_leave_out_the_compile_inside_the_loop(model):
    """A fresh decoder compiles its programs inside the stream's timed spans: decode seconds
    plus compile seconds fit in the wall time of the whole iteration."""
    prompts, _ = _requests(5, seed=4)
    stream = Decoder(model, [-1], DecodeOptions("lossless", 3)).stream(prompts, 12, batch_size=2, chunk_steps=3)
    start = time.perf_counter()
    for _ in stream:
        pass
    wall = time.perf_counter() - start
    assert stream.compile_seconds > 0 and stream.seconds > 0
    assert stream.seconds + stream.compile_seconds <= wall


def test_a_stop_string_ends_the_request_in_the_chunk_that_found_it_and_counts_what_it_returns():
    """The record counts the tokens it returns and the forwards that committed them (oracle:
    the per-forward commits of the same request decoded without the stop); the request
    finishes at the end of the chunk whose steps found the stop, and its row takes the next
    request then."""
    from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer
    from prove_jax.decoding.request_run import RequestStream
    demo, tok = load_model(assets.DEMO_PROPOSER), load_tokenizer(assets.DEMO_PROPOSER)
    dec = Decoder(demo, [tok.eos_token_id], DecodeOptions("lossless", 4, record_steps=True))
    prompt = tok.encode("def parse(text):\n    ", add_special_tokens=False)
    free = dec.generate([prompt], 48)
    ids, commits = free.output_ids[0], free.step_commits[0]
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 3: len(text) // 3 + 3]
    chunk = 2
    job = RequestStream(dec, [prompt, prompt], 48, 1, tokenizer=tok, chunk_steps=chunk,
                        params=[SamplingParams(stop=(stop,)), SamplingParams(max_new_tokens=4)])
    results = {}
    for event, result in job:
        if result is not None:
            results[event.index] = (result, job.stream.chunks)
    (cut, chunks_then), (second, _) = results[0], results[1]
    kept = len(cut.output_ids)
    forwards = next(f for f in range(1, len(commits) + 1) if sum(commits[:f]) >= kept)
    assert cut.text == text[: text.index(stop)] and kept < len(ids)
    assert cut.stats["generated_tokens"] == kept and cut.stats["proposer_forwards"] == forwards
    assert cut.stats["tokens_per_forward"] == kept / forwards
    assert chunks_then == -(-forwards // chunk)  # no chunk ran after the one that found it
    assert second.output_ids == dec.generate([prompt], 4).output_ids[0]
    summary = job.summary([cut, second])
    assert summary["generated_tokens"] == kept + len(second.output_ids)
