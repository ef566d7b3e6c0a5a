"""--dry-run: the paper's 32B proposer config lowers for TPU on an abstract 256-chip v5p mesh
without allocating weights and fits; the same model on 4 chips does not fit."""

from __future__ import annotations

import os

import pytest

from prove_jax import aot
from prove_jax.training.dry_run import DryRunError, GIB, dry_run
from prove_jax.training.config import load_config
from train.train import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROPOSER = os.path.join(REPO, "configs", "proposer_qwen2.5_32b_v5p.yaml")


def test_proposer_32b_fits_v5p_pod():
    # one lowering of the 64-layer step (tens of seconds here); the CLI prints describe(),
    # and the CLI path itself is the next test's
    report = dry_run(load_config(PROPOSER), chip="v5p", compile=False)
    out = report.describe()
    assert "lowered for TPU: ok" in out and "FITS" in out and "DOES NOT FIT" not in out
    # 32.8e9 float32 params over fsdp 64 x tensor 4 = 256 shards; Adam keeps two moments
    assert report.devices == 256 and report.micro_batch_per_device == 6
    assert report.streamed_length == 1024  # MARS doubles the 512-token sequence
    assert abs(report.param_bytes - 32.76e9 * 4 / 256) / report.param_bytes < 0.02
    assert abs(report.opt_bytes - 2 * report.param_bytes) / report.opt_bytes < 0.01
    assert report.fits and report.total_bytes < 0.9 * 95 * GIB


