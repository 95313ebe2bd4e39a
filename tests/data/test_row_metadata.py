"""A row's other keys reach the reward's metadata (data.extra_keys), and a file read with the wrong key is
one clear error. End to end: a custom reward in sandbox workers reads a row key in training and held-out eval."""

from __future__ import annotations

import datetime
import json
import logging

import numpy as np
import pytest

from ulorl_jax.data.prompts import PromptDataConfig, load_prompts
from ulorl_jax.data.tokenizer import build_tokenizer

TOK = build_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _options(*overrides):
    from ulorl_jax.config import load_config

    return load_config("tiny_cpu", list(overrides)).data


def test_other_row_keys_are_metadata_all_by_default_or_the_listed_ones(tmp_path, caplog):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "1+1", "answer": "2", "tests": [[1, 2], [3, 4]], "id": 7, "unit": "cm", "source": "gsm8k"},
        {"prompt": "2+2", "answer": "4", "tests": [], "id": 8, "unit": "m", "source": "gsm8k"}])
    with caplog.at_level(logging.WARNING):
        records, bad = load_prompts(PromptDataConfig(path=str(path)), TOK)
    assert not bad
    assert records[0].metadata == {"source": str(path), "line": 1, "prompt": "1+1", "answer": "2",
                                   "tests": [[1, 2], [3, 4]], "id": 7, "unit": "cm"}
    # the row's "source" is shadowed by the file path: said once per file, with the fix
    warnings = [r.getMessage() for r in caplog.records if "'source'" in r.getMessage()]
    assert len(warnings) == 1 and "rename the field" in warnings[0]

    listed, _ = load_prompts(PromptDataConfig(path=str(path), extra_keys=("unit",)), TOK)
    assert listed[1].metadata == {"source": str(path), "line": 2, "prompt": "2+2", "answer": "4", "unit": "m"}
    none, _ = load_prompts(PromptDataConfig(path=str(path), extra_keys=()), TOK)
    assert set(none[0].metadata) == {"source", "line", "prompt", "answer"}

    # a listed key a row lacks is left out of that row's metadata (as with every key copied)
    some, bad = load_prompts(PromptDataConfig(path=str(path), extra_keys=("unit", "level")), TOK)
    assert not bad and some[0].metadata["unit"] == "cm" and "level" not in some[0].metadata
    with pytest.raises(ValueError, match=r"extra_keys lists \['source'\]: metadata keys the data layer sets"):
        load_prompts(PromptDataConfig(path=str(path), extra_keys=("source",)), TOK)


def test_the_config_option_data_extra_keys(tmp_path):
    from ulorl_jax.config import ConfigError
    from ulorl_jax.data.sources import prompt_file_stream

    assert _options().extra_keys is None
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1", "answer": "2", "id": 1, "note": "x"}])
    item, = prompt_file_stream([str(path)], _options("data.extra_keys=[id]"), TOK, None, shuffle=False).take(1)
    assert item.metadata["id"] == 1 and "note" not in item.metadata
    item, = prompt_file_stream([str(path)], _options(), TOK, None, shuffle=False).take(1)
    assert (item.metadata["id"], item.metadata["note"], item.metadata["row"], item.metadata["epoch"]) == (1, "x", 0, 0)
    with pytest.raises(ConfigError, match=r"data\.extra_keys=\['id', 'epoch'\]: expected row keys other than .*"
                                          r"got \['epoch'\]"):
        _options("data.extra_keys=[id,epoch]")


