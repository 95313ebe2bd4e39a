"""The `ulorl` command line: --help everywhere, convert both ways (the demo: tests/test_demo.py)."""


import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from hf_utils import hf_logits, random_tokens, save_hf_model
from ulorl_jax.cli import build_parser, main
from ulorl_jax.models.native import load_native


def _subcommands(parser, prefix=()):
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in action.choices.items():
            yield prefix + (name,)
            yield from _subcommands(sub, prefix + (name,))


@pytest.mark.parametrize("argv", [()] + list(_subcommands(build_parser())), ids=lambda a: " ".join(a) or "ulorl")
def test_help_works(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert "usage: ulorl" in capsys.readouterr().out


def test_convert_both_directions(tmp_path, capsys):
    hf = save_hf_model("qwen3_moe", tmp_path / "hf")
    assert main(["convert", "hf-to-ulorl", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    model = load_native(tmp_path / "ours")
    tokens = random_tokens(2, 6)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4)
    assert main(["convert", "ulorl-to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(hf, tokens), atol=1e-5)
    assert "converted" in capsys.readouterr().out


def test_convert_bad_source_is_a_clear_error(tmp_path, capsys):
    assert main(["convert", "hf-to-ulorl", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "model folder not found" in capsys.readouterr().err
    assert main(["convert", "ulorl-to-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a ulorl model folder" in capsys.readouterr().err


def test_eval_help_names_every_data_format_and_what_out_overwrites(capsys):
    """`ulorl eval --help`: --data takes jsonl, parquet and a datasets folder (data/readers.py); --out overwrites,
    the default result names never do."""
    from ulorl_jax.data.readers import FORMATS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert set(FORMATS) == {"jsonl", "parquet", "hf"}
    assert ".jsonl" in text and ".parquet" in text and "datasets save_to_disk folder" in text
    assert "both are overwritten if they exist" in text and "never overwritten" in text
    assert "FILE.samples.jsonl" in text
