"""Continuous batching: a queue of requests takes the steps greedy list scheduling by hand
says, and each request is served once."""

from __future__ import annotations

from prove_jax.decoding import DecodeOptions


def _makespan(lengths, rows):
    """Greedy list scheduling by hand: requests in order, each to the first free row; in AR a
    request of n output tokens holds its row for n steps."""
    free = [0] * rows
    for n in lengths:
        free[free.index(min(free))] += n
    return max(free)


def test_a_full_queue_takes_the_steps_its_requests_need_and_no_more():
    """Once the last request is admitted a finished row stays idle: it must not be handed a
    request past the end of the queue (which reads as the last one again and runs it twice)."""
    from prove_jax.decoding import Decoder
    from prove_jax.models.params import create_model
    from tests.decode_helpers import CFG, random_prompts
    model = create_model(CFG, seed=3)
    prompts = random_prompts(4, (5, 2, 8, 3))
    free = Decoder(model, [-1], DecodeOptions("ar")).generate(prompts, 12).output_ids
    eos = next(t for t in free[0][1:-2] if any(t not in o for o in free))  # ends some rows early
    want = [o[: o.index(eos) + 1] if eos in o else o for o in free]
    assert len({len(o) for o in want}) > 1
    dec = Decoder(model, [eos], DecodeOptions("ar"))
    for rows in (1, 2):  # 4 requests: a queue exactly full, no padding requests
        res = dec.generate(prompts, 12, batch_size=rows)
        assert res.output_ids == want and list(res.forwards) == [len(o) for o in want]
        assert res.loop_steps == _makespan([len(o) for o in want], rows), rows
