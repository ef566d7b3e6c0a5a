"""Fine-tuning starts from an HF checkpoint converted on the fly: the first step's loss equals
transformers' loss of the same batch (outside oracle), and MARS grows the vocabulary when the
tokenizer has no spare embedding row for `<|mask|>`."""

from __future__ import annotations

import numpy as np
import torch

from prove_jax.checkpoints import checkpoint
from prove_jax.training.loop import train
from tests.hf_models import make_hf_qwen2, torch_loss
from tests.train_helpers import first_batch, tiny_config



def test_ar_finetune_from_hf_dir_starts_at_transformers_loss(tmp_path):
    hf = make_hf_qwen2(tmp_path / "hf", vocab_size=320, eos_token_id=0, pad_token_id=0)
    cfg = tiny_config(tmp_path, "ft", objective="ar", steps=2, save_every=2,
                      model={"hf_dir": str(tmp_path / "hf")})
    result = train(cfg, show_bar=False)
    np.testing.assert_allclose(result.records[0]["loss"], torch_loss(hf, first_batch(cfg)), rtol=2e-5)
    assert result.records[-1]["loss"] < result.records[0]["loss"]
    assert checkpoint.load_model(result.model_dir).cfg.mask_token_id is None  # AR: vocab untouched


def test_mars_from_hf_dir_grows_vocab_for_mask_token(tmp_path):
    make_hf_qwen2(tmp_path / "hf", vocab_size=300, eos_token_id=0, pad_token_id=0)
    cfg = tiny_config(tmp_path, "mars", objective="mars", steps=1, save_every=1,
                      model={"hf_dir": str(tmp_path / "hf")})
    result = train(cfg, show_bar=False)  # the tokenizer's 300 ids fill all 300 rows
    model = checkpoint.load_model(result.model_dir)
    assert model.cfg.mask_token_id == 300 and model.cfg.vocab_size == 320
    tok = checkpoint.load_tokenizer(result.model_dir)
    assert tok.convert_tokens_to_ids("<|mask|>") == 300
    assert np.isfinite(result.records[0]["loss"])


def test_a_bfloat16_checkpoint_trains_float32_master_weights(tmp_path):
    """A bfloat16 HF checkpoint without model.param_dtype trains float32 weights and float32
    Adam moments (in bfloat16, updates at a fine-tuning learning rate round away); an explicit
    bfloat16 choice is kept and warned about in the log."""
    import jax
    hf = make_hf_qwen2(tmp_path / "f32", vocab_size=320, eos_token_id=0, pad_token_id=0)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))

    def float_dtypes(tree):
        return {str(x.dtype) for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.floating)
                or str(x.dtype) == "bfloat16"}

    for chosen, want in ((None, "float32"), ("bfloat16", "bfloat16")):
        model = {"hf_dir": str(tmp_path / "hf")} | ({"param_dtype": chosen} if chosen else {})
        cfg = tiny_config(tmp_path, f"run_{want}", objective="ar", steps=1, save_every=1, model=model)
        logs = []
        result = train(cfg, log=logs.append, show_bar=False)
        assert float_dtypes(result.state["params"]) == {want}
        assert float_dtypes(result.state["opt_state"]) == {want}
        warned = [line for line in logs if "model.param_dtype=bfloat16" in line]
        assert len(warned) == (chosen is not None), logs
