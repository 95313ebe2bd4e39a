"""Prompt data: readers (jsonl / parquet / datasets folder), bad rows with line numbers, resumable stream."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ulorl_jax.data.prompts import PromptDataConfig, PromptStream, encode_prompt, load_prompts
from ulorl_jax.data.readers import BadRow, read_rows
from ulorl_jax.data.tokenizer import build_tokenizer

TOK = build_tokenizer()


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _template(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# --- tokenization ------------------------------------------------------------------
def test_encode_prompt_uses_chat_template():
    ids = encode_prompt(TOK, "sum mod 10: 1 2")
    assert TOK.decode(ids) == _template("sum mod 10: 1 2")
    assert encode_prompt(TOK, "hi", use_chat_template=False) == TOK.encode("hi")
    with_system = encode_prompt(TOK, "hi", system_prompt="sys")
    assert TOK.decode(with_system).startswith("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi")
    messages = [{"role": "user", "content": "hi"}]
    assert encode_prompt(TOK, messages) == encode_prompt(TOK, "hi")
    assert encode_prompt(TOK, [5, 6, 7]) == [5, 6, 7]  # pre-tokenized
    for bad, err in [("  ", ValueError), (3, TypeError), ([], TypeError), ([1, "a"], TypeError),
                     ([10_000], ValueError)]:
        with pytest.raises(err):
            encode_prompt(TOK, bad)


# --- jsonl with malformed rows -----------------------------------------------------
def _messy_jsonl(tmp_path):
    lines = [
        json.dumps({"prompt": "sum mod 10: 1 2", "answer": "3"}),  # 1 ok
        "{not json",  # 2
        json.dumps(["a", "list"]),  # 3 not an object
        json.dumps({"question": "x", "answer": "1"}),  # 4 missing prompt
        json.dumps({"prompt": 42, "answer": "1"}),  # 5 wrong type
        json.dumps({"prompt": "   ", "answer": "1"}),  # 6 empty prompt
        json.dumps({"prompt": "x" * 200, "answer": "1"}),  # 7 too long
        "",  # 8 blank: skipped silently
        json.dumps({"prompt": "ok again", "answer": 7, "level": 3}),  # 9 ok, numeric answer
        json.dumps({"prompt": "no answer"}),  # 10 missing answer
        json.dumps({"prompt": "bool answer", "answer": True}),  # 11 wrong answer type
    ]
    return _write_lines(tmp_path / "p.jsonl", lines)


def test_jsonl_bad_rows_reported_with_line_numbers(tmp_path, caplog):
    path = _messy_jsonl(tmp_path)
    config = PromptDataConfig(path=str(path), max_prompt_len=64, extra_keys=("level",))
    records, bad = load_prompts(config, TOK)
    assert [r.metadata["line"] for r in records] == [1, 9]
    assert records[1].metadata["answer"] == "7" and records[1].metadata["level"] == 3
    assert records[0].metadata["source"] == str(path)
    assert TOK.decode(records[0].prompt_ids) == _template("sum mod 10: 1 2")
    by_line = {b.line: b.reason for b in bad}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 10, 11]
    assert "bad JSON" in by_line[2]
    assert "JSON object" in by_line[3]
    assert "'prompt'" in by_line[4]
    assert "int" in by_line[5]
    assert "empty prompt" in by_line[6]
    assert "max_prompt_len=64" in by_line[7]
    assert "'answer'" in by_line[10]
    assert "answer must be" in by_line[11]
    assert f"{path}:2:" in caplog.text  # logged with file and line


def test_on_bad_row_error_names_file_and_line(tmp_path):
    path = _messy_jsonl(tmp_path)
    with pytest.raises(ValueError, match=rf"{path}:2: bad JSON"):
        load_prompts(PromptDataConfig(path=str(path), on_bad_row="error"), TOK)


def test_no_valid_rows_and_missing_file(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(ValueError, match="no valid rows"):
        load_prompts(PromptDataConfig(path=str(path)), TOK)
    with pytest.raises(FileNotFoundError):
        load_prompts(PromptDataConfig(path=str(tmp_path / "missing.jsonl")), TOK)
    with pytest.raises(ValueError, match="unknown format"):
        (tmp_path / "x.csv").write_text("a")
        load_prompts(PromptDataConfig(path=str(tmp_path / "x.csv")), TOK)
    with pytest.raises(ValueError, match="on_bad_row"):
        load_prompts(PromptDataConfig(path=str(path), on_bad_row="ignore"), TOK)


def test_not_utf8_line(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n\xff\xfe\n')
    rows = list(read_rows(path))
    assert isinstance(rows[0][1], dict)
    assert isinstance(rows[1][1], BadRow) and rows[1][0] == 2 and "UTF-8" in rows[1][1].reason


# --- parquet -----------------------------------------------------------------------
def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["sum mod 10: 4 4", None, "", "fine"], "solution": ["8", "1", "2", None]})
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    config = PromptDataConfig(path=str(path), prompt_key="problem", answer_key="solution")
    records, bad = load_prompts(config, TOK)
    assert [r.metadata["line"] for r in records] == [1]
    assert records[0].metadata["answer"] == "8"
    assert [(b.line, b.reason.split(",")[0]) for b in bad] == [
        (2, "prompt must be a non-empty string"), (3, "empty prompt"), (4, "answer must be a string or a number")]


def test_hf_folder_needs_datasets(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ValueError, match="pip install datasets"):
            load_prompts(PromptDataConfig(path=str(folder)), TOK)
    else:  # pragma: no cover - datasets is not a dependency
        pytest.skip("datasets is installed; the missing-package message cannot be checked")


# --- the stream: shuffle, epochs, exact resume -------------------------------------
def _records(tmp_path, n=7):
    rows = [json.dumps({"prompt": f"p{i}", "answer": str(i)}) for i in range(n)]
    return load_prompts(PromptDataConfig(path=str(_write_lines(tmp_path / "s.jsonl", rows))), TOK)[0]


def test_stream_epochs_are_permutations_from_seed(tmp_path):
    records = _records(tmp_path)
    stream = PromptStream(records, seed=11)
    items = stream.take(21)  # three epochs
    for epoch in range(3):
        rows = [it.metadata["row"] for it in items[7 * epoch: 7 * epoch + 7]]
        assert rows == list(np.random.default_rng([11, epoch]).permutation(7))  # independent recomputation
        assert all(it.metadata["epoch"] == epoch for it in items[7 * epoch: 7 * epoch + 7])
    assert [it.prompt_index for it in items] == list(range(21))  # unique group ids
    assert items[0].prompt_ids == records[items[0].metadata["row"]].prompt_ids
    assert items[0].metadata["answer"] == str(items[0].metadata["row"])
    plain = PromptStream(records, shuffle=False).take(8)
    assert [it.metadata["row"] for it in plain] == [0, 1, 2, 3, 4, 5, 6, 0]


@pytest.mark.parametrize("cut", [0, 3, 7, 10, 14])
def test_stream_resume_is_exact(tmp_path, cut):
    records = _records(tmp_path)
    reference = PromptStream(records, seed=5).take(25)
    first = PromptStream(records, seed=5)
    first.take(cut)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as a checkpoint would
    resumed = PromptStream(records, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert resumed.take(25 - cut) == reference[cut:]


def test_stream_refuses_changed_data(tmp_path):
    records = _records(tmp_path)
    state = PromptStream(records).state_dict()
    with pytest.raises(ValueError, match="prompt data changed"):
        PromptStream(records[:-1]).load_state_dict(state)
    with pytest.raises(ValueError, match="prompt data changed"):
        PromptStream(records[::-1]).load_state_dict(state)


def test_from_config(tmp_path):
    path = _messy_jsonl(tmp_path)
    stream = PromptStream.from_config(PromptDataConfig(path=str(path), seed=3, max_prompt_len=64), TOK)
    assert len(stream) == 2 and len(stream.bad_rows) == 8
    assert {it.metadata["line"] for it in stream.take(2)} == {1, 9}


# --- property: random lines never crash the reader ---------------------------------
_text = st.text(alphabet=string.printable.replace("\n", "").replace("\r", "").replace("\x0b", "")
                .replace("\x0c", ""), max_size=30)
_valid = st.builds(lambda p, a: json.dumps({"prompt": "q" + p, "answer": a}),
                   _text, st.one_of(st.text(min_size=1, max_size=5).filter(str.strip), st.integers(0, 99)))
_json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(_text, children, max_size=3), max_leaves=6)
_invalid = st.one_of(
    st.text(max_size=40).map(lambda s: s.replace("\n", " ")).filter(lambda s: s.strip() and not _is_valid_json_obj(s)),
    _json_value.filter(lambda v: not isinstance(v, dict)).map(json.dumps),
    st.builds(lambda a: json.dumps({"answer": a}), _text),  # no prompt
    st.builds(lambda p: json.dumps({"prompt": p, "answer": "1"}), _json_value.filter(lambda v: not isinstance(v, str))
              .filter(lambda v: not (isinstance(v, list) and v and all(type(t) is int and 0 <= t < len(TOK)
                                                                       for t in v)))),
    st.builds(lambda p: json.dumps({"prompt": "q" + p}), _text),  # no answer
    st.builds(lambda a: json.dumps({"prompt": "q", "answer": a}),
              st.one_of(st.none(), st.booleans(), st.lists(st.integers(), max_size=2), st.just(" "))),
    st.just(json.dumps({"prompt": "x" * 80, "answer": "1"})),  # too long
)


def _is_valid_json_obj(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except (ValueError, RecursionError):
        return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.booleans(), st.data()), min_size=1, max_size=12))
def test_random_lines_are_records_or_bad_rows(tmp_path, spec):
    lines, valid = [], []
    for is_valid, data in spec:
        lines.append(data.draw(_valid if is_valid else _invalid))
        valid.append(is_valid)
    path = tmp_path / "h.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = PromptDataConfig(path=str(path), max_prompt_len=70)
    if not any(valid):
        with pytest.raises(ValueError, match="no valid rows"):
            load_prompts(config, TOK)
        return
    records, bad = load_prompts(config, TOK)
    assert sorted(r.metadata["line"] for r in records) == [i + 1 for i, v in enumerate(valid) if v]
    assert sorted(b.line for b in bad) == [i + 1 for i, v in enumerate(valid) if not v]
    assert all(b.reason for b in bad)


# --- cleaning (ULORL.md "Data cleaning") -------------------------------------------
from ulorl_jax.data import clean as C  # noqa: E402


@pytest.mark.parametrize("prompt, answer, expected", [
    ("(a) Find x. (b) Find y.", "1", True),
    ("Part a: find x. Part b: find y.", "2", True),
    ("(i) Show A. (ii) Compute B.", "3", True),
    ("What is x? What is y?", "1", True),
    ("Compute f(1) + f(2).", "5", False),  # function calls are not part markers
    ("What is $x$ if $x^2 = 4$ and $x > 0$?", "2", False),
    ("Find x.", "(a) 1 (b) 2", True),  # the answer has parts
])
def test_rule_multi_subquestion(prompt, answer, expected):
    assert C.is_multi_subquestion(prompt, answer) is expected


@pytest.mark.parametrize("answer, expected", [
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
    ("x" * 51, True),
    ("1\n2", True),
    ("\\frac{\\sqrt{3}}{2}", False),
    ("(-\\infty, -2) \\cup (3, \\infty)", False),
])
def test_rule_long_answer(answer, expected):
    assert C.is_long_answer(answer, max_chars=50) is expected


@pytest.mark.parametrize("prompt, answer, expected", [
    ("Which is prime? (A) 4 (B) 6 (C) 7", "C", True),
    ("Pick one.\nA. 4\nB. 6\nC. 7\nD. 8", "7", True),
    ("Which of the following is even?", "B", True),
    ("Find the value of f(A) where A is a matrix.", "3", False),
    ("Let A be a point and B another. Find AB.", "5", False),
])
def test_rule_multiple_choice(prompt, answer, expected):
    assert C.is_multiple_choice(prompt, answer) is expected


@pytest.mark.parametrize("prompt, answer, tf, proof", [
    ("True or false: 2 is prime.", "True", True, False),
    ("Is 7 prime?", "Yes", True, False),
    ("Is 7 prime? Give the count of primes below 7.", "3", False, False),
    ("Prove that there are infinitely many primes.", "proof", False, True),
    ("Show that n^2 >= n for all integers n.", "", False, True),
    ("Show that x > 0 and find x.", "2", False, False),  # has a quantity to find
])
def test_rules_true_false_and_proof(prompt, answer, tf, proof):
    assert C.is_true_false(prompt, answer) is tf
    assert C.is_proof(prompt, answer) is proof


def _clean_input(tmp_path):
    rows = [
        {"prompt": "What is 2+2?", "answer": "4"},  # 1 kept
        {"prompt": "(a) Find x. (b) Find y.", "answer": "1"},  # 2 multi
        {"prompt": "Compute M.", "answer": "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"},  # 3 long
        {"prompt": "Which is prime? (A) 4 (B) 6 (C) 7", "answer": "C"},  # 4 mc
        {"prompt": "True or false: 2 is prime.", "answer": "True"},  # 5 tf
        {"prompt": "Prove that there are infinitely many primes.", "answer": "proof"},  # 6 proof
        {"prompt": "What  is 2+2?", "answer": "4"},  # 7 duplicate of 1 (whitespace)
        {"prompt": "Compute 3*3.", "answer": 9},  # 8 kept, numeric answer
        {"prompt": "No answer here"},  # 9 missing
    ]
    lines = [json.dumps(r) for r in rows] + ["{broken"]  # 10 bad JSON
    return _write_lines(tmp_path / "raw.jsonl", lines)


def test_clean_rows_report(tmp_path):
    path = _clean_input(tmp_path)
    config = C.CleanConfig(actions={**C.DEFAULT_ACTIONS, "duplicate": "drop", "true_false": "flag"})
    kept, report = C.clean_rows(read_rows(path), config)
    assert [r["prompt"] for r in kept] == ["What is 2+2?", "True or false: 2 is prime.", "Compute 3*3."]
    assert kept[1]["clean_flags"] == ["true_false"] and "clean_flags" not in kept[0]
    assert (report.total, report.kept, report.dropped, report.flagged) == (10, 3, 7, 1)
    assert report.dropped_by_rule == {"missing_field": 2, "multi_subquestion": 1, "long_answer": 1,
                                      "multiple_choice": 1, "true_false": 0, "proof": 1, "duplicate": 1,
                                      "solved_by_policy": 0}
    assert {d["line"]: d["reasons"][0] for d in report.dropped_rows} == {
        2: "multi_subquestion", 3: "long_answer", 4: "multiple_choice", 6: "proof", 7: "duplicate",
        9: "missing_field", 10: "missing_field"}
    assert report.actions["solved_by_policy"] == "off"  # no solver given
    assert "multi_subquestion" in report.table()


def test_clean_solver_drops_fully_solved(tmp_path):
    path = _clean_input(tmp_path)
    seen = []

    def solver(rows):  # a stand-in policy: solves "What is 2+2?" 8/8, the other 7/8
        seen.extend(r["prompt"] for r in rows)
        return [(8, 8) if r["prompt"] == "What is 2+2?" else (7, 8) for r in rows]

    kept, report = C.clean_rows(read_rows(path), C.CleanConfig(), solver)
    assert seen == ["What is 2+2?", "What  is 2+2?", "Compute 3*3."]  # only rows the rules kept are sampled
    assert [r["prompt"] for r in kept] == ["What  is 2+2?", "Compute 3*3."]
    assert report.dropped_by_rule["solved_by_policy"] == 1 and report.matches["solved_by_policy"] == 1


def test_clean_config_errors():
    with pytest.raises(ValueError, match="unknown cleaning rule"):
        C.clean_rows([], C.CleanConfig(actions={"nope": "drop"}))
    with pytest.raises(ValueError, match="actions"):
        C.clean_rows([], C.CleanConfig(actions={"proof": "maybe"}))


def test_cli_data_clean(tmp_path, capsys):
    from ulorl_jax.cli import main

    path = _clean_input(tmp_path)
    out, report = tmp_path / "clean.parquet", tmp_path / "report.json"
    assert main(["data", "clean", str(path), str(out), "--report", str(report), "--dedupe", "--off", "proof",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kept"] == 3 and summary["dropped_by_rule"]["proof"] == 0
    import pyarrow.parquet as pq

    assert [r["prompt"] for r in pq.read_table(out).to_pylist()] == [
        "What is 2+2?", "Prove that there are infinitely many primes.", "Compute 3*3."]
    saved = json.loads(report.read_text())
    assert saved["input"] == str(path) and saved["total"] == 10 and len(saved["dropped_rows"]) == 7
    assert main(["data", "clean", str(path), str(tmp_path / "x.csv")]) == 2  # bad output name: plain error


@pytest.mark.slow  # model init + engine compile
def test_cli_data_clean_with_policy_model(tmp_path, capsys):
    from ulorl_jax.cli import main
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.models.native import save_native

    model_dir = tmp_path / "policy"
    save_native(init_model(tiny_config("qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
                           seed=0), model_dir)
    TOK.save_pretrained(model_dir)
    rows = [{"prompt": "sum mod 10: 1 2", "answer": "3"}, {"prompt": "sum mod 10: 4 4", "answer": "8"}]
    path = _write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    assert main(["data", "clean", str(path), str(tmp_path / "o.jsonl"), "--model", str(model_dir),
                 "--samples", "2", "--max-new-tokens", "4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # a random policy cannot write "\boxed{3}" in 4 tokens: nothing is solved, everything kept
    assert summary["actions"]["solved_by_policy"] == "drop"
    assert summary["kept"] == 2 and summary["matches"]["solved_by_policy"] == 0


# --- a user's own data: templates, keys, per-file reports ----------------------------
def test_chat_template_kwargs_and_system_prompt_reach_the_template():
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                         "{% if enable_thinking %}think{% else %}nothink{% endif %}")
    assert tok.decode(encode_prompt(tok, "hi", chat_template_kwargs={"enable_thinking": True})) == "u:hi;think"
    assert tok.decode(encode_prompt(tok, "hi", chat_template_kwargs={"enable_thinking": False})) == "u:hi;nothink"
    assert tok.decode(encode_prompt(tok, "hi", system_prompt="be brief")) == "s:be brief;u:hi;nothink"


def _data_options(**overrides):
    from ulorl_jax.config import load_config

    return load_config("tiny_cpu", [f"data.{k}={v}" for k, v in overrides.items()]).data


def test_file_report_counts_kept_and_dropped_and_refuses_too_many(tmp_path, caplog):
    from ulorl_jax.data.sources import prompt_file_stream

    rows = [{"prompt": "a" * (5 if i % 4 else 60), "answer": "1"} for i in range(20)]  # 5 of 20 too long
    path = _write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in rows] + ["{broken"])
    options = _data_options(max_dropped_fraction=0.5)
    with caplog.at_level("WARNING"):
        stream = prompt_file_stream([str(path)], options, TOK, 40, shuffle=False)
    assert len(stream) == 15
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"{path}: kept 15 of 21 rows, dropped 6" in message
    assert "5 x prompt is N tokens, over max_prompt_len=N" in message and "1 x bad JSON" in message
    with pytest.raises(ValueError, match=r"kept 15 of 21 rows, dropped 6 .* more than data.max_dropped_fraction=0.2"):
        prompt_file_stream([str(path)], _data_options(), TOK, 40, shuffle=False)


def test_eval_files_have_their_own_keys(tmp_path):
    from ulorl_jax.data.sources import prompt_file_stream

    path = _write_lines(tmp_path / "e.jsonl", [json.dumps({"problem": "1+1", "solution": "2"})])
    options = _data_options(eval_prompt_key="problem", eval_answer_key="solution")
    items = prompt_file_stream([str(path)], options, TOK, None, shuffle=False, held_out=True).take(1)
    assert items[0].metadata["answer"] == "2" and items[0].metadata["prompt"] == "1+1"
    with pytest.raises(ValueError, match=r"has the prompt key 'prompt'.*Set data\.prompt_key"):  # training's key
        prompt_file_stream([str(path)], options, TOK, None, shuffle=False)


def test_bad_json_message_says_where_and_shows_the_line(tmp_path):
    path = _write_lines(tmp_path / "b.jsonl", ['{"prompt": "x", "answer": }'])
    (_, row), = read_rows(path)
    assert isinstance(row, BadRow)
    assert row.reason.startswith("bad JSON (Expecting value at column 27): ")
    assert '{"prompt": "x", "answer": }' in row.reason


@pytest.mark.parametrize("line, reason", [
    # json's own message ends in "at" for these: said once
    ('{"prompt": "a\tb"}', "bad JSON (Invalid control character at column 14): '{\"prompt\": \"a\\tb\"}'"),
    ('{"prompt": "ab', "bad JSON (Unterminated string starting at column 12): '{\"prompt\": \"ab'"),
    ('{"prompt" 1}', "bad JSON (Expecting ':' delimiter at column 11): '{\"prompt\" 1}'"),
])
def test_bad_json_message_says_at_once(tmp_path, line, reason):
    path = tmp_path / "b.jsonl"
    path.write_text(line)  # no newline at the end: else it is the unterminated string's control character
    (_, row), = read_rows(path)
    assert row.reason == reason
