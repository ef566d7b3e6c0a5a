"""The compiled decode loop updates the KV cache in place and reads the weights as they lie: no
step copies a whole cache buffer or a whole weight.

A decode step reads the cache and writes T slots of it. If XLA cannot do that in place it
copies or transposes every layer's whole buffer on every step, a cost proportional to the
buffer length that silently dominated small-model decode steps (the [B, S, K, Dh] layout
transposed each buffer per step; a single-window write at batch 1 was duplicated into its
readers and copied four times). This test reads the optimised HLO of the real engine program
and counts copy/transpose instructions of cache-buffer shape inside its while loops: outside a
loop (prefill, set-up) they run once and do not matter. The same holds for the weights: the
input-major matmul form transposes each weight once, before the loop, never per step.
"""

import re

import jax
import numpy as np
import pytest

from flax import nnx

from prove_jax.models.config import ModelConfig
from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule, ThresholdRule
from prove_jax.decoding.program import cache_slots
from prove_jax.models.attention import cache_chunk
from prove_jax.models.compute import MATMUL_FORMS, ComputeOptions
from prove_jax.models.params import create_model

# head_dim 24 keeps cache buffers [B, K, S, 24] from sharing a shape with any score tensor
# [B, K, G, T, S] of the layouts below or of the 16-token prefill chunks.
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=24, mask_token_id=95, eos_token_ids=(1,))


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    return comps


def _loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """Every computation reachable from a while body (fusions, nested loops, branches)."""
    todo = [m.group(1) for lines in comps.values() for line in lines
            for m in [re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)] if m]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [x.strip().lstrip("%") for x in group.split(",")]
    return seen


def moves_of_shape(hlo: str, shape: tuple[int, ...], in_loops: bool = True) -> list[str]:
    """copy/transpose instructions (inside loops, or anywhere) of `shape` (any order, size-1
    dims ignored, as XLA bitcasts them away)."""
    want = sorted(d for d in shape if d != 1)
    comps = _computations(hlo)
    found = []
    for name in (_loop_computations(comps) if in_loops else comps):
        for line in comps[name]:
            m = re.search(r"= f32\[([0-9,]*)\]\{[^}]*\} (copy|transpose)\(", line)
            if m and sorted(int(d) for d in m.group(1).split(",") if d and int(d) != 1) == want:
                found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def models():
    return create_model(CFG, seed=0), create_model(CFG.replace(num_layers=1), seed=1)


@pytest.mark.parametrize("rows,queue", [(1, 1), (2, 4)])
@pytest.mark.parametrize("options", [
    DecodeOptions("ar"),
    DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)),
    DecodeOptions("threshold", 3, threshold=ThresholdRule(tau=0.5)),
    DecodeOptions("verify", 3),
], ids=["ar", "lossless", "threshold", "verify"])
def test_decode_loop_never_copies_the_kv_cache(models, options, rows, queue):
    proposer, verifier = models
    decoder = Decoder(proposer, [1], options, verifier=verifier if options.mode == "verify" else None)
    prompts = [list(range(2, 2 + n)) for n in np.resize([3, 5, 4, 6], queue)]
    result = decoder.generate(prompts, 40, batch_size=rows)
    assert all(len(out) > 0 for out in result.output_ids)
    ((_, compiled),) = decoder.programs("run")
    hlo = compiled.as_text()
    assert "while" in hlo
    n_slots = decoder.buffer_len(16, 40)  # prompts pad to 16
    width = {"ar": 1, "lossless": 10, "threshold": 5, "verify": 5}[options.mode]
    shapes = [(rows, CFG.num_kv_heads, cache_slots(n_slots + width), CFG.head_dim)]
    if options.mode == "verify":
        shapes.append((rows, CFG.num_kv_heads, cache_slots(n_slots + options.block_size), CFG.head_dim))
    # (a queue admits a request by prefilling one row inside the loop, once per request: those
    # buffers have one row, so with rows > 1 they do not match the batch's and are allowed)
    for shape in shapes:
        moves = moves_of_shape(hlo, shape)
        assert not moves, f"{len(moves)} whole-cache copies per step, e.g. {moves[0]}"


@pytest.mark.parametrize("options,width", [(DecodeOptions("ar"), 1),
                                           (DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2)), 10)],
                         ids=["ar", "lossless"])
def test_chunked_cache_read_never_copies_the_kv_cache(models, options, width):
    """A buffer long enough to be read in chunks (`attention.cache_chunk`): the chunks are sliced
    from the buffer inside a loop of every layer, and the buffer is still never copied whole."""
    decoder = Decoder(models[0], [1], options)
    prompts = [list(range(2, 2 + n)) for n in (3, 5, 4, 6)]
    result = decoder.generate(prompts, 500, batch_size=2)
    assert all(len(out) > 0 for out in result.output_ids)
    ((_, compiled),) = decoder.programs("run")
    slots = cache_slots(decoder.buffer_len(16, 500) + width)
    assert cache_chunk(slots) < slots  # read in chunks
    moves = moves_of_shape(compiled.as_text(), (2, CFG.num_kv_heads, slots, CFG.head_dim))
    assert not moves, f"{len(moves)} whole-cache copies per step, e.g. {moves[0]}"


@pytest.mark.parametrize("form", [f for f in MATMUL_FORMS if f != "plain"])
def test_decode_loop_never_moves_a_weight(models, form):
    """One row (so no activation in the loop has a weight's shape), in both CPU decode forms.
    (The plain form is not among them: XLA:CPU transposes the k/v kernels on every step.)"""
    proposer, _ = models
    options = DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), compute=ComputeOptions(matmul_form=form))
    decoder = Decoder(proposer, [1], options)
    result = decoder.generate([[2, 3, 4]], 40, batch_size=1)
    assert len(result.output_ids[0]) > 0
    ((_, compiled),) = decoder.programs("run")
    hlo = compiled.as_text()
    weights = {tuple(x.shape) for x in jax.tree.leaves(nnx.state(proposer, nnx.Param)) if x.ndim > 1}
    assert (CFG.intermediate_size, CFG.hidden_size) in weights  # gate/up kernels [F, D]
    for shape in weights:
        moves = moves_of_shape(hlo, shape)
        assert not moves, f"{form}: weight {shape} moved on every step, e.g. {moves[0]}"
    # not vacuous: the input-major form does transpose the weights, once, before the loop
    moved_once = [s for s in weights if moves_of_shape(hlo, s, in_loops=False)]
    assert bool(moved_once) == (form == "input_major"), moved_once
