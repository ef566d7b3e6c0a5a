"""Loading for the layer scan restores straight into the stacked layout: each layer is read,
written into the stacked weights in place and dropped, so the load holds the weights and one
layer at most (`checkpoint.load_model_stacked`); stacking a restored model held both layouts,
twice the weights. The stacked weights equal `stack_layers` of the per-layer load, placed the
same on a mesh."""

import jax
import numpy as np
import pytest
from flax import nnx

from prove_jax.checkpoints import checkpoint
from prove_jax.checkpoints.checkpoint import load_model, load_model_stacked, save_model
from prove_jax.models import sharding
from prove_jax.models.params import create_model, flat_params
from prove_jax.models.qwen2 import stack_layers
from tests.decoding.test_inference_mesh import CFG

LAYERS = 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "model")
    save_model(path, create_model(CFG.replace(num_layers=LAYERS), seed=3))
    return path


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_the_stacked_load_holds_the_weights_and_one_layer_at_most(saved, monkeypatch):
    peaks, put = [], checkpoint._put_layer

    def counted(stacked, layer, index):  # after each write: the stacked weights, the rest, this layer
        out = put(stacked, layer, index)
        peaks.append(_live_bytes() - before)
        return out

    monkeypatch.setattr(checkpoint, "_put_layer", counted)
    mesh = sharding.make_mesh((2, 1, 4))
    before = _live_bytes()
    model = load_model_stacked(saved, mesh=mesh)
    weights = _live_bytes() - before
    layer = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.layers))) // LAYERS
    assert model.layers_stacked and len(peaks) == LAYERS * len(jax.tree.leaves(nnx.state(model.layers)))
    assert max(peaks) <= weights + layer < 1.5 * weights  # stacking a loaded model: 2x
    # the same weights as the per-layer load stacked, placed the same on the mesh
    want = flat_params(nnx.state(stack_layers(load_model(saved, mesh=mesh))))
    got = flat_params(nnx.state(model))
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].sharding.is_equivalent_to(array.sharding, array.ndim), name
        assert np.array_equal(np.asarray(got[name]), np.asarray(array)), name


def test_a_scanned_decoder_is_built_from_the_stacked_load(saved, monkeypatch):
    """build_decoder with scan_layers restores stacked; the Decoder has nothing left to stack."""
    from prove_jax.decoding import DecodeOptions, engine, MemoryLayout
    from prove_jax.decoding.loading import build_decoder

    def stacked_again(model):
        raise AssertionError("the loaded layers were stacked again")
    monkeypatch.setattr(engine, "stack_layers", stacked_again)
    decoder, _ = build_decoder(saved, DecodeOptions("ar", memory=MemoryLayout(scan_layers=True)))
    names = flat_params(decoder.state)
    assert names["layers.layer.attn.q_kernel"].shape[0] == LAYERS and "layers.0.attn.q_kernel" not in names
