"""Admission between chunks on a data=2 x tensor=4 mesh of 8 simulated CPU devices: the
waiting requests are prefilled in blocks, one per row shard, and each block's rows are written
into the donated loop state on the devices that hold them (program.admit_rows). The compiled
admission program gathers no cache over any axis (indexed by batch row, it all-gathered the
admitted rows' caches over data: benchmarks/decode_step_cost.md), and the stream still decodes
what greedy AR on one device does, token for token. (A cache split over rows on data x tensor,
a 2-head verifier's: tests/decoding/test_inference_mesh.py, whose streams admit too.)
"""

import jax
import numpy as np
import pytest
from flax import nnx

from prove_jax.decoding import DecodeOptions, Decoder, MemoryLayout
from prove_jax.models import sharding
from prove_jax.models.params import create_model
from tests.decoding.test_inference_mesh import CFG, GATHERS, admissions, collectives

# more requests than rows: the stream admits into the rows the short ones free
PROMPTS = [np.random.RandomState(1).randint(2, 90, n).tolist() for n in (3, 9, 1, 14, 5, 2, 11, 6)]
NEW = 8


@pytest.fixture(scope="module")
def models():
    """The model on the mesh, the mesh, and what greedy AR decodes on one device."""
    mesh = sharding.make_mesh((2, 1, 4))
    model = create_model(CFG, seed=3)
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))
    return sharded, mesh, Decoder(model, [1], DecodeOptions("ar")).generate(PROMPTS, NEW).output_ids


def _stream(decoder, rows):
    out = {}
    for event in decoder.stream(PROMPTS, NEW, batch_size=rows):
        if event.output is not None:
            out[event.index] = event.output.output_ids
    return [out[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("options", [DecodeOptions("lossless", 4),
                                     DecodeOptions("lossless", 4, memory=MemoryLayout(page_size=16, scan_layers=True))],
                         ids=["contiguous", "paged-scanned"])
def test_admission_writes_each_row_on_its_shard_and_decoding_equals_ar(models, options):
    sharded, mesh, want = models
    decoder = Decoder(sharded, [1], options, mesh=mesh)
    assert _stream(decoder, 4) == want  # lossless == AR through admission, on the mesh
    for _, hlo in admissions(decoder):
        found = collectives(hlo)
        # no KV (nor any float) crosses devices but the tensor-parallel all-reduces
        assert not [c for c in found if c[0] in GATHERS and c[1] not in ("s32", "pred")], found
        if options.memory.page_size is None:  # not even an index: each device writes its own rows
            assert {op for op, _, _ in found} <= {"all-reduce"}, found
