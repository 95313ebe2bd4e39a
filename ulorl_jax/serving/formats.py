"""The response shapes of /v1/completions and /v1/chat/completions (vLLM's): whole responses, stream chunks,
usage and log-probs of each choice."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from ulorl_jax.serving import text
from ulorl_jax.serving.driver import Job
from ulorl_jax.serving.protocol import GenerationParams, Prompt
from ulorl_jax.serving.state import ServingState


@dataclasses.dataclass(eq=False)
class Choice:
    index: int
    prompt: Prompt
    text: text.ChoiceText
    job: Job | None  # None: nothing to generate (max_tokens 0)
    logged: int = 0  # tokens whose log-probs were streamed



class Format:
    """What differs between /v1/completions and /v1/chat/completions: the shape of choices and chunks."""

    object_name = chunk_object = prefix = ""

    def __init__(self, s: ServingState, params: GenerationParams, prompts: list[Prompt]):
        self.s, self.params, self.prompts = s, params, prompts
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.s.served_name}

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(c.text.tokens) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": self.usage(choices)}

    async def scores(self, c: Choice):
        ids = c.prompt.ids + c.text.tokens
        if len(ids) < 2:
            return ids, None
        return ids, await asyncio.to_thread(self.s.scorer.score, ids)

    def token_ids(self, c: Choice) -> dict:
        return {"prompt_token_ids": c.prompt.ids, "token_ids": c.text.tokens} if self.params.return_token_ids else {}

    async def response(self, choices: list[Choice]) -> dict:
        return {**self.head(self.object_name), "choices": [await self.choice(c) for c in choices],
                "usage": self.usage(choices)}

    async def first_chunk(self, c: Choice) -> dict | None:
        return None

    async def choice(self, c: Choice) -> dict:
        raise NotImplementedError

    async def chunk(self, c: Choice) -> dict | None:
        raise NotImplementedError

    async def new_logprobs(self, c: Choice, render) -> Any:
        """Log-probs of the tokens not streamed yet (`render(ids, scores, start)`), or None."""
        if self.params.logprobs is None or c.logged == len(c.text.tokens):
            return None
        ids, scores = await self.scores(c)
        start, c.logged = len(c.prompt.ids) + c.logged, len(c.text.tokens)
        return render(ids, scores, start)


class CompletionFormat(Format):
    object_name, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def _prompt_text(self, c: Choice) -> str:
        return c.prompt.text if c.prompt.text is not None else text.decode(self.s.tokenizer, c.prompt.ids)

    def _render(self, ids, scores, start, offset=0):
        return text.completion_logprobs(self.s.tokenizer, ids, scores, start, self.params.logprobs, offset)

    async def choice(self, c: Choice) -> dict:
        p = self.params
        logprobs = None
        if p.logprobs is not None:
            ids, scores = await self.scores(c)
            logprobs = self._render(ids, scores, 0 if p.echo else len(c.prompt.ids))
        body = (self._prompt_text(c) if p.echo else "") + c.text.text
        return {"index": c.index, "text": body, "logprobs": logprobs, "finish_reason": c.text.finish_reason,
                "stop_reason": c.text.stop_reason, **self.token_ids(c)}

    async def first_chunk(self, c: Choice) -> dict | None:
        if not self.params.echo:
            return None
        logprobs = None
        if self.params.logprobs is not None:
            ids = c.prompt.ids
            scores = await asyncio.to_thread(self.s.scorer.score, ids) if len(ids) > 1 else None
            logprobs = self._render(ids, scores, 0)
        return {**self.head(self.chunk_object), "choices": [
            {"index": c.index, "text": self._prompt_text(c), "logprobs": logprobs, "finish_reason": None}]}

    async def chunk(self, c: Choice) -> dict | None:
        delta = c.text.delta()
        logprobs = await self.new_logprobs(c, lambda ids, scores, start: self._render(ids, scores, start))
        if not delta and not c.text.done and logprobs is None:
            return None
        return {**self.head(self.chunk_object), "choices": [
            {"index": c.index, "text": delta, "logprobs": logprobs, "finish_reason": c.text.finish_reason,
             "stop_reason": c.text.stop_reason, **(self.token_ids(c) if c.text.done else {})}]}


class ChatFormat(Format):
    object_name, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _render(self, ids, scores, start):
        return text.chat_logprobs(self.s.tokenizer, ids, scores, start, self.params.logprobs)

    async def choice(self, c: Choice) -> dict:
        logprobs = None
        if self.params.logprobs is not None and c.text.tokens:
            ids, scores = await self.scores(c)
            logprobs = self._render(ids, scores, len(c.prompt.ids))
        return {"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                "logprobs": logprobs, "finish_reason": c.text.finish_reason, "stop_reason": c.text.stop_reason,
                **self.token_ids(c)}

    async def first_chunk(self, c: Choice) -> dict | None:
        return {**self.head(self.chunk_object), "choices": [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}

    async def chunk(self, c: Choice) -> dict | None:
        delta = c.text.delta()
        logprobs = await self.new_logprobs(c, self._render)
        if not delta and not c.text.done and logprobs is None:
            return None
        return {**self.head(self.chunk_object), "choices": [
            {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
             "finish_reason": c.text.finish_reason, "stop_reason": c.text.stop_reason}]}
