"""Helpers of the `ulorl serve` tests: the tiny model folder, starting a server, plain-HTTP requests."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request

VOCAB, EOS = 103, 2  # the character tokenizer's 103 ids (every id is a token); EOS is its <|im_end|>
MAX_PROMPT, MAX_LEN, SLOTS = 64, 128, 8
API_KEY, NAME = "sk-test", "tiny-qwen3"
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def make_model_folder(path):
    """A float32 HF Qwen3 folder (random weights) with the character tokenizer; returns the torch model."""
    from hf_utils import save_hf_model

    from ulorl_jax.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(chat_template=THINKING_TEMPLATE)
    assert tokenizer.eos_token_id == EOS and len(tokenizer) <= VOCAB
    model = save_hf_model("qwen3", path, vocab_size=VOCAB, eos_token_id=EOS, max_position_embeddings=256, seed=5)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def start_server(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    """`ulorl serve` on a free port; (process, base URL such as http://127.0.0.1:PORT) once it listens."""
    from ulorl_jax.bench.serve import start_server as start

    return start(["--model", str(model_dir), "--port", "0", "--max-concurrent-decodes", str(SLOTS),
                  "--max-prefill-length", str(MAX_PROMPT), "--max-cache-len", str(MAX_LEN), "--page-size", "16",
                  "--shutdown-after", "900", *extra], env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))


def post(url: str, path: str, body, *, key: str | None = API_KEY, raw: bytes | None = None,
         timeout: float = 120.0) -> tuple[int, dict]:
    """(status, JSON body) of a POST with plain urllib (no client library)."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def get(url: str, path: str, *, key: str | None = API_KEY) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
