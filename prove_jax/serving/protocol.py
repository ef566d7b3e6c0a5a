"""The OpenAI API's request and response bodies, mapped onto the engine: which fields a request
may give (an unknown one is refused, as OpenAI refuses it, rather than silently ignored), the
SamplingParams they make, and the completion, chunk and error objects sent back."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from prove_jax.errors import ProveJaxError
from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.requests import prompt_ids_problem
from prove_jax.decoding.sampling import SamplingParams


class RequestError(ProveJaxError, ValueError):
    """A request the server refuses: its HTTP status and the OpenAI error object's fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Fields either endpoint reads (OpenAI's names, plus the engine's own top_k, min_p and
# stop_token_ids, as vLLM takes them) and those it accepts only at their no-op value.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                 "stream_options", "n", "top_k", "min_p", "stop_token_ids", "user",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "max_completion_tokens",
                               "chat_template_kwargs"}
# field -> the values that change nothing (anything else is refused, named)
NO_OP_VALUES = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {})}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass
class ParsedRequest:
    """A checked request body: what to decode and how to answer."""
    chat: bool
    model: str | None
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict] | None  # chat: [{"role", "content": str}]
    params: SamplingParams  # validated; max_new_tokens None: the server's
    logprobs: int | None  # alternatives per token to return; None: no logprobs
    stream: bool
    include_usage: bool  # stream: a last chunk carries the usage
    # chat: the template's thinking switch (Qwen3's), as vLLM takes it
    enable_thinking: bool | None = None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_request(body: Any, chat: bool, defaults: SamplingParams,
                  max_logprobs: int | None) -> ParsedRequest:
    """Check a request body of /v1/completions (`chat` False) or /v1/chat/completions against
    what this server serves; `defaults` are the server's sampling flags, which the request's
    fields override. Raises RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in body:
        if key not in allowed:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
    for key, no_op in NO_OP_VALUES.items():
        if key in body and body[key] not in no_op:
            why = {"n": "send n requests instead (each with its own seed)",
                   "best_of": "send several requests instead"}.get(
                       key, "this server does not support it")
            raise RequestError(f"{key}={body[key]!r} is not supported: {why}", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("'stream_options' applies with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("'stream_options' may hold only include_usage",
                               param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    prompt = messages = None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    logprobs = _logprobs(body, chat, max_logprobs)
    if logprobs is not None and stream:
        raise RequestError("logprobs with stream: true is not supported; ask without streaming",
                           param="logprobs")
    return ParsedRequest(chat=chat, model=model, prompt=prompt, messages=messages,
                         params=_params(body, chat, defaults), logprobs=logprobs, stream=stream,
                         include_usage=include_usage,
                         enable_thinking=_thinking(body.get("chat_template_kwargs")))


def _thinking(kwargs) -> bool | None:
    """The one chat template variable served, `enable_thinking` (vLLM's `chat_template_kwargs`)."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        raise RequestError("'chat_template_kwargs' may hold only enable_thinking (true or false)",
                           param="chat_template_kwargs")
    switch = kwargs.get("enable_thinking")
    if switch is not None and not isinstance(switch, bool):
        raise RequestError("'chat_template_kwargs.enable_thinking' must be true or false",
                           param="chat_template_kwargs")
    return switch


def _prompt(prompt) -> str | list[int]:
    """One prompt: a string, token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"{len(prompt)} prompts in one request are not supported: send one "
                           f"request per prompt", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty", param="prompt")
        return prompt
    if prompt is None:
        raise RequestError("'prompt' is required", param="prompt")
    problem = prompt_ids_problem(prompt)
    if problem is not None:
        raise RequestError("'prompt' must be a string or a list of token ids: "
                           f"{problem.replace('prompt_ids', 'prompt')}",
                           param="prompt")
    return prompt


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content}",
                           param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a 'role' ({', '.join(ROLES)})",
                               param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported",
                                   param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _logprobs(body: dict, chat: bool, max_logprobs: int | None) -> int | None:
    """Alternatives per token the request wants (0: the token's own logprob only), or None."""
    value = body.get("logprobs")
    if chat:
        if value not in (None, True, False):
            raise RequestError("'logprobs' must be true or false", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None and not value:
            raise RequestError("'top_logprobs' needs logprobs: true", param="top_logprobs")
        n, param = (None if not value else (top or 0)), "top_logprobs"
    else:
        n, param = value, "logprobs"
    if n is None:
        return None
    if not _is_int(n) or n < 0:
        raise RequestError(f"'{param}' must be an integer >= 0", param=param)
    if max_logprobs is None:
        raise RequestError("this server records no log-probabilities: start it with --logprobs N",
                           param=param)
    if n > max_logprobs:
        raise RequestError(f"'{param}' is {n}, more than the {max_logprobs} this server records "
                           f"(--logprobs)", param=param)
    return n


def _params(body: dict, chat: bool, defaults: SamplingParams) -> SamplingParams:
    """The request's SamplingParams: the server's defaults overridden by its fields, validated
    by SamplingParams itself (so the server refuses what `generate` refuses)."""
    fields = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
              "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids",
              "max_tokens": "max_new_tokens"}
    if chat and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise RequestError("give max_tokens or max_completion_tokens, not both",
                               param="max_tokens")
        fields = dict(fields, max_completion_tokens="max_new_tokens")
    given = {}
    for key, name in fields.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            value = tuple(value)
        given[name] = value
    try:
        return dataclasses.replace(defaults, **given).validate()
    except DecodeError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        back = {v: k for k, v in fields.items()}
        param = back.get(field, field)
        if field in back:
            message = param + message[len(field):]
        raise RequestError(message, param=param) from None


# ---- responses ---------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, chat: bool, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int, logprobs=None) -> dict:
    """The whole (non-streamed) response."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(rid: str, created: int, model: str, chat: bool, text: str | None,
               finish_reason: str | None = None, role: bool = False) -> dict:
    """One streamed chunk: a piece of text (chat: the assistant role with the first), or the
    finish reason with the last."""
    if chat:
        if role:
            delta = {"role": "assistant", "content": ""}
        else:
            delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def logprobs_body(ids: Sequence[int], logprobs, n: int, chat: bool, tokenizer) -> dict:
    """OpenAI's logprobs object for output tokens `ids` and the engine's per-token
    (logprob, [(id, logprob), ...]) (the n most likely kept)."""
    piece = lambda t: tokenizer.decode([int(t)])  # noqa: E731
    if chat:
        def entry(t, lp):
            s = piece(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top[:n]]}
                            for t, (lp, top) in zip(ids, logprobs)]}
    tokens = [piece(t) for t in ids]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs],
            "top_logprobs": [{piece(a): alp for a, alp in top[:n]} for _, top in logprobs],
            "text_offset": offsets}
