"""lm-evaluation-harness's `local-completions` model against `ulorl serve`: a log-likelihood (multiple choice)
task and a `generate_until` task, both local jsonl files written here (no download). The log-likelihoods it
reports equal transformers' on the same model and tokens; the generations equal transformers' greedy ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from serve_utils import API_KEY, NAME

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]')")

MC_DOCS = [{"question": "abc", "choices": ["def", "xyz", "abd"], "label": 0},
           {"question": "1+1=", "choices": ["2", "11", "3"], "label": 0},
           {"question": "hello", "choices": [" world", "!", " there"], "label": 2}]
GEN_DOCS = [{"question": "count: 1 2 3", "answer": "4"}, {"question": "abc", "answer": "d"}]


def _write_tasks(folder):
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (folder / "ulorl_mc.yaml").write_text(f"""task: ulorl_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (folder / "ulorl_gen.yaml").write_text(f"""task: ulorl_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
""")


def _loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return float(sum(logp[len(context) - 1 + j, t] for j, t in enumerate(continuation)))


def test_lm_eval_local_completions(server, model_folder, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder, hf_model, tokenizer = model_folder
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path)
    args = (f"model={NAME},base_url={server}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
            f"tokenized_requests=True,num_concurrent=4,max_retries=1,max_length=128,max_gen_toks=8")
    out = simple_evaluate(model="local-completions", model_args=args, tasks=["ulorl_mc", "ulorl_gen"],
                          task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                          apply_chat_template=False)
    # log-likelihoods: what lm-eval got from the server = transformers' sums over the continuation tokens
    want_acc = []
    for sample in sorted(out["samples"]["ulorl_mc"], key=lambda s: s["doc_id"]):
        doc = MC_DOCS[sample["doc_id"]]
        context = tokenizer.encode(doc["question"])
        want = [_loglikelihood(hf_model, context, tokenizer.encode(c)) for c in doc["choices"]]
        got = [float(r[0]) for r in sample["filtered_resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        want_acc.append(float(np.argmax(want) == doc["label"]))
    assert out["results"]["ulorl_mc"]["acc,none"] == pytest.approx(np.mean(want_acc))
    # generations: transformers' greedy tokens up to the first newline
    want_em = []
    for sample in sorted(out["samples"]["ulorl_gen"], key=lambda s: s["doc_id"]):
        doc = GEN_DOCS[sample["doc_id"]]
        ids = tokenizer.encode(doc["question"])
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                                    pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        text = tokenizer.decode(gen[0, len(ids):].tolist(), skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == text
        want_em.append(float(text.strip() == doc["answer"]))
    assert out["results"]["ulorl_gen"]["exact_match,none"] == pytest.approx(np.mean(want_em))
