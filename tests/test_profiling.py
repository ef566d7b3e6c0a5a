"""`--profile DIR`: a jax.profiler trace of the steps after warm-up, named for the step."""

import jax
import jax.numpy as jnp
import pytest

from prove_jax.profiling import StepProfile, trace_files


def test_the_trace_holds_the_steps_after_warm_up(tmp_path):
    @jax.jit
    def decode_like(x):
        return jnp.tanh(x @ x)

    x = jnp.ones((64, 64))
    with StepProfile(str(tmp_path), "decode_chunk", warmup=2, steps=2) as profile:
        for _ in range(6):
            with profile.step(sync=lambda: x.block_until_ready()):
                x = decode_like(x)
            assert profile.active == (profile.count == 3)  # started at the 3rd step, stopped after the 4th
    (trace,) = trace_files(str(tmp_path))
    data = open(trace, "rb").read()
    assert b"decode_chunk" in data  # the step annotation: xprof's step view splits on it
    assert b"decode_like" in data  # the compiled program, by its jit name
    assert profile.traced == 2


def test_no_directory_profiles_nothing_and_a_file_is_refused(tmp_path):
    profile = StepProfile(None, "train_step")
    with profile.step():
        pass
    assert not profile.active and profile.count == 0
    bad = tmp_path / "file"
    bad.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        StepProfile(str(bad), "train_step")


def test_generate_profile_traces_decode_chunks(tmp_path):
    """`generate --profile DIR`: the trace names the decode chunks it holds, after warm-up."""
    import json

    from prove_jax.cli import generate
    inp, out, trace = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "trace"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4, 5]}) + "\n")
    assert generate.main(["--mode", "ar", "--input", str(inp), "--output", str(out), "--max-new-tokens", "24",
                          "--chunk-steps", "2", "--mesh", "1,1,1", "--profile", str(trace)]) == 0
    (path,) = trace_files(str(trace))
    data = open(path, "rb").read()
    assert b"decode_chunk" in data and b"run_chunk" in data


def test_train_profile_traces_train_steps(tmp_path):
    """`train --profile DIR`: the trace names the train steps it holds, after warm-up."""
    from prove_jax.training.loop import train
    from tests.train_helpers import tiny_config
    cfg = tiny_config(tmp_path, steps=3, save_every=3, log_every=3)  # 2 warm-up steps, 1 traced
    train(cfg, show_bar=False, profile=str(tmp_path / "trace"))
    (path,) = trace_files(str(tmp_path / "trace"))
    assert b"train_step" in open(path, "rb").read()
