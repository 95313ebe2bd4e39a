"""`ulorl serve --model RUN/checkpoints/STEP` (a trained run's checkpoint, with the run's tokenizer): the
server's greedy tokens equal `ulorl generate`'s on the same source, and its tokenizer is the run's."""

from __future__ import annotations

import json

import pytest
from serve_utils import post, start_server
from trainer_utils import MOVING, tiny_config

from ulorl_jax import model_source
from ulorl_jax.bench.serve import stop_server
from ulorl_jax.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from ulorl_jax.rl.trainer import Trainer

    path = tmp_path_factory.mktemp("run")
    cfg = tiny_config(*MOVING, "rollout.num_segments=1", "trainer.total_steps=1", "checkpoint.save_every=1",
                      "checkpoint.async_save=false")
    trainer = Trainer(cfg, path)
    trainer.fit()
    trainer.close()
    return path


def test_serve_a_run_checkpoint(run_dir, tmp_path):
    step = run_dir / "checkpoints" / "1"
    tokenizer = model_source.build_tokenizer(model_source.run_config(run_dir))
    ids = tokenizer.encode("1+2=")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": ids}) + "\n")
    assert main(["generate", "--model", str(step), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "8", "--temperature", "0", "--no-progress"]) == 0
    want = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])["tokens"]
    proc, url = start_server(step)
    try:
        status, body = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                     "return_token_ids": True}, key=None)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want
        assert body["model"] == str(step)  # no --served-model-name: the --model argument
        status, body = post(url, "/tokenize", {"prompt": "1+2="}, key=None)
        assert status == 200 and body["tokens"] == ids  # the run's tokenizer
    finally:
        stop_server(proc)
