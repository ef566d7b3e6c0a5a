"""The one form every benchmark output is compared in (new ids up to and including the first EOS,
mapped to the model's first EOS id), and agreement between two sets of outputs."""

from __future__ import annotations

from typing import Sequence

from prove_jax.evaluation.sweep import BenchError


def our_sequence(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Ids up to and including the first EOS, that EOS mapped to eos_ids[0]."""
    out = []
    for t in ids:
        if t in eos_ids:
            return out + [eos_ids[0]]
        out.append(int(t))
    return out


def peer_sequence(ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]) -> list[int]:
    """A peer's EOS-trimmed ids in our form: a row that stopped early stopped at an EOS."""
    out = our_sequence(ids, eos_ids)
    if len(out) < max_new_tokens and (not out or out[-1] != eos_ids[0]):
        out.append(eos_ids[0])
    return out


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Token-level (same token at the same position) and exact-sequence agreement."""
    if len(outputs) != len(reference):
        raise BenchError(f"{len(outputs)} outputs but {len(reference)} reference outputs")
    same = total = exact = 0
    for out, ref in zip(outputs, reference):
        same += sum(a == b for a, b in zip(out, ref))
        total += max(len(out), len(ref))
        exact += list(out) == list(ref)
    return {"agreement_with_ar": same / total if total else 1.0,
            "exact_match_with_ar": exact / len(reference) if reference else 1.0}


def completion_text(tokenizer, seq: Sequence[int], eos_ids: Sequence[int]) -> str:
    ids = [t for t in seq if t not in eos_ids]
    return tokenizer.decode(ids, skip_special_tokens=True)
