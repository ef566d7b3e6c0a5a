"""`prove-jax generate --dry-run`: the decode program compiled for a TPU slice from this CPU.

Without libtpu: the program `Decoder.lower` gives is the one `generate` compiles and runs; the
slice's mesh is the inference mesh rule's; accelerator names and bad flags are one-line errors.
With libtpu (optional, docs/environment.md): a small model's whole program compiles for v5p-8
and reports XLA's memory and collectives, and a program too large for a chip is reported as
not fitting, with XLA's numbers, instead of a traceback.
"""

import importlib.util
import re

import numpy as np
import pytest

from prove_jax import aot
from prove_jax.cli import generate
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, MemoryLayout
from prove_jax.decoding.dry_run import dry_run_decode, mesh_shape, slice_options, SliceRun
from prove_jax.models.config import ModelConfig, preset
from prove_jax.models.params import create_model

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, mask_token_id=127, eos_token_ids=(1,))


@pytest.mark.parametrize("mode", ["ar", "lossless"])
def test_lower_gives_the_program_generate_runs(mode):
    decoder = Decoder(create_model(CFG, seed=0), [1], DecodeOptions(mode, 4))
    prompts = [[2, 3, 4], [5, 6, 7, 8, 9]]
    decoder.generate(prompts, 12, batch_size=2)
    ((_, ran),) = decoder.programs("run")
    assert _program(decoder.lower(prompts, 12, batch_size=2).compile().as_text()) == _program(ran.as_text())


def _program(hlo: str) -> str:
    """Compiled HLO without source locations (the two programs were traced from different lines)."""
    hlo = hlo.split("\nFileNames")[0]
    return re.sub(r", metadata=\{[^}]*\}", "", hlo)


def test_accelerator_types_count_chips_as_cloud_tpu_names_them():
    assert aot.accelerator_chips("v5p-8") == ("v5p", 4)  # TensorCores: two per chip
    assert aot.accelerator_chips("V6E-8") == ("v6e", 8)  # chips
    assert aot.accelerator_chips("v4-16") == ("v4", 8)
    for bad in ("v5p-7", "v6e", "h100-8", "v5p-x"):
        with pytest.raises(aot.UnknownChip, match="unknown TPU accelerator type"):
            aot.accelerator_chips(bad)


def test_the_slice_gets_the_inference_mesh_of_the_pair():
    """As `generate` would pick on the slice: tensor parallel over the 32B proposer's kv heads
    as far as the pair's bfloat16 weights (66 GiB) need to fit half a chip, data over the rest."""
    pair = [preset("qwen2.5-32b"), preset("qwen2.5-3b")]
    assert mesh_shape(pair, "bfloat16", 4, aot.chip_hbm_bytes("v5p")) == (2, 1, 2)
    assert mesh_shape(pair, "bfloat16", 8, aot.chip_hbm_bytes("v6e")) == (1, 1, 8)
    assert mesh_shape([preset("qwen2.5-0.5b")], "bfloat16", 8, aot.chip_hbm_bytes("v6e")) == (8, 1, 1)
    with pytest.raises(DecodeError, match="do not fit"):
        mesh_shape(pair, "float32", 4, aot.chip_hbm_bytes("v5e"))


def test_slice_options_are_the_accelerators_not_this_cpus():
    options = slice_options(DecodeOptions("lossless", 8))
    assert options.compute.platform == "tpu" and options.compute.matmul_form == "plain"
    assert options.memory.prefill_chunk == 256


