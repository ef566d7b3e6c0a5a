"""One measured configuration: a `Measurement`, the runners that fill it (ours, a transformers
peer) and `measure_batch`, which warms them up and times them interleaved."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

from prove_jax.decoding import DecodeOptions
from prove_jax.decoding.calibrate import calibrate_decoder
from prove_jax.evaluation import peers
from prove_jax.evaluation.compare import our_sequence, peer_sequence
from prove_jax.evaluation.model_pair import ModelPair
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.sweep import BenchError, Setting
from prove_jax.profiling import StepProfile


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

    def __init__(self, pair: ModelPair, setting: Setting, prompts, max_new_tokens: int,
                 batch_size: int, profile: StepProfile | None = None):
        self.pair, self.setting, self.prompts = pair, setting, prompts
        self.max_new, self.batch = max_new_tokens, batch_size
        self.profile = profile or StepProfile(None, "benchmark_pass")  # --profile: traced passes
        self.width = max(len(p) for p in prompts)  # one prompt width and queue size: one program
        self.decoder = pair.decoder(setting.options)
        self.m = Measurement(setting, batch_size)
        if setting.calibrate:  # measured before any timing; its own compiles are not counted
            calibrate_decoder(self.decoder, prompts, batch_size, max_new_tokens, log=log)

    def _generate(self, prompts):
        return self.decoder.generate(prompts, self.max_new, batch_size=self.batch,
                                     prompt_width=self.width, queue_size=len(self.prompts))

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
        self.setting, self.prompts = setting, prompts
        self.max_new, self.batch = max_new_tokens, batch_size
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
            self.fn = lambda ps, n, warm: peers.hf_assisted(target, draft, ps, n, warmup=warm,
                                                            **common, **kw)
        else:
            self.fn = lambda ps, n, warm: peers.hf_prompt_lookup(target, ps, n, warmup=warm,
                                                                 **common, **kw)
        self.m = Measurement(setting, batch_size)

    def _set_threads(self) -> None:
        if self.torch_threads is not None:
            import torch  # optional: only the peers need it
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


def measure_batch(runners: Sequence, repeats: int,
                  progress: Callable[[str], None] = log) -> list[Measurement]:
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
            rate = r.m.generated_tokens / s if s else 0
            progress(f"  pass {rep + 1}/{repeats} {r.setting.name:<34} batch {r.m.batch_size:<3} "
                     f"{r.m.generated_tokens:>6} tok  {s:7.2f}s  {rate:8.1f} tok/s")
    return [r.m for r in runners]
