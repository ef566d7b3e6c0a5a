"""The ASGI application (Starlette): the OpenAI routes, /health and /metrics, over an Engine.

Request bodies are checked by hand (protocol.py), not by a schema library, so every refusal is
an OpenAI error object naming the field, with status 400 (404 for an unknown model, 429 when
the queue is full, 503 while the model loads or the server stops).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prove_jax.data.chat import THINKING_SWITCH, chat_problem
from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.sampling import SamplingParams
from prove_jax.serving import protocol
from prove_jax.serving.engine import Engine, Handle, Update
from prove_jax.serving.metrics import CONTENT_TYPE
from prove_jax.serving.protocol import RequestError

# how often a non-streamed request checks that its client is still there
DISCONNECT_POLL_SECONDS = 0.25


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(engine: Engine, tokenizer, model_name: str, defaults: SamplingParams,
              max_logprobs: int | None) -> Starlette:
    """The server for `engine` (started by the app's lifespan), answering to `model_name`;
    `defaults`: the sampling a request's own fields override. `tokenizer` encodes prompts on
    the HTTP side: an instance of its own, not the engine's (a Rust tokenizer used from two
    threads at once can fail with "Already borrowed")."""
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        # uvicorn has stopped accepting and waited for the requests in flight: stop the engine
        # (a compile still running is not waited for: the process exits without it)
        wait = engine.options.shutdown_seconds + 30 if engine.ready.is_set() else 0
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, wait)

    async def health(request: Request) -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": engine.error.splitlines()[-1]},
                                status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "prove-jax"}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def reject(e: RequestError) -> JSONResponse:
        with engine.metrics.lock:
            engine.metrics.rejected.inc()
        return _error(e)

    async def completions(request: Request, chat: bool) -> Response:
        if not engine.ready.is_set():
            return _error(RequestError("the model is still loading; retry when /health answers 200",
                                       status=503, kind="server_error"))
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise RequestError(f"the request body is not JSON: {e}") from None
            parsed = protocol.parse_request(body, chat, defaults, max_logprobs)
            if parsed.model is not None and parsed.model != model_name:
                raise RequestError(f"The model '{parsed.model}' does not exist; this server serves "
                                   f"'{model_name}'", param="model", status=404,
                                   code="model_not_found")
            prompt = _encode(parsed, tokenizer)
            problem = engine.request_problem(prompt, parsed.params)
            if problem is not None:
                field, why = problem
                raise RequestError(f"the request {why}",
                                   param={"max_new_tokens": "max_tokens"}.get(field, field))
            handle = Handle(asyncio.get_running_loop(), prompt, parsed.params)
            try:
                engine.submit(handle)
            except DecodeError as e:
                raise RequestError(str(e), status=429 if "busy" in str(e) else 503,
                                   kind="server_error") from None
        except RequestError as e:
            return reject(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stamp = int(time.time())
        if parsed.stream:
            return StreamingResponse(_sse(engine, handle, parsed, rid, stamp, model_name,
                                          len(prompt)),
                                     media_type="text/event-stream")
        final = None
        try:
            while final is None:
                try:
                    update = await asyncio.wait_for(handle.updates.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(handle)
                        return Response(status_code=499)
                    continue
                if update.error is not None:
                    return _error(RequestError(update.error, status=503, kind="server_error"))
                if update.final:
                    final = update
        finally:
            if final is None:
                engine.cancel(handle)
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = protocol.logprobs_body(final.output_ids, final.logprobs, parsed.logprobs,
                                              chat, tokenizer)
        return JSONResponse(protocol.completion_body(rid, stamp, model_name, chat, final.text,
                                                     final.finish_reason, len(prompt),
                                                     len(final.output_ids), logprobs))

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


def _encode(parsed: protocol.ParsedRequest, tokenizer) -> list[int]:
    """The request's prompt as token ids: chat messages through the tokenizer's chat template."""
    if parsed.chat:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError("the model's tokenizer has no chat template: use /v1/completions",
                               param="messages")
        switch = {}
        if parsed.enable_thinking is not None:
            problem = chat_problem(tokenizer, parsed.enable_thinking)
            if problem is not None:
                raise RequestError(f"chat_template_kwargs: {problem}", param="chat_template_kwargs")
            switch = {THINKING_SWITCH: parsed.enable_thinking}
        ids = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True,
                                            tokenize=True, **switch)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if isinstance(parsed.prompt, list):
        return list(parsed.prompt)
    if tokenizer is None:
        raise RequestError("the model has no tokenizer: send the prompt as token ids",
                           param="prompt")
    return tokenizer.encode(parsed.prompt, add_special_tokens=False)


def _safe_text(text: str, stops) -> str:
    """The part of a running completion that can be sent: not a trailing character still being
    decoded (an incomplete UTF-8 sequence decodes as U+FFFD), nor a tail that may begin a stop
    string (the cut would come after it was sent)."""
    hold = max((len(s) for s in stops), default=1) - 1
    text = text[: len(text) - hold] if hold else text
    return text.rstrip("\ufffd")


async def _sse(engine: Engine, handle: Handle, parsed: protocol.ParsedRequest, rid: str, stamp: int,
               model: str, prompt_tokens: int):
    """Server-sent events of one streamed request; the client going away cancels its row."""
    chat = parsed.chat

    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    sent = ""
    try:
        if chat:
            yield event(protocol.chunk_body(rid, stamp, model, chat, None, role=True))
        while True:
            update: Update = await handle.updates.get()
            if update.error is not None:
                yield event(protocol.error_body(update.error, "server_error"))
                return
            text = update.text if update.final else _safe_text(update.text, parsed.params.stop)
            if len(text) > len(sent) and text.startswith(sent):
                yield event(protocol.chunk_body(rid, stamp, model, chat, text[len(sent):]))
                sent = text
            if update.final:
                yield event(protocol.chunk_body(rid, stamp, model, chat, None,
                                                finish_reason=update.finish_reason))
                if parsed.include_usage:
                    yield event(protocol.usage_chunk(rid, stamp, model, chat, prompt_tokens,
                                                     len(update.output_ids)))
                yield "data: [DONE]\n\n"
                return
    finally:
        engine.cancel(handle)  # a no-op once it finished
