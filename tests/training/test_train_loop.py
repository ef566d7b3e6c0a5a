"""training/loop.py: the run directory's checkpoint contract (the final step is saved, `keep`
newest are kept) and the logged loss's AR weight."""

from __future__ import annotations

import os

import numpy as np


def test_trainer_weights_the_ar_stream_saves_the_final_step_and_keeps_the_newest(tmp_path):
    """steps=3, save_every=2, keep=1: saves at 2 and at the final step 3 (which is not a multiple
    of save_every), keeps only 3; every logged loss is CE(masked) + ar_weight x CE(clean) with
    the configured ar_weight; the train state counts its updates."""
    from prove_jax.training.run_checkpoint import CHECKPOINT_DIR
    from prove_jax.training.loop import train
    from tests.train_helpers import tiny_config
    cfg = tiny_config(tmp_path, "mut", steps=3, save_every=2, keep=1, ar_weight=0.25, log_every=1,
                      global_batch_size=4)
    result = train(cfg, show_bar=False)
    assert [r["step"] for r in result.records] == [1, 2, 3]
    for r in result.records:
        np.testing.assert_allclose(r["loss"], r["loss_masked"] + 0.25 * r["loss_clean"], rtol=1e-5)
    saved = sorted(n for n in os.listdir(os.path.join(cfg.run_dir, CHECKPOINT_DIR)) if n.isdigit())
    assert saved == ["3"], saved
    assert int(result.state["step"]) == 3