def test_too_small_mesh_does_not_fit(capsys):
    assert main(["--config", PROPOSER, "--dry-run", "--no-compile", "mesh=[1,4,1]"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out
    # parameters alone: 131 GB of float32 over 4 chips > 95 GiB of HBM
    assert "parameters      30.5" in out or "parameters      30.6" in out, out


def test_dry_run_needs_a_known_chip_and_explicit_mesh(capsys):
    cfg = load_config(PROPOSER, ["mesh=[1,-1,4]"])
    with pytest.raises(DryRunError, match="explicit mesh"):
        dry_run(cfg)
    assert main(["--config", PROPOSER, "--dry-run", "--chip", "tpu9"]) == 2
    assert "error: unknown chip 'tpu9'" in capsys.readouterr().err


def test_activation_estimate_counts_replicated_dimensions_whole():
    """sharding.logical_to_spec replicates a dimension the tensor axis does not divide, so such
    activations are whole on every device: the estimate must not divide them either."""
    from prove_jax.models.config import ModelConfig
    from prove_jax.training.dry_run import activation_bytes
    odd = ModelConfig(vocab_size=101, hidden_size=40, intermediate_size=75, num_layers=2, num_heads=5,
                      num_kv_heads=5, head_dim=8)
    assert activation_bytes(odd, 2, 64, tensor=2, remat=False) == activation_bytes(odd, 2, 64, tensor=1, remat=False)
    even = odd.replace(vocab_size=100, intermediate_size=80, num_heads=4, num_kv_heads=4)
    assert activation_bytes(even, 2, 64, tensor=2, remat=False) < activation_bytes(even, 2, 64, tensor=1, remat=False)


def test_dry_run_counts_the_gradient_sum_of_accumulation(tmp_path):
    """With grad_accum > 1 the step holds one micro-batch's gradients and their float32 running
    sum at once: with float32 parameters that is twice the gradient bytes of grad_accum = 1."""
    from tests.train_helpers import tiny_config
    one = dry_run(tiny_config(tmp_path, target_chip="v5e"))
    two = dry_run(tiny_config(tmp_path, overrides=["optimizer.grad_accum=2"], target_chip="v5e"))
    assert one.grad_bytes == one.param_bytes > 0
    assert two.grad_bytes == 2 * one.grad_bytes and two.param_bytes == one.param_bytes


VERIFIER = os.path.join(REPO, "configs", "verifier_qwen2.5_3b.yaml")
COMMIT_HEAD = ["objective=commit_head", "proposer=runs/qwen32b-mars/model",
               "model.checkpoint=runs/verifier-3b/model"]  # docs/training.md's recipe: not on this machine


def test_commit_head_recipe_fits_its_v5p_slice(capsys):
    """The 32B proposer and 3B verifier, frozen in float32, on the verifier's 16-chip mesh: the
    commit-head step lowers for TPU and both models are counted from their shards."""
    report = dry_run(load_config(VERIFIER, COMMIT_HEAD))
    out = report.describe()
    assert "commit head on a 32.76B proposer and a 3.09B verifier" in out
    assert "commit-head step lowered for TPU: ok" in out and "FITS" in out and "DOES NOT FIT" not in out
    assert report.devices == 16 and report.micro_batch_per_device == 16
    assert abs(report.frozen_bytes - (32.76e9 + 3.09e9) * 4 / 16) / report.frozen_bytes < 0.02
    assert report.param_bytes == report.grad_bytes < 1e6  # the head: (2048 + 3) x 64 + ...
    assert 0 <= report.opt_bytes - 2 * report.param_bytes < 64  # Adam's two moments and its count
    assert 0 < report.activation_bytes < 8 * GIB and report.fits
    # without the proposer's checkpoint or its shapes there is nothing to count
    assert main(["--config", VERIFIER, "--dry-run", *COMMIT_HEAD, "proposer_shape_preset=null"]) == 2
    assert ("error: the proposer checkpoint runs/qwen32b-mars/model is not on this machine: set "
            "proposer_shape_preset") in capsys.readouterr().err


def test_commit_head_on_too_few_chips_does_not_fit(capsys):
    # 35.9B float32 parameters over 2 chips: 66.8 GiB each, and the forwards: over 90% of 95 GiB
    assert main(["--config", VERIFIER, "--dry-run", *COMMIT_HEAD, "mesh=[1,2,1]"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "frozen models   66.78 GiB" in out, out


# ---- the real compile for a TPU slice (libtpu, optional) ------------------------------------

def test_collectives_are_counted_from_compiled_hlo():
    hlo = """
  %all-gather-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %p), channel_id=1
  %all-gather-done = bf16[16,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[16,8]{1,0}) %all-gather-start)
  %reduce-scatter.3 = f32[256]{0:T(256)} reduce-scatter(f32[1024]{0} %g), channel_id=2, dimensions={0}
  ROOT %all-reduce = f32[] all-reduce(f32[] %loss), channel_id=3, to_apply=%add
  %fusion = f32[8] fusion(f32[8] %all-reduce.1), kind=kLoop
"""
    counts = aot.collective_counts(hlo)
    assert counts["all-gather"] == {"count": 1, "bytes": 4 * 8 * 2 + 16 * 8 * 2}
    assert counts["reduce-scatter"] == {"count": 1, "bytes": 256 * 4}
    assert counts["all-reduce"] == {"count": 1, "bytes": 4}
    assert aot.topology_name("v5p", 256) == "v5p:4x8x8" and aot.topology_name("v6e", 8) == "v6e:2x4"
    with pytest.raises(ValueError, match="not 6"):
        aot.topology_name("v5p", 6)


def test_without_libtpu_the_dry_run_says_it_is_an_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [f"run_dir={tmp_path}/r", "mesh=[1,4,1]"])
    report = dry_run(cfg, chip="v5p")
    assert report.compiled is None and "libtpu is not installed" in report.describe()


needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu not installed (optional: docs/environment.md)")


@needs_libtpu
def test_a_small_step_compiles_for_a_v5p_slice(tmp_path):
    """XLA's own numbers for 4 v5p chips: the arguments hold at least the exact parameter and
    optimizer shards, and FSDP over 4 chips gathers weights and reduces gradients."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [f"run_dir={tmp_path}/r", "mesh=[1,4,1]"])
    report = dry_run(cfg, chip="v5p")
    c = report.compiled
    assert c is not None and c.topology == "v5p:2x2x1" and c.compile_seconds > 0
    assert c.argument_bytes >= report.param_bytes + report.opt_bytes
    assert c.peak_bytes >= c.argument_bytes and report.compiled_fits
    assert c.collectives["all-gather"]["count"] > 0
    assert c.collectives["reduce-scatter"]["count"] + c.collectives["all-reduce"]["count"] > 0
    assert "compiled for v5p:2x2x1" in report.describe()


@pytest.mark.slow
@needs_libtpu
def test_proposer_32b_compiles_for_its_v5p_slice_and_fits():
    """The paper's proposer step compiled for 256 v5p chips (minutes): XLA's peak per chip fits."""
    report = dry_run(load_config(PROPOSER), chip="v5p")
    c = report.compiled
    assert c is not None and c.topology == "v5p:4x8x8"
    assert c.argument_bytes >= report.param_bytes + report.opt_bytes
    assert report.compiled_fits, report.describe()


def test_a_step_too_large_for_the_chip_is_one_error_with_xlas_numbers():
    """libtpu refuses a program that needs more HBM than a chip has (remat none at 32B on v5p:
    103.7 GiB of temporaries): the dry run says so in one line, no traceback."""
    import jax

    from prove_jax.errors import ProveJaxError
    from prove_jax import aot

    class Lowered:
        def compile(self):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                                             "required for HLO temporaries (103.68G) exceeds available HBM "
                                             "(95.74G).\nmore lines")
    with pytest.raises(aot.DoesNotFit, match=r"does not fit a chip of v5p:4x8x8: XLA: RESOURCE_EXHAUSTED.*103.68G"
                                             r".*model.remat=full") as info:
        aot.compile_stats(Lowered(), "v5p:4x8x8")
    assert isinstance(info.value, ProveJaxError) and "\n" not in str(info.value)
