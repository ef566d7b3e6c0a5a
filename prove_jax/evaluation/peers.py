"""Peer baselines on the same weights: transformers (torch CPU) greedy, assisted and prompt-lookup.

The benchmark compares our decoding modes with what a user of transformers would run on the
same model (converted to HF format by our flax-to-hf converter):

- `hf_greedy`: `generate(do_sample=False)` with its KV cache (batched with left padding when
  `batch_size > 1`);
- `hf_assisted`: assisted generation with a draft model (`assistant_model=`); lossless with
  greedy, batch 1 only in transformers;
- `hf_prompt_lookup`: prompt-lookup decoding (`prompt_lookup_num_tokens=`); lossless with
  greedy, batch 1 only.

Each run returns the new token ids per prompt trimmed at EOS (the EOS itself dropped), the wall
seconds of the `generate` calls (model loading and the optional warm-up excluded) and the
number of forwards, counted with forward hooks on the target (and draft) model. Generation
settings are passed as an explicit `GenerationConfig`, so a `generation_config.json` saved with
the model (sampling, repetition penalty, ...) cannot change the baseline.

torch is a test/benchmark dependency only (requirements-test.txt): it is imported inside the
functions, and a missing torch gives a one-line `PeerError`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Sequence

from prove_jax.errors import ProveJaxError

PEER_MODES = ("hf_greedy", "hf_assisted", "hf_prompt_lookup")


class PeerError(ProveJaxError, ValueError):
    """torch missing, a model directory that does not load, or bad run options."""


@dataclasses.dataclass
class PeerRun:
    """One peer run over a prompt set.

    `target_forwards[i]` counts the target-model forward calls that processed prompt i (in a
    batched call every row of the batch is charged each forward), so
    `tokens_per_forward = new tokens / target forwards` is per row, as for our modes.
    """
    mode: str
    outputs: list[list[int]]            # per prompt: new ids, trimmed at the first EOS
    wall_seconds: float                 # sum over generate calls
    target_forwards: list[int]          # per prompt
    draft_forwards: list[int] | None    # per prompt (assisted only)
    batch_size: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_forward(self) -> float:
        total = sum(self.target_forwards)
        return self.num_tokens / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


def _torch():
    try:
        import torch
    except ImportError:
        raise PeerError("peer baselines need torch: pip install -r requirements-test.txt "
                        "(pins the CPU wheel torch==2.13.0)") from None
    return torch


def load_hf_model(model_dir: str, dtype: str = "float32"):
    """A transformers causal LM from an HF-format directory, offline, in eval mode."""
    torch = _torch()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise PeerError(f"not an HF model directory (no config.json): {model_dir}")
    from transformers import AutoModelForCausalLM  # slow to import: only the peers need it
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                     local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerError(f"cannot load HF model {model_dir}: {first[:300]}") from None
    return model.eval()


def trim_at_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Ids before the first EOS (all of them when there is none)."""
    eos = set(eos_ids)
    out = []
    for t in ids:
        if t in eos:
            break
        out.append(int(t))
    return out


class _ForwardCounter:
    """Counts forward calls of a module (a hook on its top-level forward)."""

    def __init__(self, module):
        self.count = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1

    def close(self):
        self._handle.remove()


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        raise PeerError("no EOS token id: pass eos_token_id")
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def _generation_config(max_new_tokens: int, eos_ids: list[int], pad_id: int, **extra):
    from transformers import GenerationConfig  # slow to import: only the peers need it
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                            min_new_tokens=0, eos_token_id=eos_ids, pad_token_id=pad_id,
                            repetition_penalty=1.0, **extra)


def _check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab_size: int):
    if not prompts:
        raise PeerError("no prompts")
    if max_new_tokens < 1:
        raise PeerError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise PeerError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise PeerError(
                f"prompt {i} has token ids outside the vocabulary ({vocab_size}): {bad[:3]}"
            )


