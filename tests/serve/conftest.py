"""One `ulorl serve` process for every test here: a tiny random HF Qwen3 with a character tokenizer whose chat
template reads `enable_thinking` (as Qwen3's does), on a free loopback port, with an API key.

The server stops itself (--shutdown-after) if the test session dies without stopping it.
"""

from __future__ import annotations

import pytest
from serve_utils import API_KEY, NAME, make_model_folder, start_server


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny"
    model, tokenizer = make_model_folder(path)
    return path, model, tokenizer


@pytest.fixture(scope="session")
def server(model_folder):
    proc, url = start_server(model_folder[0], "--served-model-name", NAME, "--api-key", API_KEY)
    yield url
    from ulorl_jax.bench.serve import stop_server

    stop_server(proc)
