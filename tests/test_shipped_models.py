"""The shipped demo pair: it loads, its lossless output equals AR on held-out prompts, the
proposer really proposes (acceptance > 0), and the reproduction script runs end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prove_jax import assets
from prove_jax.evaluation import humaneval
from prove_jax.checkpoints.checkpoint import load_config, load_tokenizer
from prove_jax.data.corpus import build_corpus, heldout_prompts
from prove_jax.decoding import DecodeOptions, ComputeOptions, LosslessRule
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.mode_steps import head_in_one_pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def heldout_ids():
    tok = load_tokenizer(assets.DEMO_PROPOSER)
    split = build_corpus()
    prompts = heldout_prompts(split.heldout, limit=6)
    return [tok.encode(p["prompt"])[-96:] for p in prompts]


def test_shipped_pair_is_small_and_consistent():
    p, v = load_config(assets.DEMO_PROPOSER), load_config(assets.DEMO_VERIFIER)
    assert p.mask_token_id is not None and p.vocab_size == v.vocab_size
    assert v.num_params < p.num_params
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(assets.DEMO_DIR) for f in fs)
    assert size < 40e6  # tens of MB at most
    assert os.path.isdir(os.path.join(assets.DEMO_VERIFIER, "commit_head"))


def test_shipped_lossless_equals_ar_on_heldout_prompts(heldout_ids):
    ar, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"))
    ref = ar.generate(heldout_ids, 40)
    results = {}
    for k, groups in ((4, None), (6, 2), (8, 3)):
        dec = ar.with_options(DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=groups)))
        res = results[(k, groups)] = dec.generate(heldout_ids, 40)
        assert res.output_ids == ref.output_ids
        # the self-distilled proposer's drafts are mostly accepted: more than 2 tokens per forward
        # (it commits ~3.6 at K=4 here; an ordinary MARS proposer managed ~1.4)
        assert res.accept_hist[:, 1:].sum() > 0
        assert sum(map(len, res.output_ids)) > 2 * res.forwards.sum()
    # rows accept at different rates and drift apart: served two at a time from a queue, each
    # finished row takes the next prompt mid-loop, and the output is still AR token for token
    queued = dec.generate(heldout_ids, 40, batch_size=2)
    assert queued.output_ids == ref.output_ids
    assert list(queued.forwards) == list(res.forwards)  # a request's steps do not depend on its row
    # one row at a time, K=6 with 2 groups reads the LM head in one pass (mode_steps.head_in_one_pass):
    # its drafts are then taken from that pass, and they are accepted as often as before
    assert head_in_one_pass(LosslessLayout.build(6, 2), 1) and not head_in_one_pass(LosslessLayout.build(6, 2), 6)
    one_row = ar.with_options(DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2))).generate(heldout_ids, 40, batch_size=1)
    all_rows = results[(6, 2)]
    assert one_row.output_ids == ref.output_ids
    assert list(one_row.forwards) == list(all_rows.forwards) and (one_row.accept_hist == all_rows.accept_hist).all()


def test_shipped_lossless_equals_ar_as_an_accelerator_runs_it(monkeypatch):
    """What a GPU/TPU runs, checked here since no test machine has one: the plain matmul form
    (`matmul.dense` uses the CPU forms only on CPU), the accelerator prefill chunk, and the
    adaptive table's layouts, the widest first (K=8 with a group per acceptance length: a
    64-token step). A trained proposer, so steps accept partial blocks and use middle groups."""
    from prove_jax.decoding import adaptive
    from prove_jax.decoding import options as decode_options
    monkeypatch.setattr(decode_options, "PREFILL_CHUNK", {})  # every backend: PREFILL_CHUNK_ACCELERATOR
    table = adaptive.ADAPTIVE_TABLES["gpu"]
    plain = ComputeOptions(matmul_form="plain")
    # one device: the suite's simulated ones would all go on the data axis (8 rows at least)
    ar, tok = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar", compute=plain), mesh_shape="1,1,1")
    # HumanEval prompts, on which the proposer often accepts part of a block
    prompts = [tok.encode(p["prompt"])[-96:] for p in humaneval.load_problems(limit=6)]
    assert decode_options.default_prefill_chunk() == decode_options.PREFILL_CHUNK_ACCELERATOR > max(map(len, prompts))
    ref = ar.generate(prompts, 48)
    dec = ar.with_options(DecodeOptions("lossless", 8, lossless=LosslessRule(adaptive=True), compute=plain))
    dec.adaptive_table = table  # what an accelerator looks up for its platform
    for rows, layout in ((1, (8, 8)), (4, table[1][1:]), (6, table[2][1:])):
        res = dec.generate(prompts, 48, batch_size=rows)
        assert (res.options.block_size, res.options.lossless.max_groups) == layout
        assert res.options.compute == plain  # the adapted options keep the kernels
        assert res.output_ids == ref.output_ids, (rows, layout)
        if rows == 1:  # the middle groups (a partial acceptance) served some steps too
            assert LosslessLayout.build(8, 8).width == 64
            assert res.accept_hist[:, 1:7].sum() > 0, res.accept_hist.sum(0)


def test_capped_layout_commits_every_verified_token():
    """K=4 with 2 groups serves acceptance 0 and full acceptance only. A step that accepts 1 or
    2 drafts still commits all of them plus the bonus token (its drafts then come from group 0,
    shifted), so some steps commit 2 or 3 tokens: the unshifted rule could only commit 1 or 4."""
    ar, tok = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"))
    # HumanEval prompts: on them the proposer also accepts part of a block (on the held-out
    # stdlib prompts it mostly accepts all or nothing)
    prompts = [tok.encode(p["prompt"])[-96:] for p in humaneval.load_problems(limit=6)]
    ref = ar.generate(prompts, 48)
    dec = ar.with_options(DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2), record_steps=True))
    res = dec.generate(prompts, 48)
    assert res.output_ids == ref.output_ids
    partial = 0
    for row, commits in enumerate(res.step_commits):
        hist = res.accept_hist[row]
        assert sum(commits) == len(res.output_ids[row]) and len(commits) == hist.sum()
        # every step but the last (cut by EOS or the budget) commits its accepted prefix a plus one
        accepted = np.bincount(np.asarray(commits[:-1]) - 1, minlength=len(hist))
        assert np.all(accepted <= hist) and (hist - accepted).sum() == 1, (commits, hist)
        partial += sum(1 for n in commits[:-1] if n in (2, 3))
    assert partial > 0


def test_shipped_verifier_top1_with_proposer_as_verifier_is_ar(heldout_ids):
    ar, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"))
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("verify", 8),
                           verifier_path=assets.DEMO_PROPOSER)
    assert dec.generate(heldout_ids[:3], 32).output_ids == ar.generate(heldout_ids[:3], 32).output_ids


# The reproduction script with its stages (each a `python -m prove_jax ...` or
# `python scripts/X.py` command line) run in its one process: the same commands through the same
# entry points, one interpreter and JAX start-up instead of nine (most of the quick run's time).
IN_ONE_PROCESS = r"""
import runpy, subprocess, sys
sys.path.insert(0, "scripts")
import build_demo_models as script
from prove_jax.cli.main import dispatch

def run(cmd):
    print("$ " + " ".join(cmd), flush=True)
    assert cmd[0] == sys.executable, cmd
    if cmd[1:3] == ["-m", "prove_jax"]:
        code = dispatch(cmd[3:])
    else:
        code = runpy.run_path(cmd[1], run_name="stage")["main"](cmd[2:])
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)

script.run = run
sys.exit(script.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_reproduction_script_quick(tmp_path):
    r = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS, "--quick", "--work",
                        str(tmp_path / "w"), "--out", str(tmp_path / "demo")], cwd=ROOT,
                       capture_output=True, text=True, env=os.environ | {"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cfg = load_config(str(tmp_path / "demo" / "proposer"))
    assert cfg.mask_token_id is not None and cfg.param_dtype == "bfloat16"
    assert os.path.isdir(tmp_path / "demo" / "verifier" / "commit_head")
    manifest = json.loads((tmp_path / "w" / "corpus" / "manifest.json").read_text())
    assert manifest["heldout"]["files"] > 0
