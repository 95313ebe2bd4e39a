"""`ulorl serve` (OpenAI API) end to end: a real server process, the `openai` client and plain HTTP.

Greedy tokens are checked against transformers' greedy generate and `ulorl generate`; echo / top log-probs
against transformers' float32 log-softmax; sampled requests for reproducibility; n, stop, stream and chat
for what they must return.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import pytest
import torch
from serve_utils import API_KEY, EOS, MAX_LEN, NAME, get, post

pytestmark = pytest.mark.slow
PROMPTS = ["hello world", "2+2=", "The cat"]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate: up to n new tokens, EOS included when it comes."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def hf_logsoftmax(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()  # [T, V]: row t predicts ids[t + 1]


def test_models_and_health(server):
    status, body = get(server, "/v1/models")
    assert status == 200
    data = json.loads(body)["data"]
    assert [m["id"] for m in data] == [NAME] and data[0]["max_model_len"] == MAX_LEN
    assert get(server, "/health", key=None)[0] == 200


def test_greedy_equals_transformers_and_ulorl_generate(server, client, model_folder, tmp_path):
    from ulorl_jax.cli import main

    folder, hf_model, tokenizer = model_folder
    out = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    tokens = [c.model_extra["token_ids"] for c in out.choices]
    for ids, got, choice in zip(prompts, tokens, out.choices):
        assert got == hf_greedy(hf_model, ids, 12)
        assert choice.text == tokenizer.decode(got, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if got[-1] == EOS else "length")
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    assert out.usage.completion_tokens == sum(map(len, tokens))
    # `ulorl generate` on the same prompts (as token ids: no chat template), greedy
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts))
    assert main(["generate", "--model", str(folder), "--prompts", str(jsonl), "--out", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "12", "--temperature", "0", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in sorted(rows, key=lambda r: r["prompt_index"])] == tokens
    # token-id prompts, and a list of them, give the same tokens
    by_ids = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert [c.model_extra["token_ids"] for c in by_ids.choices] == tokens


def test_echo_logprobs_equal_transformers(server, model_folder):
    _, hf_model, tokenizer = model_folder
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    ref = hf_logsoftmax(hf_model, ids)
    for max_tokens in (0, 1):
        status, body = post(server, "/v1/completions", {"model": NAME, "prompt": text, "max_tokens": max_tokens,
                                                        "temperature": 0, "echo": True, "logprobs": 1})
        assert status == 200, body
        choice = body["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(text)
        assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [ref[t, ids[t + 1]] for t in range(len(ids) - 1)]
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4)
        for t in range(1, len(ids)):  # the top-1 alternative is transformers' argmax
            best = int(ref[t - 1].argmax())
            assert lp["top_logprobs"][t][tokenizer.decode([best])] == pytest.approx(ref[t - 1, best], abs=1e-4)
        assert len(lp["tokens"]) == len(ids) + max_tokens and lp["text_offset"][:2] == [0, 1]


def test_generated_top_logprobs_equal_transformers(server, model_folder):
    _, hf_model, tokenizer = model_folder
    ids = tokenizer.encode("abc")
    status, body = post(server, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                    "logprobs": 3, "return_token_ids": True})
    assert status == 200, body
    new = body["choices"][0]["token_ids"]
    ref = hf_logsoftmax(hf_model, ids + new)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(new)
    for j, token in enumerate(new):
        row = ref[len(ids) - 1 + j]
        assert lp["token_logprobs"][j] == pytest.approx(row[token], abs=1e-4)
        top3 = np.argsort(-row)[:3]
        assert token == top3[0]  # greedy
        for t in top3:
            assert lp["top_logprobs"][j][tokenizer.decode([int(t)])] == pytest.approx(row[t], abs=1e-4)


def test_seeded_sampling_is_reproducible_and_n_choices(server, client):
    def ask(seed, n=1):
        return client.completions.create(model=NAME, prompt="hello", max_tokens=10, temperature=1.0, top_p=0.9,
                                         n=n, seed=seed, extra_body={"top_k": 20, "return_token_ids": True})

    a, b, c = ask(7), ask(7), ask(8)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].model_extra["token_ids"] != c.choices[0].model_extra["token_ids"]
    many = ask(7, n=4)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].model_extra["token_ids"] == a.choices[0].model_extra["token_ids"]  # choice 0 = n=1
    assert len({tuple(ch.model_extra["token_ids"]) for ch in many.choices}) > 1
    two = client.completions.create(model=NAME, prompt=["hello", "2+2="], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text and two.choices[2].text == two.choices[3].text


def test_stop_strings(server, client):
    full = client.completions.create(model=NAME, prompt="hello world", max_tokens=20, temperature=0).choices[0]
    assert len(full.text) >= 6, full.text
    stop = full.text[3:5]
    cut = full.text[:full.text.find(stop)]
    for s in (stop, [stop, "\x00never"]):
        out = client.completions.create(model=NAME, prompt="hello world", max_tokens=20, temperature=0, stop=s)
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason) == (cut, "stop")
        assert choice.model_extra["stop_reason"] == stop
        assert out.usage.completion_tokens <= len(cut) + 2  # tokens stop at the one that completed the stop string


def _sse(url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_completions_and_chat(server, client):
    whole = client.completions.create(model=NAME, prompt="hello world", max_tokens=16, temperature=0, n=2)
    chunks = _sse(server, "/v1/completions", {"model": NAME, "prompt": "hello world", "max_tokens": 16,
                                              "temperature": 0, "n": 2, "stream": True,
                                              "stream_options": {"include_usage": True}})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole.choices[i].text
        assert mine[-1]["finish_reason"] == whole.choices[i].finish_reason
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True) | chunks[-1]["usage"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    # the openai client's own stream reader, chat
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_chat_template_system_message_and_kwargs(server, client, model_folder):
    _, hf_model, tokenizer = model_folder
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    for thinking in (True, False):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=thinking)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        assert ("<think>" in rendered) == (not thinking)
        out = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": thinking},
                                                         "return_token_ids": True})
        choice = out.choices[0]
        assert out.usage.prompt_tokens == len(ids) and choice.model_extra["prompt_token_ids"] == ids
        assert choice.model_extra["token_ids"] == hf_greedy(hf_model, ids, 8)
        assert choice.message.role == "assistant"
        assert choice.message.content == tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
        content = choice.logprobs.content
        assert len(content) == len(choice.model_extra["token_ids"]) and len(content[0].top_logprobs) == 2
        assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top token


def test_tokenize_detokenize(server, model_folder):
    tokenizer = model_folder[2]
    status, body = post(server, "/tokenize", {"model": NAME, "prompt": "hello"})
    assert status == 200 and body["tokens"] == tokenizer.encode("hello") and body["count"] == 5
    assert body["max_model_len"] == MAX_LEN
    status, body = post(server, "/detokenize", {"model": NAME, "tokens": tokenizer.encode("hello")})
    assert (status, body) == (200, {"prompt": "hello"})
    status, body = post(server, "/tokenize", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert status == 200 and body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


def test_concurrent_clients_get_their_own_tokens(server, model_folder):
    """16 clients at once (on 8 slots): each gets what it gets alone."""
    prompts = [f"prompt {i}" for i in range(16)]
    alone = [post(server, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": 8, "temperature": 0})[1]
             for p in prompts[:4]]
    results: dict[int, dict] = {}

    def ask(i):
        results[i] = post(server, "/v1/completions", {"model": NAME, "prompt": prompts[i], "max_tokens": 8,
                                                      "temperature": 0})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(results[i][0] == 200 for i in range(16))
    for i in range(4):
        assert results[i][1]["choices"][0]["text"] == alone[i]["choices"][0]["text"]
