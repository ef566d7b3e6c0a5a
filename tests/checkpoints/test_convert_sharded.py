"""Convert once, load sharded (8 simulated CPU devices; one test on two processes).

A conversion for a mesh stores each array in chunks of its shards there, and a load onto that
mesh reads each shard as one chunk (a spy on orbax's read of one array index), never a whole
array. Training from model.hf_dir converts once into RUN_DIR/converted and a relaunch reuses
it, with the same initial weights as converting in memory; on two hosts only host 0 converts.
`export_dtype=bfloat16` exports bfloat16 weights that load and decode.
"""

from __future__ import annotations

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.hf_models import make_hf_qwen2
from prove_jax.checkpoints import checkpoint, convert
from prove_jax.cli import convert as convert_cli
from prove_jax.models import sharding
from prove_jax.models.params import abstract_model, abstract_sharded, flat_params, param_logical_axes
from prove_jax.training import loop, model_source
from prove_jax.training.config import TrainConfigError
from tests.multihost import REPO, run_two_processes
from tests.train_helpers import tiny_config, write_config


def _flat(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in checkpoint._dotted_leaves(tree).items()}


def _stored_chunks(ckpt) -> dict[str, tuple[int, ...]]:
    params = os.path.join(str(ckpt), "params")
    out = {}
    for name in os.listdir(params):
        zarray = os.path.join(params, name, ".zarray")
        if os.path.isfile(zarray):
            with open(zarray) as f:
                out[name] = tuple(json.load(f)["chunks"])
    return out


def _region(index, shape) -> tuple[int, ...]:
    return tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))


@pytest.fixture
def read_spy(monkeypatch):
    """Every region orbax reads from a stored array, as (global shape, region shape, devices);
    a whole-array numpy read fails the test."""
    from orbax.checkpoint._src.serialization import serialization

    reads = []
    real = serialization._read_array_index_and_device_put

    async def spy(devices, index, t, *, global_shape, **kwargs):
        reads.append((tuple(global_shape), _region(index, global_shape), tuple(devices)))
        return await real(devices, index, t, global_shape=global_shape, **kwargs)

    def whole_array_read(*args, **kwargs):
        raise AssertionError("a parameter was read whole, as a numpy array")

    monkeypatch.setattr(serialization, "_read_array_index_and_device_put", spy)
    monkeypatch.setattr(checkpoint.ocp.type_handlers.NumpyHandler, "deserialize", whole_array_read)
    return reads


def _expected_reads(cfg, mesh) -> collections.Counter:
    """(global shape, shard shape) of one read per distinct shard of every parameter."""
    _, placed = abstract_sharded(abstract_model(cfg), mesh)
    want = collections.Counter()
    for leaf in jax.tree.leaves(placed):
        shards = {tuple((s.start, s.stop) for s in index): _region(index, leaf.shape)
                  for index in leaf.sharding.devices_indices_map(leaf.shape).values()}
        for region in shards.values():
            want[(tuple(leaf.shape), region)] += 1
    return want


def test_a_conversion_for_a_mesh_stores_shards_and_a_sharded_load_reads_each_as_one_chunk(
        tmp_path, read_spy):
    make_hf_qwen2(tmp_path / "hf", seed=7)
    mesh = sharding.make_mesh((2, 2, 2))
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"), mesh=mesh)
    shards = checkpoint.shard_chunk_shapes(cfg, mesh)
    assert shards["layers.0.attn.q_kernel"] == (2, 16, 32)  # heads / tensor, embed / fsdp
    assert _stored_chunks(tmp_path / "ckpt") == shards

    model = checkpoint.load_model(str(tmp_path / "ckpt"), mesh=mesh)
    want = _flat(convert.convert_hf_to_ours(str(tmp_path / "hf"), cfg))
    axes_of = param_logical_axes(model)
    for name, value in flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), want[name], err_msg=name)
        assert value.sharding.spec == sharding.logical_to_spec(axes_of[name], value.shape, mesh), name
    # each read is one shard (= one stored chunk), each distinct shard read once
    assert collections.Counter((g, r) for g, r, _ in read_spy) == _expected_reads(cfg, mesh)


