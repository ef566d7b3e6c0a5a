"""The lossless step's LM-head rule (one pass over every slot, or two reading the head twice) is
a field of the frozen `ComputeOptions`, resolved per platform on the host: on CPU a few extra
rows only (benchmarks/step_cost.md), on TPU up to 16 rows of K=6 G=2, where the step is bound
by HBM bytes (benchmarks/decode_step_cost.md)."""

import dataclasses

import jax
import pytest

from prove_jax.decoding import DecodeOptions, LosslessRule, program
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.mode_steps import head_in_one_pass
from prove_jax.models import compute as compute_mod
from prove_jax.models.compute import ComputeOptions, ComputeOptionsError


def _settings(options):
    return program.ProgramSettings(options=options, num_rows=16, num_slots=64, pad_id=0, mask_id=-1,
                                   prefill_chunk=4)


def test_tpu_options_read_the_head_once_where_cpu_options_read_it_twice(monkeypatch):
    """K=6, G=2 (the step HumanEval measured) needs the head at 11 of its 16 slots: 5 extra rows
    a row. At 16 rows (80 extra) the CPU's resolved options run two passes, the TPU's one; at
    one row (5 extra) both run one. The rule is what `resolve` spelled out, on the host."""
    layout = LosslessLayout.build(6, 2)
    assert layout.width - (2 * layout.num_drafts + 1) == 5
    cpu, tpu = ComputeOptions().resolve("cpu"), ComputeOptions().resolve("tpu")
    assert cpu.head_one_pass_max_extra_rows == compute_mod.HEAD_ONE_PASS_MAX_EXTRA_ROWS["cpu"] == 8
    assert tpu.head_one_pass_max_extra_rows == compute_mod.HEAD_ONE_PASS_MAX_EXTRA_ROWS["tpu"]
    assert not head_in_one_pass(layout, 16, cpu) and head_in_one_pass(layout, 16, tpu)
    assert head_in_one_pass(layout, 1, cpu) and head_in_one_pass(layout, 1, tpu)
    assert not head_in_one_pass(layout, 64, tpu)  # 320 extra: two passes (about even there)
    # the trace reads the field: a resolved options object asks nothing of the backend
    monkeypatch.setattr(jax, "default_backend", lambda: pytest.fail("read at trace time"))
    assert head_in_one_pass(layout, 16, tpu) and not head_in_one_pass(layout, 16, cpu)
    # an explicit limit wins over the platform's, and lm_head_one_pass=False still forces two
    assert not head_in_one_pass(layout, 16, dataclasses.replace(tpu, head_one_pass_max_extra_rows=8))
    assert head_in_one_pass(layout, 16, ComputeOptions(head_one_pass_max_extra_rows=80).resolve("cpu"))
    assert not head_in_one_pass(layout, 1, dataclasses.replace(tpu, lm_head_one_pass=False))
    with pytest.raises(ComputeOptionsError, match="head_one_pass_max_extra_rows"):
        ComputeOptions(head_one_pass_max_extra_rows=-1)


def test_the_head_rule_keys_the_compile_cache(monkeypatch):
    """Program settings equal but for the head rule (given, or resolved for another platform)
    are another program: the rule is a field of the frozen options the cache key holds."""
    options = DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2)).validate()
    here = _settings(options)
    assert here == _settings(options) and hash(here) == hash(_settings(options))
    one_pass = dataclasses.replace(options, compute=ComputeOptions(head_one_pass_max_extra_rows=80)).validate()
    assert _settings(one_pass).compute.head_one_pass_max_extra_rows == 80 != here.compute.head_one_pass_max_extra_rows
    assert _settings(one_pass) != here
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    elsewhere = _settings(options)
    assert elsewhere.compute.head_one_pass_max_extra_rows == compute_mod.HEAD_ONE_PASS_MAX_EXTRA_ROWS["tpu"]
    assert elsewhere != here
