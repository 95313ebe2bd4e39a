"""A client that disconnects cancels its choices (the engine then frees their slots: tests/serve/test_driver.py).

The app is called in-process through ASGI with a stand-in driver whose jobs never end on their own, so the
only way a job gets cancelled is the disconnect: deterministic, and no model is run.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ulorl_jax.data.tokenizer import build_tokenizer
from ulorl_jax.serving.app import ServingState, build_app
from ulorl_jax.serving.driver import Update
from ulorl_jax.serving.protocol import Limits


class _Engine:
    def check_request(self, ids, max_new_tokens):
        return ids, max_new_tokens


class _Driver:
    """Answers each submitted job with one token, then nothing: it would run until cancelled."""

    def __init__(self, token: int):
        self.jobs, self.token = [], token

    def submit(self, jobs):
        self.jobs += jobs
        for job in jobs:
            job.updates.put_nowait(Update([self.token]))


def _call(app, body: dict, disconnect_after_body: bool):
    """POST /v1/completions; the client disconnects after the first body bytes (or at once, if not streaming)."""
    sent, got_body = [], asyncio.Event()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if request:
            return request.pop(0)
        if disconnect_after_body:
            await got_body.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return sent


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_cancels_every_choice(stream):
    tokenizer = build_tokenizer()
    driver = _Driver(tokenizer.convert_tokens_to_ids("a"))
    state = ServingState(_Engine(), driver, None, tokenizer, Limits(64, 128, len(tokenizer)), "m", "here")
    sent = _call(build_app(state), {"prompt": ["hi", "yo"], "n": 2, "max_tokens": 100, "temperature": 0,
                                    "stream": stream}, disconnect_after_body=stream)
    assert len(driver.jobs) == 4
    assert all(job.cancelled for job in driver.jobs)
    if stream:  # the client saw a token before it left
        assert any(b'"text": "a"' in m.get("body", b"") for m in sent if m["type"] == "http.response.body")
