"""The OpenAI-compatible HTTP API (FastAPI), with vLLM's request fields and response shapes.

    GET  /health, /v1/models
    POST /v1/completions, /v1/chat/completions (stream: server-sent events), /tokenize, /detokenize

Every request's choices go to the shared `EngineDriver` (continuous batching with every other client's);
log-probs (`logprobs`, `echo`) come from one scoring forward of prompt + tokens (`scoring.py`). A client
that disconnects cancels its choices. Bad input is an `APIError` (errors.py), answered with OpenAI's
error body; with an API key set, every route but /health wants `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ulorl_jax.decode.engine import Request as EngineRequest
from ulorl_jax.serving import protocol, text
from ulorl_jax.serving.driver import Job
from ulorl_jax.serving.errors import APIError
from ulorl_jax.serving.formats import ChatFormat, Choice, CompletionFormat, Format
from ulorl_jax.serving.protocol import GenerationParams, Prompt
from ulorl_jax.serving.state import ServingState

DISCONNECT_POLL_S = 0.25


def _key(seed: int | None, choice: int) -> np.ndarray:
    """A choice's PRNG key (raw uint32 [2]): seeded requests are reproducible; choice 0 of seed s is
    `jax.random.PRNGKey(s)`."""
    if seed is None:
        return np.frombuffer(secrets.token_bytes(8), np.uint32).copy()
    return np.array([choice & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def build_app(s: ServingState) -> FastAPI:
    app = FastAPI(title="ulorl serve", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    def auth(request: Request) -> None:
        if s.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {s.api_key}".encode()):
            raise APIError("missing or wrong API key (send `Authorization: Bearer KEY`)" if given else
                           "missing API key (send `Authorization: Bearer KEY`)", status=401)

    async def body_of(request: Request) -> dict:
        auth(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(f"malformed JSON in the request body: {err}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
        protocol.check_model(body, s.served_name)
        return body

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{"id": s.served_name, "object": "model", "created": s.created,
                                            "owned_by": "ulorl", "root": s.root, "parent": None,
                                            "max_model_len": s.limits.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        if "messages" in body:
            ids = protocol.parse_messages(body, s.tokenizer, s.limits).ids
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError(f"prompt must be a string, got {prompt!r}", param="prompt")
            if s.tokenizer is None:
                raise APIError("the model has no tokenizer", param="prompt")
            ids = list(s.tokenizer.encode(prompt, add_special_tokens=protocol.get_bool(body, "add_special_tokens",
                                                                                         True)))
        return {"count": len(ids), "max_model_len": s.limits.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(f"tokens must be a list of token ids, got {ids!r}", param="tokens")
        bad = sorted({t for t in ids if not 0 <= t < s.limits.vocab_size})
        if bad:
            raise APIError(f"tokens holds ids outside the vocabulary [0, {s.limits.vocab_size}): {bad[:8]}",
                           param="tokens")
        return {"prompt": text.decode(s.tokenizer, ids)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompts, params = protocol.parse_completion(body, s.tokenizer, s.limits)
        return await _serve(request, prompts, params, CompletionFormat(s, params, prompts))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        prompt, params = protocol.parse_chat(body, s.tokenizer, s.limits)
        return await _serve(request, [prompt], params, ChatFormat(s, params, [prompt]))

    async def _serve(request: Request, prompts: list[Prompt], params: GenerationParams, fmt: Format):
        choices = _start(s, prompts, params)
        if params.stream:
            return StreamingResponse(_stream(request, choices, fmt), media_type="text/event-stream")
        try:
            if not await _until_done(request, choices):
                return Response(status_code=499)  # the client has gone: nobody reads this
            return await fmt.response(choices)
        finally:
            _cancel(choices)

    return app


def _start(s: ServingState, prompts: list[Prompt], params: GenerationParams) -> list[Choice]:
    """Every prompt's n choices, submitted to the engine together."""
    loop = asyncio.get_running_loop()
    choices = []
    for i, prompt in enumerate(prompts):
        if params.max_tokens:
            try:
                s.engine.check_request(prompt.ids, params.max_tokens)
            except ValueError as err:  # e.g. more KV pages than the pool has
                raise APIError(str(err), param="max_tokens") from None
        for j in range(params.n):
            job = None
            if params.max_tokens:
                job = Job(EngineRequest(prompt.ids, params.max_tokens, _key(params.seed, j)), params.sampling, loop)
            choice = Choice(i * params.n + j, prompt, text.ChoiceText(s.tokenizer, params.stop), job)
            if job is None:
                choice.text.add([], "budget")
            choices.append(choice)
    s.driver.submit([c.job for c in choices if c.job is not None])
    return choices


def _cancel(choices: list[Choice]) -> None:
    for c in choices:
        if c.job is not None:
            c.job.cancel()


async def _next_update(c: Choice) -> None:
    """Wait for the choice's next tokens and add them; a stop string seen cancels its engine job."""
    update = await c.job.updates.get()
    if update.error is not None:
        raise RuntimeError(f"the engine failed: {update.error}") from update.error
    c.text.add(update.tokens, update.stop)
    if c.text.done:
        c.job.cancel()


async def _until_done(request: Request, choices: list[Choice]) -> bool:
    """Every choice to its end; False if the client disconnected first."""
    async def one(c: Choice):
        while not c.text.done:
            await _next_update(c)

    work = asyncio.ensure_future(asyncio.gather(*(one(c) for c in choices if c.job is not None)))
    while True:
        done, _ = await asyncio.wait([work], timeout=DISCONNECT_POLL_S)
        if done:
            work.result()
            return True
        if await request.is_disconnected():
            work.cancel()
            return False


async def _stream(request: Request, choices: list[Choice], fmt: Format) -> AsyncIterator[str]:
    """Server-sent events: chunks as tokens come (any choice, any order), a usage chunk if asked, [DONE]."""
    ready: asyncio.Queue = asyncio.Queue()

    async def one(c: Choice):
        try:
            while not c.text.done:
                await _next_update(c)
                await ready.put((c, None))
        except Exception as err:  # noqa: BLE001  (reported in the stream)
            await ready.put((c, err))

    tasks = [asyncio.ensure_future(one(c)) for c in choices if c.job is not None]
    try:
        for c in choices:
            first = await fmt.first_chunk(c)
            if first is not None:
                yield _sse(first)
            if c.job is None:
                yield _sse(await fmt.chunk(c))
        left = len(tasks)
        while left:
            c, err = await ready.get()
            if err is not None:
                yield _sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
                break
            if c.text.done:
                left -= 1
            chunk = await fmt.chunk(c)
            if chunk is not None:
                yield _sse(chunk)
        else:
            if fmt.params.include_usage:
                yield _sse(fmt.usage_chunk(choices))
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects (the response task is cancelled)
        _cancel(choices)
        for t in tasks:
            t.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
