"""Sharded forward on 8 simulated CPU devices equals the unsharded one; params sharded per table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from prove_jax.models import sharding
from prove_jax.checkpoints.checkpoint import load_model, save_model
from prove_jax.models.config import ModelConfig
from prove_jax.models.attention import causal_mask
from prove_jax.models.params import create_model, flat_params, param_logical_axes

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
B, T = 4, 16

# Hand-written from DEFAULT_RULES (embed->fsdp, heads/kv_heads/mlp/vocab->tensor) for 2x2x2.
EXPECTED_2x2x2 = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("tensor", "fsdp"),
    "final_norm.weight": P("fsdp"),
    "layers.0.input_norm.weight": P("fsdp"),
    "layers.0.attn.q_kernel": P("tensor", None, "fsdp"),
    "layers.0.attn.q_bias": P("tensor"),
    "layers.1.attn.k_kernel": P("tensor", None, "fsdp"),
    "layers.1.attn.v_bias": P("tensor"),
    "layers.0.attn.o_kernel": P("fsdp", "tensor"),
    "layers.1.mlp.gate_kernel": P("tensor", "fsdp"),
    "layers.1.mlp.up_kernel": P("tensor", "fsdp"),
    "layers.0.mlp.down_kernel": P("fsdp", "tensor"),
}


@nnx.jit
def forward(model, tokens, positions, mask):
    return model(tokens, positions, mask)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Unsharded model, its checkpoint, inputs and logits."""
    assert jax.device_count() == 8, "tests/conftest.py must set 8 simulated CPU devices"
    model = create_model(CFG, seed=0)
    path = str(tmp_path_factory.mktemp("shard") / "ckpt")
    save_model(path, model)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits = np.asarray(forward(model, tokens, positions, causal_mask(B, T)))
    return path, {k: np.asarray(v) for k, v in flat_params(model).items()}, tokens, positions, logits


def sharded_logits(model, mesh, tokens, positions):
    batch = NamedSharding(mesh, sharding.logical_to_spec(("batch", "sequence"), tokens.shape, mesh))
    with jax.set_mesh(mesh):
        tokens, positions = jax.device_put(tokens, batch), jax.device_put(positions, batch)
        out = forward(model, tokens, positions, causal_mask(B, T))
    return out


def assert_sharded_per_table(model, mesh):
    axes = param_logical_axes(model)
    for name, value in flat_params(model).items():
        want = sharding.logical_to_spec(axes[name], value.shape, mesh)
        assert value.sharding.spec == want, (name, value.sharding.spec, want)
        # the shard really is smaller along every sharded dimension
        shard = value.addressable_shards[0].data.shape
        for dim, mesh_axes in enumerate(tuple(want) + (None,) * (value.ndim - len(want))):
            names = () if mesh_axes is None else ((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes)
            assert shard[dim] == value.shape[dim] // int(np.prod([mesh.shape[a] for a in names])), name


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 8), (8, 1, 1)])
def test_load_onto_mesh_restores_sharded_and_forward_matches(reference, shape):
    path, ref_params, tokens, positions, ref_logits = reference
    mesh = sharding.make_mesh(shape)
    model = load_model(path, mesh=mesh)
    assert_sharded_per_table(model, mesh)
    restored = flat_params(model)
    for name, want in ref_params.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), want, err_msg=name)

    out = sharded_logits(model, mesh, tokens, positions)
    np.testing.assert_allclose(np.asarray(out), ref_logits, atol=1e-5, rtol=0)
    if shape == (2, 2, 2):
        specs = {k: v.sharding.spec for k, v in restored.items()}
        for name, spec in EXPECTED_2x2x2.items():
            assert specs[name] == spec, (name, specs[name], spec)
        assert restored["layers.0.attn.q_kernel"].addressable_shards[0].data.shape == (2, 16, 32)
        assert len(out.sharding.device_set) == 8
    if shape == (1, 1, 8):  # mlp and vocab split 8 ways; 4 heads cannot be, so they replicate
        assert restored["layers.0.mlp.gate_kernel"].addressable_shards[0].data.shape == (16, 64)
        assert restored["lm_head"].addressable_shards[0].data.shape == (32, 64)
        assert restored["layers.0.attn.q_kernel"].addressable_shards[0].data.shape == (4, 16, 64)