def test_cli_errors_are_one_line(capsys, monkeypatch):
    common = ["--model", "qwen2.5-32b", "--dtype", "bfloat16"]
    assert generate.main(common + ["--dry-run", "v5p-7"]) == 2
    assert "error: unknown TPU accelerator type 'v5p-7'" in capsys.readouterr().err
    assert generate.main(["--model", "qwen9", "--dry-run", "v5p-8"]) == 2
    assert "--model qwen9: neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert generate.main(common + ["--dry-run", "v5p-8", "--mode", "verify"]) == 2
    assert "needs --verifier" in capsys.readouterr().err
    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    assert generate.main(common + ["--dry-run", "v5p-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and 'pip install "libtpu' in err[-1]  # "compiling ..." then the error
    with pytest.raises(SystemExit):  # without --dry-run a prompt source is still required
        generate.parse_args(["--model", "qwen2.5-32b"])
    assert "--input --prompt is required" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (docs/environment.md)")
def test_a_small_pair_compiles_for_v5p_8_and_reports_its_memory():
    verifier = CFG.replace(num_heads=2, num_kv_heads=1, mask_token_id=None)
    report = dry_run_decode(SliceRun(CFG, DecodeOptions("verify", 4, memory=MemoryLayout(scan_layers=True)), chip="v5p", chips=4, batch=8,
                            context=256, new_tokens=64, verifier=verifier))
    assert report.topology == "v5p:2x2x1" and report.mesh == {"data": 4, "fsdp": 1, "tensor": 1}
    stats = report.stats
    assert report.fits and 0 < stats.peak_bytes < report.hbm_bytes
    # the weights are whole on each chip (data parallel), so they are arguments of the program
    assert stats.argument_bytes >= report.weight_bytes
    assert report.weight_bytes == 2 * (CFG.num_params + verifier.num_params)  # bfloat16
    # nothing the size of a weight or a cache is gathered: only a few token ids at the end
    assert all(v["bytes"] < 2**20 for v in stats.collectives.values()), stats.collectives
    text = report.describe()
    assert "FITS" in text and "v5p:2x2x1" in text and "verify (K=4)" in text
    assert report.record()["peak_bytes"] == stats.peak_bytes
    assert report.rows == report.record()["rows"] == 8 and "(8 rows)" not in text  # as asked


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (docs/environment.md)")
def test_a_program_too_large_for_a_chip_is_reported_not_raised():
    big = CFG.replace(num_kv_heads=4, num_heads=4, head_dim=128, max_position_embeddings=1 << 17)
    report = dry_run_decode(SliceRun(big, DecodeOptions("ar"), chip="v5e", chips=1, batch=64, context=1 << 16,
                            new_tokens=64))
    assert report.stats is None and not report.fits
    assert "does not fit a chip of v5e:1x1" in report.does_not_fit and "RESOURCE_EXHAUSTED" in report.does_not_fit
    assert "DOES NOT FIT" in report.describe()
    assert np.isfinite(report.weight_bytes)


@pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu (docs/environment.md)")
def test_cli_compiles_a_checkpoints_program_and_prints_the_report(tmp_path, capsys):
    from prove_jax.checkpoints.checkpoint import save_model
    save_model(str(tmp_path / "p"), create_model(CFG, seed=0))
    rc = generate.main(["--model", str(tmp_path / "p"), "--mode", "lossless", "--block-size", "4",
                        "--dry-run", "v6e-4", "--batch-size", "4", "--context", "256",
                        "--max-new-tokens", "64", "--dtype", "bfloat16", "--scan-layers"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "v6e:2x2 (4 x v6e" in out and "layers scanned" in out and "FITS" in out
    assert "192 prompt + 64 new tokens" in out


def test_the_report_says_how_many_rows_the_program_decodes_when_not_the_batch():
    """A batch is rounded up to whole shards (12 -> 16 on v6e-8 with the 3B verifier,
    `Decoder.rows`): the memory is that of the rows, so the report names them."""
    from prove_jax.decoding.dry_run import DecodeDryRun
    report = DecodeDryRun(chip="v6e", chips=8, topology="v6e:2x4", mesh={"data": 1, "fsdp": 1, "tensor": 8},
                          options=DecodeOptions("verify", 16), batch=12, prompt_tokens=1536, new_tokens=512,
                          proposer_params=1, verifier_params=1, weight_bytes=1, hbm_bytes=1,
                          does_not_fit="XLA: RESOURCE_EXHAUSTED", rows=16)
    assert "batch 12 (16 rows)," in report.describe() and report.record()["rows"] == 16
    report.rows = 12
    assert "batch 12, 1536 prompt" in report.describe()
