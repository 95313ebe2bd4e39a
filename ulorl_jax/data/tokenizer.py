"""A small character-level tokenizer built locally (no downloads), with a Qwen-style chat template.

For the tiny policies of tests and `ulorl demo`: every printable ASCII
character plus newline is one token, the chat roles are single tokens, and
the special tokens follow Qwen's names, so code written for a real Qwen3
tokenizer (eos "<|im_end|>", pad "<|endoftext|>", no bos) runs unchanged.
Vocab: 4 special + 3 role + 96 characters = 103 ids (< 128, the tiny
policy's vocab). `save_pretrained(folder)` writes a folder that
`transformers.AutoTokenizer.from_pretrained(folder)` reloads offline.
"""

from __future__ import annotations

import string
from typing import Sequence

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN, UNK_TOKEN)  # ids 0..3
ROLE_TOKENS = ("system", "user", "assistant")
DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"  # printable ASCII + newline

# Qwen's ChatML layout without Qwen3's thinking/tool branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def synthetic_alphabet() -> str:
    """Just the characters `data/synthetic.py` writes (digits, labels a-z, = \\ { } : space, newline)."""
    return string.digits + string.ascii_lowercase + ":=\\{} \n"


def build_tokenizer(alphabet: str | None = None, *, extra_tokens: Sequence[str] = (),
                    chat_template: str = CHAT_TEMPLATE):
    """A `transformers.PreTrainedTokenizerFast`: one token per character of `alphabet`.

    alphabet: characters to cover (default printable ASCII + "\\n"); others map to "<unk>".
    extra_tokens: whole strings that become single tokens (matched before characters).
    Ids: specials 0..3 (pad, im_start, eos=im_end, unk), roles, extras, then characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not alphabet:
        raise ValueError("build_tokenizer: alphabet is empty")
    words = (*ROLE_TOKENS, *extra_tokens)
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *words, *alphabet):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(words))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   unk_token=UNK_TOKEN, padding_side="right")
    fast.chat_template = chat_template
    return fast