def test_parquet_and_numpy_values_become_json(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ulorl_jax.data.prompts import json_value

    when = datetime.datetime(2026, 12, 3, 10, 30)
    table = pa.table({"prompt": ["1+1"], "answer": ["2"], "tests": [[1, 2, 3]], "when": [when],
                      "blob": [b"\x00\x01"], "scores": [{"a": 0.5}]})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    with caplog.at_level(logging.WARNING):
        (record,), _ = load_prompts(PromptDataConfig(path=str(path)), TOK)
    assert record.metadata["tests"] == [1, 2, 3] and record.metadata["when"] == when.isoformat()
    assert record.metadata["scores"] == {"a": 0.5}
    assert "blob" not in record.metadata  # bytes: left out, and said so with the fix
    assert any("'blob'" in r.getMessage() and "data" in r.getMessage() and "extra_keys" in r.getMessage()
               for r in caplog.records)
    json.dumps(record.metadata)  # checkpoints store metadata as JSON; sandbox workers get it pickled
    with pytest.raises(ValueError, match=r"key 'blob' \(listed in extra_keys\) holds a bytes value"):
        load_prompts(PromptDataConfig(path=str(path), extra_keys=("blob",), on_bad_row="error"), TOK)

    assert json_value(np.arange(4).reshape(2, 2)) == [[0, 1], [2, 3]]
    assert json_value({"x": np.float32(0.5), "y": (np.int64(3), None)}) == {"x": 0.5, "y": [3, None]}
    assert type(json_value(np.int64(3))) is int
    with pytest.raises(TypeError, match="non-string keys"):
        json_value({1: "a"})


# --- a file read with the wrong key ----------------------------------------------------------------


def test_a_file_without_the_prompt_key_is_one_error_naming_the_option(tmp_path, caplog):
    from ulorl_jax.data.sources import prompt_file_stream

    rows = [{"problem": f"{i}+1", "solution": str(i + 1)} for i in range(25)]
    path = _jsonl(tmp_path / "test.jsonl", rows)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as err:
        prompt_file_stream([str(path)], _options(), TOK, None, shuffle=False, held_out=True)
    assert str(err.value) == (f"prompt data {str(path)!r} has no valid rows: none of its 25 rows has the prompt key "
                              "'prompt'; its rows have the keys ['problem', 'solution']. Set data.eval_prompt_key to "
                              "the key that holds the prompt")
    assert not caplog.records  # no per-row warnings before (or instead of) the error
    with pytest.raises(ValueError, match=r"has the prompt key 'prompt'.*Set data\.prompt_key to the key"):
        prompt_file_stream([str(path)], _options(), TOK, None, shuffle=False)
    with pytest.raises(ValueError, match=r"has the answer key 'answer'; its rows have the keys \['problem', "
                                         r"'solution'\]\. Set data\.eval_answer_key to the key that holds the answer"):
        prompt_file_stream([str(path)], _options("data.eval_prompt_key=problem"), TOK, None, shuffle=False,
                           held_out=True)
    with pytest.raises(ValueError, match=r"Set data\.eval_prompt_key"):  # on_bad_row=error: the same error
        prompt_file_stream([str(path)], _options("data.on_bad_row=error"), TOK, None, shuffle=False, held_out=True)
    items = prompt_file_stream([str(path)], _options("data.eval_prompt_key=problem", "data.eval_answer_key=solution"),
                               TOK, None, shuffle=False, held_out=True).take(2)
    assert [i.metadata["answer"] for i in items] == ["1", "2"]


def test_a_row_missing_a_key_other_rows_have_stays_a_row_error(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"question": "x", "answer": "1"}, {"prompt": "1+1", "answer": "2"}])
    with pytest.raises(ValueError, match=rf"bad prompt row {path}:1: missing key 'prompt'"):
        load_prompts(PromptDataConfig(path=str(path), on_bad_row="error"), TOK)
    records, bad = load_prompts(PromptDataConfig(path=str(path)), TOK)
    assert [r.metadata["line"] for r in records] == [2] and [b.line for b in bad] == [1]


# --- end to end: training and held-out eval, rewards in sandbox workers ----------------------------

REWARD_MODULE = '''
import json
from pathlib import Path


def unit_reward(prediction, reference, metadata):
    """Reads two row keys; logs what it saw beside this module."""
    with open(Path(__file__).with_name("seen.jsonl"), "a") as f:
        f.write(json.dumps({"split": metadata["split"], "unit": metadata["unit"], "tests": metadata["tests"],
                            "answer": reference}) + "\\n")
    return float(metadata["unit"] == "cm")
'''


@pytest.mark.slow  # a tiny trainer: rollout, learner and eval compiles
def test_row_keys_reach_a_custom_reward_in_training_and_held_out_eval(tmp_path, monkeypatch):
    from trainer_utils import tiny_config

    from ulorl_jax.data.tokenizer import synthetic_alphabet
    from ulorl_jax.rl.trainer import Trainer

    module_dir = tmp_path / "rewards_pkg"
    module_dir.mkdir()
    (module_dir / "row_key_reward_xyz.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(module_dir))  # the sandbox workers get this sys.path
    tok_dir = tmp_path / "tok"
    build_tokenizer(synthetic_alphabet()).save_pretrained(tok_dir)
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"sum mod 10: a{i} b1", "answer": str((i + 1) % 10),
                                               "unit": "cm", "split": "train", "tests": [i, 1]} for i in range(4)])
    held_out = _jsonl(tmp_path / "test.jsonl", [{"q": f"sum mod 10: a{i} b2", "a": str((i + 2) % 10), "unit": "m",
                                                 "split": "eval", "tests": [{"in": i}]} for i in range(2)])
    cfg = tiny_config("data.synthetic=null", f"data.train_files=[{train}]", f"data.eval_files=[{held_out}]",
                      "data.eval_prompt_key=q", "data.eval_answer_key=a", f"model.tokenizer={tok_dir}",
                      "reward.kind=custom", "reward.custom_fn=row_key_reward_xyz:unit_reward", "reward.workers=1",
                      # every id ends a sample: each one ends (is scored) after one token, none is truncated
                      f"model.arch.eos_token_id=[{','.join(map(str, range(64)))}]",
                      "trainer.total_steps=1", "checkpoint.async_save=false")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        metrics = trainer.train_step()
        result = trainer.evaluate(k=2)
        trainer.save()  # the pools' metadata (row keys included) goes into the checkpoint's JSON
    finally:
        trainer.close()
    seen = [json.loads(line) for line in (module_dir / "seen.jsonl").read_text().splitlines()]
    train_seen = [s for s in seen if s["split"] == "train"]
    eval_seen = [s for s in seen if s["split"] == "eval"]
    assert len(train_seen) == 2 * 4 and all(s["unit"] == "cm" and s["tests"][1] == 1 for s in train_seen)
    assert len(eval_seen) == 2 * 2 and all(s["unit"] == "m" and "in" in s["tests"][0] for s in eval_seen)
    # the reward read the key: 1 for every training sample ("cm"), 0 on the held-out set ("m")
    assert metrics["reward_mean"] == 1.0 and result["eval_accuracy"] == 0.0
