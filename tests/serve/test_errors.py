"""Every bad request gets OpenAI's error body with the right status and the field it names, and the server
answers a good request right after each one."""

from __future__ import annotations

import pytest
from serve_utils import MAX_LEN, MAX_PROMPT, NAME, VOCAB, get, post

pytestmark = pytest.mark.slow

C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]
LONG = "x" * (MAX_PROMPT + 1)  # one token per character

# (path, body, status, param): each must be refused so
BAD = [
    (C, {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    (C, {**GOOD, "max_tokens": MAX_LEN}, 400, "max_tokens"),  # prompt + max_tokens > the context
    (C, {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    (CHAT, {"model": NAME, "messages": MSG, "max_completion_tokens": 10 ** 6}, 400, "max_completion_tokens"),
    (CHAT, {"model": NAME, "messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    (C, {**GOOD, "prompt": LONG}, 400, "prompt"),  # longer than the server's prompts
    (C, {**GOOD, "prompt": [5] * (MAX_PROMPT + 1)}, 400, "prompt"),
    (CHAT, {"model": NAME, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (C, {**GOOD, "n": 17}, 400, "n"),
    (C, {**GOOD, "n": 0}, 400, "n"),
    (C, {**GOOD, "logprobs": 21}, 400, "logprobs"),
    (C, {**GOOD, "logprobs": -1}, 400, "logprobs"),
    (CHAT, {"model": NAME, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (C, {**GOOD, "temperature": -0.1}, 400, "temperature"),
    (C, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    (C, {**GOOD, "top_p": 0}, 400, "top_p"),
    (C, {**GOOD, "top_k": -2}, 400, "top_k"),
    (C, {**GOOD, "prompt": [5, VOCAB]}, 400, "prompt"),  # token ids outside the vocabulary
    (C, {**GOOD, "prompt": [[5, 6], [-1]]}, 400, "prompt"),
    (C, {**GOOD, "prompt": ""}, 400, "prompt"),
    (C, {**GOOD, "prompt": []}, 400, "prompt"),
    (C, {**GOOD, "prompt": None}, 400, "prompt"),
    (C, {**GOOD, "stop": 5}, 400, "stop"),
    (C, {**GOOD, "seed": "x"}, 400, "seed"),
    (C, {**GOOD, "echo": "yes"}, 400, "echo"),
    (C, {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {**GOOD, "best_of": 3}, 400, "best_of"),
    (CHAT, {"model": NAME}, 400, "messages"),
    (CHAT, {"model": NAME, "messages": [{"content": "no role"}]}, 400, "messages"),
    (CHAT, {"model": NAME, "messages": MSG, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    (CHAT, {"model": NAME, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs
    (C, {**GOOD, "model": "gpt-5"}, 404, "model"),
    (CHAT, {"model": "gpt-5", "messages": MSG}, 404, "model"),
    ("/detokenize", {"model": NAME, "tokens": [VOCAB + 1]}, 400, "tokens"),
    ("/tokenize", {"model": NAME, "prompt": 3}, 400, "prompt"),
]


def _good_after(server):
    status, body = post(server, C, GOOD)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[0]}:{b[3]}:{i}" for i, b in enumerate(BAD)])
def test_bad_request_names_the_field(server, path, body, status, param):
    got, err = post(server, path, body)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param, err
    assert err["error"]["message"] and err["error"]["type"] == (
        "invalid_request_error" if status == 400 else "not_found_error")
    _good_after(server)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_json(server, raw):
    status, err = post(server, C, None, raw=raw)
    assert status == 400 and err["error"]["code"] == "invalid_json" and err["error"]["param"] is None
    _good_after(server)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_api_key(server, key):
    for status_body in (post(server, C, GOOD, key=key), post(server, CHAT, {"model": NAME, "messages": MSG}, key=key)):
        status, err = status_body
        assert status == 401 and err["error"]["type"] == "authentication_error", err
    assert get(server, "/v1/models", key=key)[0] == 401
    assert get(server, "/health", key=None)[0] == 200  # health needs no key
    _good_after(server)
