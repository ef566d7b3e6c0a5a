"""training/batches.py: only MARS pads rows to a block with trained EOS, and data smaller than
one global batch is a warning."""

from __future__ import annotations


def test_only_mars_pads_rows_to_a_block_with_trained_eos(tmp_path):
    """The EOS padding up to a block multiple is MARS's (its mask stream predicts whole
    blocks); objective=ar rows are not padded, so its loss has no made-up EOS-after-EOS
    targets and does not depend on block_size."""
    import json
    from prove_jax.training.batches import make_data_iterator
    from tests.tokenizers_fixture import make_tokenizer
    from tests.train_helpers import tiny_config
    data = tmp_path / "ids.jsonl"  # 3 prompt + 2 trained tokens (the second an EOS) per row
    data.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8 + i, 0]}) + "\n"
                            for i in range(8)))
    tok = make_tokenizer(300)

    def rows(objective, block_size):
        cfg = tiny_config(tmp_path, f"{objective}{block_size}", data=str(data), objective=objective,
                          block_size=block_size)
        batch = next(make_data_iterator(cfg, tok, lambda _: None))
        return (batch["loss_mask"] & batch["valid"]).sum(axis=1).tolist(), batch["valid"].sum(axis=1).tolist()
    assert rows("ar", 4) == rows("ar", 8) == ([2] * 8, [5] * 8)
    assert rows("commit_head", 8) == ([2] * 8, [5] * 8)
    assert rows("mars", 4) == ([5] * 8, [8] * 8)  # padded to 8: 3 trained EOS
    assert rows("mars", 8) == ([5] * 8, [8] * 8)


def test_data_smaller_than_one_batch_is_a_warning(tmp_path):
    """Fewer sequences than one global batch train the same rows repeated in every batch."""
    import json
    from prove_jax.training.batches import make_data_iterator
    from tests.tokenizers_fixture import make_tokenizer
    from tests.train_helpers import tiny_config
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [5, 6], "response_ids": [8, 0]}) + "\n"
                            for _ in range(3)))

    def warnings(batch):
        cfg = tiny_config(tmp_path, f"b{batch}", data=str(data), objective="ar", global_batch_size=batch)
        log = []
        make_data_iterator(cfg, make_tokenizer(300), log.append)
        return [m for m in log if "less than one global batch" in m]
    assert warnings(4) == ["warning: 3 sequence(s) fill less than one global batch of 4: each batch "
                           "repeats them (more data, or a smaller global_batch_size)"]
    assert warnings(2) == []
