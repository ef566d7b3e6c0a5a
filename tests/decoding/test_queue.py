"""Continuous batching: more prompts than rows, a finished row takes the next prompt in-loop."""

import pytest

from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule, ThresholdRule, VerifyRule
from prove_jax.models.sharding import make_mesh
from tests.decode_helpers import load_or_shard, random_prompts

LENGTHS = (3, 9, 1, 14, 6, 2, 11)
OPTIONS = (DecodeOptions("ar"), DecodeOptions("lossless", 4), DecodeOptions("lossless", 3, lossless=LosslessRule(max_groups=2)),
           DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=1.01)), DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="top1")))


@pytest.fixture(scope="module")
def eos(model):
    """A token that AR emits mid-stream in some of these prompts' outputs but not in all of them,
    so that as EOS it ends some rows early and leaves others running to the limit."""
    free = Decoder(model, [-1], DecodeOptions("ar")).generate(random_prompts(7, LENGTHS), 24).output_ids
    for out in free:
        for token in out[2:-2]:
            if any(token not in other for other in free):
                return token
    raise AssertionError("no token ends some rows but not all: pick other prompts")


@pytest.fixture(scope="module")
def reference(model, eos):
    """Every prompt in one static batch (one row each): the AR outputs and stats."""
    return Decoder(model, [eos], DecodeOptions("ar")).generate(random_prompts(7, LENGTHS), 24)


def test_reference_has_requests_that_stop_early(reference):
    lengths = [len(o) for o in reference.output_ids]
    assert min(lengths) < 24 and max(lengths) == 24  # rows finish at different steps


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"{o.mode}-K{o.block_size}-G{o.lossless.max_groups}")
def test_queue_equals_ar_token_for_token(model, eos, reference, opts):
    res = Decoder(model, [eos], opts, verifier=model).generate(random_prompts(7, LENGTHS), 24, batch_size=2)
    assert res.output_ids == reference.output_ids
    assert (res.accept_hist.sum(1) == res.forwards).all()  # per-request stats, not per row
    assert (res.forwards >= 1).all() and (res.forwards <= [len(o) for o in res.output_ids]).all()


def test_finished_rows_take_the_next_prompt(model, eos, reference):
    dec = Decoder(model, [eos], DecodeOptions("ar", record_steps=True))
    prompts = random_prompts(7, LENGTHS)
    queued = dec.generate(prompts, 24, batch_size=2)
    static = [dec.generate(prompts[i: i + 2], 24, batch_size=2) for i in range(0, len(prompts), 2)]
    assert sum(r.loop_steps for r in static) == sum(max(r.forwards) for r in static)
    # refilled rows idle less: fewer loop steps than static batches of the same size, and never
    # fewer than the work spread over both rows
    assert queued.loop_steps < sum(r.loop_steps for r in static)
    assert queued.loop_steps >= sum(len(o) for o in reference.output_ids) / 2
    assert list(queued.forwards) == [len(o) for o in reference.output_ids]  # AR: one token per forward
    assert [sum(s) for s in queued.step_commits] == [len(o) for o in queued.output_ids]


def test_one_program_for_every_chunk_of_a_run(model, eos, reference):
    dec = Decoder(model, [eos], DecodeOptions("lossless", 4))
    prompts = random_prompts(7, LENGTHS)
    head = dec.generate(prompts[:5], 24, batch_size=2, prompt_width=14, queue_size=6)
    tail = dec.generate(prompts[5:], 24, batch_size=2, prompt_width=14, queue_size=6)
    assert dec.trace_count == 1
    assert head.output_ids + tail.output_ids == reference.output_ids


def test_sharded_queue_equals_single_device(model, eos, reference):
    mesh = make_mesh((4, 1, 2))
    sharded = load_or_shard(model, mesh)
    prompts = random_prompts(7, LENGTHS) * 2  # 14 prompts, 4 rows (one per data shard), queue of 16
    for opts in (DecodeOptions("ar"), DecodeOptions("lossless", 4)):
        res = Decoder(sharded, [eos], opts, mesh=mesh).generate(prompts, 24, batch_size=4)
        assert res.output_ids == reference.output_ids * 2, opts.mode