def test_the_cli_stores_the_shards_of_a_pod_mesh_this_machine_does_not_have(tmp_path, capsys):
    make_hf_qwen2(tmp_path / "hf", seed=8)
    assert convert_cli.main(["hf-to-flax", "--hf-dir", str(tmp_path / "hf"), "--out",
                             str(tmp_path / "ckpt"), "--mesh", "1,16,4", "--quiet"]) == 0
    chunks = _stored_chunks(tmp_path / "ckpt")
    assert chunks["layers.0.mlp.gate_kernel"] == (128 // 4, 64 // 16)  # [mlp, embed]
    assert chunks["embed"] == (256 // 4, 64 // 16)
    assert chunks["layers.0.attn.k_kernel"] == (2, 16, 4)  # 2 kv heads: not split 4 ways
    assert checkpoint.load_model(str(tmp_path / "ckpt")).cfg.hidden_size == 64  # any mesh loads it
    for bad in ("1,16", "1,0,4", "a,b,c"):
        with pytest.raises(SystemExit) as exit_:
            convert_cli.main(["hf-to-flax", "--hf-dir", str(tmp_path / "hf"), "--out",
                              str(tmp_path / "other"), "--mesh", bad])
        assert exit_.value.code == 2
        assert "bad mesh" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "other")


def test_hf_dir_training_start_converts_once_and_a_relaunch_reuses_it(tmp_path, monkeypatch, capsys,
                                                                       read_spy):
    make_hf_qwen2(tmp_path / "hf", seed=9, vocab_size=320)
    cfg = tiny_config(tmp_path, "run", objective="ar", mesh=[1, 4, 2], model={"hf_dir": str(tmp_path / "hf")})
    model_cfg = model_source.source_model_config(cfg)
    mesh = sharding.make_mesh(tuple(cfg.mesh))
    conversions = []
    real = convert.hf_to_flax
    monkeypatch.setattr(convert, "hf_to_flax", lambda *a, **k: conversions.append(a) or real(*a, **k))
    # the weights as the run started before: converted in memory, every array whole
    before = _flat(convert.convert_hf_to_ours(str(tmp_path / "hf"), model_cfg))

    def start(mesh=mesh):
        model = model_source.load_initial_model(cfg, model_cfg, mesh)
        got = flat_params(model)
        assert got.keys() == before.keys()
        for name, value in got.items():
            np.testing.assert_array_equal(np.asarray(value), before[name], err_msg=name)
        return model, capsys.readouterr().err

    converted = os.path.join(cfg.run_dir, model_source.CONVERTED_DIR)
    _, log = start()
    assert len(conversions) == 1 and "converting" in log and os.path.isfile(
        os.path.join(converted, convert.SOURCE_RECORD))
    assert _stored_chunks(converted) == checkpoint.shard_chunk_shapes(model_cfg, mesh)
    assert collections.Counter((g, r) for g, r, _ in read_spy) == _expected_reads(model_cfg, mesh)
    mtime = os.stat(os.path.join(converted, "params")).st_mtime_ns

    _, log = start()  # a relaunch before the first checkpoint
    assert len(conversions) == 1 and f"reusing {converted}" in log
    assert os.stat(os.path.join(converted, "params")).st_mtime_ns == mtime

    weights = tmp_path / "hf" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    _, log = start()  # the HF files changed: converted again
    assert len(conversions) == 2 and "again (changed since: model.safetensors)" in log
    other = sharding.make_mesh((1, 8, 1))
    _, log = start(other)  # a relaunch on another mesh: stored in its shards
    assert len(conversions) == 3 and "again (stored in the shards of mesh" in log
    assert _stored_chunks(converted) == checkpoint.shard_chunk_shapes(model_cfg, other)


def test_export_dtype_bfloat16_exports_bf16_weights_that_load_and_decode(tmp_path):
    from prove_jax.decoding import DecodeOptions
    from prove_jax.decoding.loading import build_decoder

    with pytest.raises(TrainConfigError, match=r"^export_dtype must be float32, bfloat16 or null .*got 'float16'$"):
        tiny_config(tmp_path, "bad", export_dtype="float16")
    cfg = tiny_config(tmp_path, "run", objective="ar", steps=2, save_every=2, export_dtype="bfloat16")
    result = loop.train(cfg, show_bar=False)
    trained = _flat(result.state["params"])
    assert {v.dtype for v in trained.values()} == {np.dtype("float32")}
    exported = checkpoint.load_model(result.model_dir)
    assert exported.cfg.param_dtype == "bfloat16" and exported.cfg.dtype == "float32"
    for name, value in flat_params(exported).items():
        assert value.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(value), trained[name].astype(jnp.bfloat16), err_msg=name)

    # decoding reads it (upcast for float32 compute): the tokens of the trained weights rounded
    # to bfloat16, held in float32
    rounded = checkpoint.load_model(result.model_dir, param_dtype="float32")
    checkpoint.save_model(str(tmp_path / "rounded"), rounded, tokenizer_dir=result.model_dir)
    prompt = [[5, 17, 42, 9, 100, 3]]
    tokens = {}
    for name, path in (("bf16", result.model_dir), ("rounded", str(tmp_path / "rounded"))):
        decoder, _ = build_decoder(path, DecodeOptions("ar"))
        tokens[name] = [int(t) for t in decoder.generate(prompt, max_new_tokens=8).output_ids[0]]
    assert len(tokens["bf16"]) > 0 and tokens["bf16"] == tokens["rounded"]

    # relaunched with the trained dtype, the finished run exports again, in float32
    again = loop.train(tiny_config(tmp_path, "run", objective="ar", steps=2, save_every=2), show_bar=False)
    assert again.start_step == again.final_step == 2
    reexported = checkpoint.load_model(again.model_dir)
    assert reexported.cfg.param_dtype == "float32"
    for name, value in flat_params(reexported).items():
        np.testing.assert_array_equal(np.asarray(value), trained[name], err_msg=name)