def _run(mode: str, model, prompts, max_new_tokens, eos_token_id, pad_token_id, batch_size,
         warmup, config_extra: dict, generate_kwargs: dict, draft=None) -> PeerRun:
    torch = _torch()
    _check_prompts(prompts, max_new_tokens, model.config.vocab_size)
    if batch_size < 1:
        raise PeerError(f"batch_size must be >= 1, got {batch_size}")
    eos_ids = _eos_ids(model, eos_token_id)
    pad_id = eos_ids[0] if pad_token_id is None else int(pad_token_id)
    gen_cfg = _generation_config(max_new_tokens, eos_ids, pad_id, **config_extra)

    def generate(batch: list[list[int]], new_tokens: int | None = None):
        # Left padding: every row's last prompt token sits at the same column.
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        cfg = gen_cfg
        if new_tokens is not None:
            cfg = copy.deepcopy(gen_cfg)
            cfg.max_new_tokens = new_tokens
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                 **generate_kwargs)
        return [trim_at_eos(row[width:].tolist(), eos_ids) for row in out]

    if warmup:  # first call pays one-off allocation and dispatch costs; not timed or counted
        generate([list(prompts[0])], new_tokens=2)
    target_counter = _ForwardCounter(model)
    draft_counter = _ForwardCounter(draft) if draft is not None else None
    outputs, target_fw, draft_fw, seconds = [], [], [], 0.0
    try:
        for start in range(0, len(prompts), batch_size):
            batch = [list(map(int, p)) for p in prompts[start:start + batch_size]]
            t_before = target_counter.count
            d_before = draft_counter.count if draft_counter else 0
            t0 = time.perf_counter()
            outputs.extend(generate(batch))
            seconds += time.perf_counter() - t0
            target_fw.extend([target_counter.count - t_before] * len(batch))
            if draft_counter:
                draft_fw.extend([draft_counter.count - d_before] * len(batch))
    finally:
        target_counter.close()
        if draft_counter:
            draft_counter.close()
    return PeerRun(mode, outputs, seconds, target_fw, draft_fw if draft is not None else None,
                   batch_size)


def hf_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
              batch_size: int = 1, warmup: bool = True) -> PeerRun:
    """transformers greedy `generate(do_sample=False)` with its KV cache."""
    return _run("hf_greedy", model, prompts, max_new_tokens, eos_token_id, pad_token_id,
                batch_size, warmup, {}, {})


def hf_assisted(model, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                num_assistant_tokens: int | None = None,
                assistant_confidence_threshold: float | None = None,
                warmup: bool = True) -> PeerRun:
    """Assisted generation with `draft` as the assistant model (batch 1, greedy, lossless).

    `num_assistant_tokens` / `assistant_confidence_threshold` are set on the draft's
    generation config (transformers reads them there); None keeps transformers' defaults
    (20 tokens, constant schedule, confidence threshold 0.4 in 5.24).

    The two must share a tokenizer, not a row count (Qwen2.5-3B pads its ids to 151,936 rows,
    -32B to 152,064). transformers takes any difference in rows for another tokenizer and
    would switch to its cross-tokenizer text round trip, so the draft's embedding rows are
    resized in place to the target's (new rows at the mean of the old ones, rarely a draft's
    argmax). Assisted greedy stays lossless whatever the draft proposes.
    """
    if draft.config.vocab_size != model.config.vocab_size:
        draft.resize_token_embeddings(model.config.vocab_size)
    draft.eval()
    if num_assistant_tokens is not None:
        draft.generation_config.num_assistant_tokens = int(num_assistant_tokens)
        draft.generation_config.num_assistant_tokens_schedule = "constant"
    if assistant_confidence_threshold is not None:
        draft.generation_config.assistant_confidence_threshold = float(
            assistant_confidence_threshold
        )
    return _run("hf_assisted", model, prompts, max_new_tokens, eos_token_id, pad_token_id, 1,
                warmup, {}, {"assistant_model": draft}, draft=draft)


def hf_prompt_lookup(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     eos_token_id: int | Sequence[int] | None = None,
                     pad_token_id: int | None = None, prompt_lookup_num_tokens: int = 10,
                     max_matching_ngram_size: int = 2, warmup: bool = True) -> PeerRun:
    """Prompt-lookup decoding: drafts copied from n-gram matches in the context (batch 1)."""
    if prompt_lookup_num_tokens < 1 or max_matching_ngram_size < 1:
        raise PeerError("prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1")
    return _run("hf_prompt_lookup", model, prompts, max_new_tokens, eos_token_id, pad_token_id, 1,
                warmup, {"prompt_lookup_num_tokens": int(prompt_lookup_num_tokens),
                         "max_matching_ngram_size": int(max_matching_ngram_size)}, {})
