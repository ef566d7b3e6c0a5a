"""training/dry_run.py's memory estimate, term by term against what its docstring says is
kept (K/V per kv head, the three MLP arrays, three float32 vocab-wide arrays, one layer input
per layer with remat), its per-device batch, and the HBM headroom of `fits`."""

from __future__ import annotations

from prove_jax.training import dry_run as dr
from prove_jax.models.config import ModelConfig


BASE = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8)


ROWS, LENGTH = 2, 16


TOK = ROWS * LENGTH


def _act(cfg, remat=False):
    return dr.activation_bytes(cfg, ROWS, LENGTH, tensor=1, remat=remat)


def test_kv_heads_enter_only_through_k_and_v():
    """One kv head fewer drops K and V ([tokens, head_dim] each, float32) in every layer; the
    attention scores are per query head and do not change."""
    fewer = BASE.replace(num_kv_heads=1)
    assert _act(BASE) - _act(fewer) == BASE.num_layers * TOK * 4 * 2 * BASE.head_dim


def test_mlp_keeps_gate_up_and_their_product_and_the_loss_three_float32_vocab_arrays():
    wider = BASE.replace(intermediate_size=BASE.intermediate_size + 1)
    assert _act(wider) - _act(BASE) == BASE.num_layers * TOK * 4 * 3
    more_vocab = BASE.replace(vocab_size=BASE.vocab_size + 1)
    for dtype in ("float32", "bfloat16"):  # logits, softmax, gradient are float32 either way
        assert _act(more_vocab.replace(dtype=dtype)) - _act(BASE.replace(dtype=dtype)) == 3 * TOK * 4


def test_remat_keeps_one_layer_input_per_layer_in_the_compute_dtype():
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        cfg = BASE.replace(dtype=dtype)
        deeper = cfg.replace(num_layers=cfg.num_layers + 1)
        assert _act(deeper, remat=True) - _act(cfg, remat=True) == TOK * cfg.hidden_size * nbytes
    assert _act(BASE, remat=True) < _act(BASE, remat=False)


def test_dry_run_divides_by_accumulation_and_data_shards_and_splits_over_tensor(tmp_path):
    from tests.train_helpers import tiny_config
    cfg = tiny_config(tmp_path, mesh=[1, 4, 2], global_batch_size=16,
                      overrides=["optimizer.grad_accum=2"], target_chip="v5e")
    report = dr.dry_run(cfg)
    # 16 sequences / 2 micro-batches / (data 1 x fsdp 4) = 2 per device; MARS streams 2 x 32
    assert report.micro_batch_per_device == 2 and report.streamed_length == 64
    model_cfg = dr._model_config_for(cfg)
    by_tensor = {t: dr.activation_bytes(model_cfg, 2, 64, tensor=t, remat=cfg.model.remat) for t in (2, 4)}
    assert by_tensor[2] != by_tensor[4] and report.activation_bytes == by_tensor[2]


def test_fits_keeps_ten_percent_of_hbm_free_and_chips_are_named_in_any_case():
    hbm = dr.chip_hbm_bytes("V5P")
    assert hbm == dr.chip_hbm_bytes("v5p") == 95 * dr.GIB and dr.chip_hbm_bytes("h100") == 80 * dr.GIB

    def report(total):
        return dr.DryRunReport(chip="v5p", hbm_bytes=hbm, mesh={}, devices=1, model_params=1,
                               param_bytes=total, grad_bytes=0, opt_bytes=0, activation_bytes=0,
                               lowered=True, lower_seconds=0.0, micro_batch_per_device=1,
                               streamed_length=1)
    assert report(int(0.9 * hbm)).fits and not report(int(0.95 * hbm)).fits
    assert "DOES NOT FIT" in report(int(0.95 * hbm)).describe()