def test_create_model_on_mesh_is_sharded_and_matches(reference, tmp_path):
    _, ref_params, tokens, positions, ref_logits = reference
    mesh = sharding.make_mesh((2, 2, 2))
    model = create_model(CFG, seed=0, mesh=mesh)
    assert_sharded_per_table(model, mesh)
    out = sharded_logits(model, mesh, tokens, positions)
    np.testing.assert_allclose(np.asarray(out), ref_logits, atol=1e-5, rtol=0)
    # a sharded model saves and restores unsharded with the same values
    save_model(str(tmp_path / "sharded"), model)
    restored = flat_params(load_model(str(tmp_path / "sharded")))
    for name, want in ref_params.items():
        np.testing.assert_allclose(np.asarray(restored[name]), want, atol=1e-6, rtol=0, err_msg=name)


def test_mesh_shapes_that_would_idle_devices_or_make_no_sense_are_refused():
    n = len(jax.devices())  # 8 simulated
    assert dict(sharding.make_mesh((2, -1, 1)).shape) == {"data": 2, "fsdp": n // 2, "tensor": 1}
    with pytest.raises(sharding.MeshError, match=f"{n} devices do not divide into 3 x N"):
        sharding.make_mesh((3, -1, 1))  # used to run on 6 of the 8, the other 2 idle, unsaid
    for bad in ((2, -2, 1), (0, 8, 1)):
        with pytest.raises(sharding.MeshError, match="every axis is >= 1"):
            sharding.make_mesh(bad)


def test_damaged_checkpoint_config_and_metadata_are_named(tmp_path):
    import json
    import os
    import shutil
    from prove_jax.checkpoints.checkpoint import CheckpointError, load_config
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    save_model(str(tmp_path / "ok"), create_model(cfg, seed=0))
    for edit, message in [(lambda d: d.pop("vocab_size"), r"missing required key\(s\) \['vocab_size'\]"),
                          (lambda d: d.update(hidden_size="32"), "hidden_size must be int, got '32'"),
                          (lambda d: d.update(eos_token_ids=None), "eos_token_ids must be a list"),
                          (lambda d: d.update(rope_theta="big"), "rope_theta must be float, got 'big'"),
                          (lambda d: d.update(tie_word_embeddings="no"),
                           "tie_word_embeddings must be bool, got 'no'"),
                          (lambda d: d.update(pad_token_id=True), "pad_token_id must be int or null, got True")]:
        shutil.copytree(tmp_path / "ok", tmp_path / "bad")
        path = tmp_path / "bad" / "config.json"
        d = json.loads(path.read_text())
        edit(d)
        path.write_text(json.dumps(d))
        with pytest.raises(CheckpointError, match=message):
            load_config(str(tmp_path / "bad"))
        shutil.rmtree(tmp_path / "bad")
    os.remove(tmp_path / "ok" / "params" / "_METADATA")
    with pytest.raises(CheckpointError, match="parameter metadata cannot be read"):
        load_model(str(tmp_path / "ok"))  # blamed the first parameter, 'embed', which is there


def test_saving_prints_no_ocdbt_merge_warning(tmp_path, caplog):
    """Orbax warned on every save (each export and conversion) about skipping an OCDBT merge,
    naming a temporary path: noise that reads like a failure."""
    import logging
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    with caplog.at_level(logging.INFO):
        save_model(str(tmp_path / "ckpt"), create_model(cfg, seed=0))
    assert not [r for r in caplog.records if "OCDBT" in r.getMessage()]
    assert load_model(str(tmp_path / "ckpt")).cfg == cfg
