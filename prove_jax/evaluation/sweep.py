"""What a benchmark measures: one `Setting` per decoding configuration (ours or a transformers
peer), and the sweep `prove-jax benchmark` runs by default."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from prove_jax.decoding import DecodeOptions, LosslessRule, ThresholdRule, VerifyRule
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import COMMIT_RULES
from prove_jax.errors import ProveJaxError
from prove_jax.evaluation.peers import PEER_MODES


OUR_MODES = ("ar", "threshold", "lossless", "verify")
ALL_MODES = OUR_MODES + PEER_MODES
BATCH1_ONLY = ("hf_assisted", "hf_prompt_lookup")  # transformers supports batch 1 only


class BenchError(ProveJaxError, ValueError):
    """Bad benchmark options (unknown mode, empty prompt set, bad batch size...)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One decoding configuration: one of our DecodeOptions, or a transformers peer."""
    mode: str
    label: str
    options: DecodeOptions | None = None  # ours
    peer_kwargs: tuple = ()  # peers: extra keyword arguments, as (name, value) pairs
    calibrate: bool = False  # adaptive lossless with a table measured here (decoding/calibrate.py)

    @property
    def is_peer(self) -> bool:
        return self.mode in PEER_MODES

    def supports_batch(self, batch_size: int) -> bool:
        return batch_size == 1 or self.mode not in BATCH1_ONLY

    @property
    def name(self) -> str:
        return self.mode if self.label == "-" else f"{self.mode} {self.label}"


def ar_setting() -> Setting:
    return Setting("ar", "-", DecodeOptions("ar", block_size=1))


def lossless_setting(k: int, groups: int | None = None, adaptive: bool = False,
                     record_steps: bool = False) -> Setting:
    opts = DecodeOptions("lossless", block_size=k,
                         lossless=LosslessRule(max_groups=groups, adaptive=adaptive),
                         record_steps=record_steps)
    g = LosslessLayout.build(k, groups).num_groups
    return Setting("lossless", f"adaptive,K<={k}" if adaptive else f"K={k},G={g}", opts)


def relaxed_setting(k: int, groups: int | None, relaxed_p: float) -> Setting:
    """Lossless's step with relaxed acceptance (`DecodeOptions.lossless.relaxed_p`): lossy, shown
    as its own mode."""
    exact = lossless_setting(k, groups)
    return Setting("relaxed", f"{exact.label},p={relaxed_p:g}",
                   dataclasses.replace(exact.options, lossless=dataclasses.replace(
                       exact.options.lossless, relaxed_p=relaxed_p)))


def calibrated_setting(k_max: int = 8) -> Setting:
    """Adaptive lossless whose per-batch layout is measured on this machine before timing."""
    return Setting("lossless", f"calibrated,K<={k_max}",
                   DecodeOptions("lossless", block_size=k_max,
                                 lossless=LosslessRule(adaptive=True)), calibrate=True)


def threshold_setting(tau: float, k: int = 8, confidence: str = "prob") -> Setting:
    label = f"K={k},tau={tau:g}" + ("" if confidence == "prob" else f",{confidence}")
    return Setting("threshold", label,
                   DecodeOptions("threshold", block_size=k,
                                 threshold=ThresholdRule(tau=tau, confidence=confidence)))


def verify_setting(rule: str, k: int = 8, tau_v: float = 0.5, head_threshold: float | None = None,
                   gate_tau: float | None = None, confidence: str = "prob") -> Setting:
    """Verify with commit `rule`; `gate_tau` gates it by the proposer's `confidence` statistic."""
    gate = ("" if gate_tau is None else f",gate={gate_tau:g}" if confidence == "prob"
            else f",{confidence} gate={gate_tau:g}")
    label = (f"K={k},{rule}" + (f",tau_v={tau_v:g}" if rule == "prob" else "")
             + (f",p>={head_threshold:g}" if head_threshold is not None else "") + gate)
    return Setting("verify", label, DecodeOptions(
        "verify", block_size=k,
        verify=VerifyRule(commit_rule=rule, tau_v=tau_v, head_threshold=head_threshold,
                          gate_tau=gate_tau),
        threshold=ThresholdRule(confidence=confidence)))