WORKER = r"""
import json, os, sys
sys.path.insert(0, {repo!r})
port, pid, cfg_path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
from prove_jax import distributed
assert distributed.initialize(f"127.0.0.1:{{port}}", 2, pid, heartbeat_timeout_s=20, init_timeout_s=90)
import jax, numpy as np
from flax import nnx
from orbax.checkpoint._src.serialization import serialization
from prove_jax.checkpoints import checkpoint, convert
from prove_jax.models import sharding
from prove_jax.models.params import flat_params
from prove_jax.training import export, model_source
from prove_jax.training.config import load_config

cfg = load_config(cfg_path)
model_cfg = model_source.source_model_config(cfg)
mesh = sharding.make_mesh(tuple(cfg.mesh))
conversions, reads = [], []
real_convert, real_read = convert.hf_to_flax, serialization._read_array_index_and_device_put
convert.hf_to_flax = lambda *a, **k: conversions.append(1) or real_convert(*a, **k)
async def spy(devices, index, t, **kw):
    reads.append([d.id for d in devices])
    return await real_read(devices, index, t, **kw)
serialization._read_array_index_and_device_put = spy
model = model_source.load_initial_model(cfg, model_cfg, mesh)
ref = {{k: np.asarray(v) for k, v in checkpoint._dotted_leaves(
    convert.convert_hf_to_ours(cfg.model.hf_dir, model_cfg)).items()}}
worst = 0.0
for name, value in flat_params(model).items():
    for shard in value.addressable_shards:
        worst = max(worst, float(np.max(np.abs(np.asarray(shard.data) - ref[name][shard.index]))))
graphdef, state = nnx.split(model)
export.export_model(os.path.join(cfg.run_dir, "model"), graphdef, nnx.to_pure_dict(state), model_cfg,
                    cfg.tokenizer.path, dtype="bfloat16")
local = {{d.id for d in jax.local_devices()}}
with open(out + f"-{{pid}}.json", "w") as f:
    json.dump({{"conversions": len(conversions), "reads": len(reads), "worst": worst,
               "own_devices_only": all(set(r) <= local for r in reads)}}, f)
"""


def test_two_hosts_host_0_converts_and_each_reads_its_own_shards(tmp_path):
    make_hf_qwen2(tmp_path / "hf", seed=10, vocab_size=320)
    path = write_config(tmp_path, "multi", objective="ar", mesh=[1, 4, 2],
                        model={"hf_dir": str(tmp_path / "hf")})
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.format(repo=REPO))
    out = str(tmp_path / "result")
    run_two_processes(lambda i, port: [str(worker), str(port), str(i), path, out])
    results = []
    for i in range(2):
        with open(f"{out}-{i}.json") as f:
            results.append(json.load(f))
    assert [r["conversions"] for r in results] == [1, 0]
    for r in results:
        assert r["worst"] == 0.0 and r["own_devices_only"] and r["reads"] > 0
    exported = checkpoint.load_model(str(tmp_path / "multi" / "model"))
    assert exported.cfg.param_dtype == "bfloat16"
    cfg = convert.read_hf_config(str(tmp_path / "hf"))
    ref = _flat(convert.convert_hf_to_ours(str(tmp_path / "hf"), cfg))
    for name, value in flat_params(exported).items():
        np.testing.assert_array_equal(np.asarray(value), ref[name].astype(jnp.bfloat16), err_msg=name)
