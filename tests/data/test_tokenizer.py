"""The local character-level tokenizer: round trip, chat template, reload from disk offline."""

from __future__ import annotations

import pytest

from ulorl_jax.data.tokenizer import (
    DEFAULT_ALPHABET,
    EOS_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    synthetic_alphabet,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_vocab_small_and_specials(tok):
    assert len(tok) == 4 + 3 + len(DEFAULT_ALPHABET) < 128
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.bos_token is None  # like Qwen3: no bos
    small = build_tokenizer(synthetic_alphabet())
    assert len(small) == 4 + 3 + len(set(synthetic_alphabet())) <= 64


def test_round_trip_character_level(tok):
    text = "sum mod 10: a3 b5 c8\na3=3\nb5=8\nc8=6\n\\boxed{6}"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one id per character, independently of any merge table
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids) == list(text)
    unk = tok.encode("é", add_special_tokens=False)
    assert unk == [tok.unk_token_id]


def test_chat_template_matches_chatml(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum mod 10: 3 5"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsum mod 10: 3 5<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert text == expected
    tokens = tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))
    assert tokens[:3] == ["<|im_start|>", "system", "\n"] and tokens[-2:] == ["assistant", "\n"]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_save_and_reload_offline(tok, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\n12+7=9<|im_end|>\n"
    assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert (again.eos_token_id, again.pad_token_id, len(again)) == (tok.eos_token_id, tok.pad_token_id, len(tok))
    messages = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_empty_alphabet_rejected():
    with pytest.raises(ValueError, match="alphabet"):
        build_tokenizer("")