DEFAULT_TAUS = (0.95, 0.8, 0.5)
DEFAULT_TAU_VS = (0.3, 0.1)
DEFAULT_LOSSLESS = ((2, None), (3, None), (4, None), (4, 2), (6, 2), (6, 3), (6, None), (8, 2),
                    (8, 3))


def sweep_settings(modes: Sequence[str], have_head: bool, block_size: int = 8,
                   torch_threads: Sequence[int] = (1,), taus: Sequence[float] = DEFAULT_TAUS,
                   lossless: Sequence[tuple[int, int | None]] = DEFAULT_LOSSLESS,
                   adaptive: bool = True, tau_vs: Sequence[float] = DEFAULT_TAU_VS,
                   calibrated: bool = True, confidence: str = "prob",
                   relaxed_ps: Sequence[float] = (), head_thresholds: Sequence[float] = (),
                   gate_taus: Sequence[float] = (),
                   rules: Sequence[str] = COMMIT_RULES) -> list[Setting]:
    """The benchmark's sweep for the named modes (`ar` always comes first).

    `block_size` is the proposal length of `threshold` / `verify` (the proposer's MARS block);
    `taus` are thresholds of the `confidence` statistic; `lossless` lists (K, groups) layouts;
    each peer runs once per entry of `torch_threads`; `relaxed_ps` adds each lossless layout
    with that relaxed acceptance (`relaxed` rows); `head_thresholds` sweeps the commit head's
    threshold (its operating curve) beside its own; `gate_taus` adds verify's top-1 and prob
    rules gated by the proposer's `confidence` statistic at each tau
    (`DecodeOptions.verify.gate_tau`); verify runs only the commit `rules` named (head also needs
    `have_head`).
    `adaptive` adds the platform table's adaptive setting and, with `calibrated`, the calibrated
    one (its measurements compile every candidate layout: minutes at a real model's size).
    """
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise BenchError(f"--modes: unknown {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(ALL_MODES)}")
    out = [ar_setting()]
    if "threshold" in modes:
        out += [threshold_setting(t, block_size, confidence) for t in taus]
    if "lossless" in modes:
        out += [lossless_setting(k, g) for k, g in lossless]
        out += [relaxed_setting(k, g, p) for k, g in lossless for p in relaxed_ps]
        if adaptive:
            # K<=8: as `prove-jax generate --adaptive`
            out.append(lossless_setting(8, adaptive=True))
            if calibrated:
                out.append(calibrated_setting(8))
    if "verify" in modes:
        if "top1" in rules:
            out.append(verify_setting("top1", block_size))
        if "prob" in rules:
            out += [verify_setting("prob", block_size, t) for t in tau_vs]
        if "top1" in rules:
            out += [verify_setting("top1", block_size, gate_tau=g, confidence=confidence)
                    for g in gate_taus]
        if "prob" in rules:
            out += [verify_setting("prob", block_size, t, gate_tau=g, confidence=confidence)
                    for g in gate_taus for t in tau_vs]
        if have_head and "head" in rules:
            out.append(verify_setting("head", block_size))
            out += [verify_setting("head", block_size, head_threshold=t) for t in head_thresholds]
    for n in torch_threads:  # peers once per torch thread count (threads fight on a busy CPU)
        t = (("torch_threads", n),)
        if "hf_greedy" in modes:
            out.append(Setting("hf_greedy", f"threads={n}", peer_kwargs=t))
        if "hf_assisted" in modes:
            out.append(Setting("hf_assisted", f"draft=verifier,threads={n}", peer_kwargs=t))
        if "hf_prompt_lookup" in modes:
            out.append(Setting("hf_prompt_lookup", f"n=10,ngram=2,threads={n}", peer_kwargs=t + (
                ("prompt_lookup_num_tokens", 10), ("max_matching_ngram_size", 2))))
    return out
