"""Text in, text out: the `generate` command's requests and per-request controls in Python.

>>> gen = TextGenerator.load(DEMO_PROPOSER, DecodeOptions("lossless", block_size=4))
>>> out = gen.generate("def fibonacci(n):", max_new_tokens=64, stop=["\\n\\n"])
>>> out["text"], out["finish_reason"], out["stats"]["tokens_per_forward"]

A request is a prompt string or a record of the request-file schema (docs/decoding.md:
`prompt` or `prompt_ids`, and its own `temperature`, `top_k`, `top_p`, `min_p`, `seed`,
`max_new_tokens` (or `max_tokens`), `stop`, `stop_token_ids`, `logprobs`). Each result is the
record `generate` writes. Every control works or raises: an unknown field, a bad value or a
prompt the model cannot take is a `DecodeError` naming the request.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from prove_jax.data.chat import chat_problem
from prove_jax.decoding.engine import Decoder
from prove_jax.decoding.loading import build_decoder
from prove_jax.decoding.options import DecodeError, DecodeOptions
from prove_jax.decoding.request_run import RequestStream
from prove_jax.decoding.requests import (encode_prompts, record_problem, request_logprobs,
                                         request_params)
from prove_jax.decoding.results_file import output_record
from prove_jax.decoding.sampling import SamplingParams


class TextGenerator:
    """A Decoder with its tokenizer; `generate` decodes text requests with continuous batching."""

    def __init__(
        self, decoder: Decoder, tokenizer, chat: bool = False, enable_thinking: bool | None = None
    ):
        """`chat`: text prompts go through the tokenizer's chat template; `enable_thinking`: its
        thinking switch (Qwen3's; None: the template's default; data/chat.py)."""
        if tokenizer is None:
            raise DecodeError(
                "text in and out needs the checkpoint's tokenizer (this one has none); "
                "give token ids to Decoder.generate instead"
            )
        if enable_thinking is not None and not chat:
            raise DecodeError("enable_thinking is the chat template's switch: it needs chat=True")
        problem = chat_problem(tokenizer, enable_thinking) if chat else None
        if problem is not None:
            raise DecodeError(f"chat: {problem}")
        self.decoder, self.tokenizer = decoder, tokenizer
        self.chat, self.enable_thinking = chat, enable_thinking
        # decoders recording N alternatives (compiled once)
        self._with_logprobs: dict[int, Decoder] = {}

    @classmethod
    def load(cls, model: str, options: DecodeOptions = DecodeOptions(), verifier: str | None = None,
             dtype: str = "float32", mesh_shape: str | None = None, chat: bool = False,
             enable_thinking: bool | None = None) -> "TextGenerator":
        """The generator of a proposer checkpoint (and a verifier for mode verify)."""
        decoder, tokenizer = build_decoder(model, options, verifier_path=verifier, dtype=dtype,
                                           mesh_shape=mesh_shape)
        return cls(decoder, tokenizer, chat=chat, enable_thinking=enable_thinking)

    def generate(self, requests: str | dict | Sequence[str | dict], *, max_new_tokens: int = 128,
                 batch_size: int = 1, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), logprobs: int | None = None,
                 chunk_steps: int = 16) -> dict | list[dict]:
        """Decode one request (a dict back) or several (a list, in order). The keyword controls
        are every request's defaults, as generate's flags are; a record's own fields override
        them. `seed` seeds the requests that give none (request i: `request_seed(seed, i)`)."""
        one = isinstance(requests, (str, dict))
        records = [_record(r, i) for i, r in enumerate([requests] if one else requests)]
        if not records:
            raise DecodeError("no requests given")
        defaults = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  max_new_tokens=max_new_tokens, stop=tuple(stop),
                                  stop_token_ids=tuple(stop_token_ids)).validate()
        request_logprobs({}, logprobs)  # the default's value, checked
        for i, rec in enumerate(records):
            problem = record_problem(rec, defaults, i, seed)
            if problem is not None:
                raise DecodeError(f"request {rec['id']!r}: {problem}")
        params = [request_params(rec, defaults, i, seed) for i, rec in enumerate(records)]
        counts = [request_logprobs(rec, logprobs) for rec in records]
        prompts = encode_prompts(
            records, self.tokenizer, chat=self.chat, enable_thinking=self.enable_thinking
        )
        decoder = self._decoder(max((n for n in counts if n is not None), default=None))
        decoder.check_prompts(
            prompts, [p.max_new_tokens for p in params], names=[r["id"] for r in records]
        )
        job = RequestStream(decoder, prompts, max_new_tokens, batch_size, params=params,
                            tokenizer=self.tokenizer, chunk_steps=chunk_steps)
        results = {}
        for event, result in job:
            if result is not None:
                rec = records[event.index]
                results[event.index] = output_record(rec["id"], result, self.tokenizer,
                                                     logprobs=counts[event.index])
        out = [results[i] for i in range(len(records))]
        return out[0] if one else out

    def _decoder(self, logprobs: int | None) -> Decoder:
        """The decoder that records `logprobs` alternatives per token (at least), or this one."""
        have = self.decoder.options.logprobs
        if logprobs is None or (have is not None and have >= logprobs):
            return self.decoder
        if logprobs not in self._with_logprobs:
            self._with_logprobs[logprobs] = self.decoder.with_options(
                dataclasses.replace(self.decoder.options, logprobs=logprobs))
        return self._with_logprobs[logprobs]


def _record(request: str | dict, index: int) -> dict:
    if isinstance(request, str):
        return {"id": index, "prompt": request}
    if isinstance(request, dict):
        return {"id": index} | request
    raise DecodeError(f"request {index} is a {type(request).__name__}: give a prompt string or a "
                      f"request record (a dict with 'prompt' or 'prompt_ids')")
