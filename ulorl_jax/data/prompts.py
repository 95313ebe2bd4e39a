"""Prompts for RL: read, validate, tokenize (chat template), and stream in a resumable shuffled order.

`load_prompts(config, tokenizer)` reads every row once (data/readers.py),
keeps the valid ones as `PromptRecord`s and reports the others as `BadRow`s
with file and line: bad JSON, missing key, wrong type, empty prompt, prompt
longer than `max_prompt_len` tokens. `on_bad_row="skip"` logs and counts
them; "error" raises ValueError at the first one. A file in which no row has
the prompt (or answer) key is one error naming the key, the keys its rows do
have and the option that sets the key, raised before any per-row warning.

A record's metadata (what rewards see, `fn(prediction, reference, metadata)`)
holds `source` (the file), `line`, `prompt` (text prompts), `answer`, and the
row's other keys (`extra_keys`: None = all of them), as JSON values: numpy
arrays become lists, dates ISO strings; checkpoints store metadata as JSON.

`PromptStream` yields `PromptItem`s (ulorl_jax/types.py) forever, epoch after
epoch; epoch e visits the records in the permutation drawn from (seed, e).
`state_dict()` (JSON-able: epoch, position, seed, a data fingerprint) and
`load_state_dict()` let a resumed run continue with exactly the next prompt.
`prompt_index` = epoch * num_prompts + position: unique over the run, so
the same prompt drawn in two epochs forms two GRPO groups that never mix.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import logging
import zlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ulorl_jax.data.readers import BadRow, read_rows
from ulorl_jax.types import PromptItem

logger = logging.getLogger(__name__)

BAD_ROW_ACTIONS = ("skip", "error")
_LOGGED_BAD_ROWS = 20
# Metadata keys the data layer, the stream and the trainer set: a row key of the same name is not copied.
RESERVED_METADATA_KEYS = ("source", "line", "prompt", "answer", "row", "epoch", "reward")


@dataclasses.dataclass
class PromptDataConfig:
    """Where prompts come from and how rows become token ids."""

    path: str = ""
    prompt_key: str = "prompt"  # str, a list of chat messages, or a list of token ids
    answer_key: str | None = "answer"  # None: rows need no reference answer
    max_prompt_len: int | None = None  # tokens, after the chat template
    on_bad_row: str = "skip"  # "skip" | "error"
    use_chat_template: bool = True  # when the tokenizer has one
    system_prompt: str | None = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)  # e.g. {"enable_thinking": True}
    split: str = "train"  # for a datasets folder holding a DatasetDict
    # row fields copied into metadata: None = every key but prompt_key / answer_key (and the reserved
    # names, RESERVED_METADATA_KEYS); a listed key is left out where a row lacks it; a listed key holding a
    # value JSON cannot carry makes the row bad
    extra_keys: tuple[str, ...] | None = None
    shuffle: bool = True
    seed: int = 0
    # the config options that set prompt_key / answer_key / extra_keys, named in error messages
    prompt_key_option: str = "prompt_key"
    answer_key_option: str = "answer_key"
    extra_keys_option: str = "extra_keys"

    def validate(self) -> None:
        if not self.path:
            raise ValueError("prompt data: path is empty")
        if self.extra_keys is not None:
            if isinstance(self.extra_keys, str):
                raise ValueError(f"{self.extra_keys_option}={self.extra_keys!r}: expected a list of row keys, "
                                 f"e.g. [{self.extra_keys}]")
            reserved = sorted(set(self.extra_keys) & set(RESERVED_METADATA_KEYS))
            if reserved:
                raise ValueError(f"{self.extra_keys_option} lists {reserved}: metadata keys the data layer sets "
                                 f"itself ({', '.join(RESERVED_METADATA_KEYS)}); rename the row field")
        if self.on_bad_row not in BAD_ROW_ACTIONS:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_ACTIONS}, got {self.on_bad_row!r}")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {self.max_prompt_len}")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One valid row: its token ids and the metadata passed through to rewards."""

    prompt_ids: list[int]
    metadata: dict


def encode_prompt(tokenizer: Any, prompt: Any, *, use_chat_template: bool = True,
                  system_prompt: str | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt given as text, a list of chat messages, or token ids.

    Text goes through the chat template (one user turn, generation prompt
    added) when the tokenizer has one and `use_chat_template`; otherwise it
    is encoded as is. Raises ValueError / TypeError describing a bad prompt.
    """
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if tokenizer is not None and not all(0 <= t < len(tokenizer) for t in prompt):
            raise ValueError(f"token ids outside the tokenizer's vocabulary [0, {len(tokenizer)})")
        if any(t < 0 for t in prompt):
            raise ValueError("negative token id")
        return list(prompt)
    if tokenizer is None:
        raise ValueError("prompt is text but no tokenizer was given")
    has_template = bool(getattr(tokenizer, "chat_template", None)) and use_chat_template
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        if not has_template:
            return list(tokenizer.encode(prompt))
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        if not has_template:
            raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
        if not any(m["content"].strip() for m in prompt):
            raise ValueError("empty prompt (every message is empty)")
        messages = [dict(m) for m in prompt]
    else:
        raise TypeError(f"prompt must be a non-empty string, a list of {{'role', 'content'}} messages or a "
                        f"list of token ids, got {_describe(prompt)}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))
    return list(tokenizer.encode(text, add_special_tokens=False))


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of length {len(value)}" if value else f"an empty {type(value).__name__}"
    return type(value).__name__


def _answer_text(answer: Any) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"answer must be a string or a number, got {_describe(answer)}")
    text = str(answer).strip()
    if not text:
        raise ValueError("empty answer")
    return text


def json_value(value: Any) -> Any:
    """`value` as JSON types (dict with str keys, list, str, int, float, bool, None): numpy arrays and
    scalars (parquet / datasets rows), tuples, dates (ISO strings), Decimals (strings). TypeError otherwise."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a mapping with non-string keys ({_describe_keys(value)})")
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_value(value.tolist())
    if isinstance(value, np.generic):
        return json_value(value.item())
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"a {type(value).__name__} value")


def _describe_keys(mapping: dict) -> str:
    return ", ".join(sorted({type(k).__name__ for k in mapping if not isinstance(k, str)}))


def _extra_metadata(row: dict, config: PromptDataConfig, skipped: dict[str, str] | None) -> dict:
    """The row's extra fields for metadata (see PromptDataConfig.extra_keys); `skipped` collects the keys
    left out when copying every key (reserved name or not JSON-able) with why."""
    out: dict = {}
    if config.extra_keys is not None:
        for key in config.extra_keys:
            if key not in row:
                continue  # optional per row, as when every key is copied
            try:
                out[key] = json_value(row[key])
            except TypeError as err:
                raise TypeError(f"key {key!r} (listed in {config.extra_keys_option}) holds {err}, which the "
                                "reward's metadata cannot carry (it must be JSON-able)") from None
        return out
    for key, value in row.items():
        if key in (config.prompt_key, config.answer_key):
            continue
        if key in RESERVED_METADATA_KEYS:
            if skipped is not None and key not in skipped:
                skipped[key] = (f"metadata[{key!r}] is set by ulorl itself ({', '.join(RESERVED_METADATA_KEYS)} "
                                "are); rename the field to pass it to the reward")
            continue
        try:
            out[key] = json_value(value)
        except TypeError as err:
            if skipped is not None and key not in skipped:
                skipped[key] = (f"it holds {err}, which metadata cannot carry (it must be JSON-able); set "
                                f"{config.extra_keys_option} to the keys the reward needs")
    return out


def record_from_row(row: dict, config: PromptDataConfig, tokenizer: Any, source: str,
                    line: int, skipped: dict[str, str] | None = None) -> PromptRecord:
    """Validate and tokenize one row; ValueError / TypeError / KeyError say what is wrong.
    `skipped`: filled with the row keys not copied into metadata (extra_keys None), and why."""
    if config.prompt_key not in row:
        raise KeyError(f"missing key {config.prompt_key!r} (keys: {sorted(row)[:8]})")
    prompt = row[config.prompt_key]
    prompt_ids = encode_prompt(tokenizer, prompt, use_chat_template=config.use_chat_template,
                               system_prompt=config.system_prompt, chat_template_kwargs=config.chat_template_kwargs)
    if config.max_prompt_len is not None and len(prompt_ids) > config.max_prompt_len:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens, over max_prompt_len={config.max_prompt_len}")
    metadata: dict = {"source": source, "line": line}
    if isinstance(prompt, str):
        metadata["prompt"] = prompt
    if config.answer_key is not None:
        if config.answer_key not in row:
            raise KeyError(f"missing key {config.answer_key!r} (keys: {sorted(row)[:8]})")
        metadata["answer"] = _answer_text(row[config.answer_key])
    return PromptRecord(prompt_ids, {**_extra_metadata(row, config, skipped), **metadata})


def load_prompts(config: PromptDataConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[BadRow]]:
    """All valid records of `config.path` and the bad rows (raises at the first bad row if on_bad_row="error")."""
    config.validate()
    source = str(Path(config.path))
    records: list[PromptRecord] = []
    bad: list[BadRow] = []
    keys = _KeyCensus(config)
    skipped: dict[str, str] = {}
    pending: BadRow | None = None  # on_bad_row="error": a missing-key row, held until the file is scanned
    for line, row in read_rows(config.path, split=config.split):
        if not isinstance(row, BadRow):
            keys.add(row)
            if pending is not None:
                continue  # only looking for the key now
            try:
                records.append(record_from_row(row, config, tokenizer, source, line, skipped))
                continue
            except (KeyError, TypeError, ValueError) as err:
                reason = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
                row = BadRow(source, line, str(reason))
                if config.on_bad_row == "error" and isinstance(err, KeyError) and keys.lacks_a_key():
                    pending = row  # a file without the key at all gets the clearer error below
                    continue
        if config.on_bad_row == "error":
            raise ValueError(f"bad prompt row {row} (set data.on_bad_row=skip to skip such rows)")
        bad.append(row)
    keys.check(source)  # before any per-row warning: one error for a file read with the wrong key
    if pending is not None:
        raise ValueError(f"bad prompt row {pending} (set data.on_bad_row=skip to skip such rows)")
    for row in bad[:_LOGGED_BAD_ROWS]:
        logger.warning("skipping bad prompt row %s", row)
    if len(bad) > _LOGGED_BAD_ROWS:
        logger.warning("skipped %d bad prompt rows in %s in all (first %d logged)", len(bad), source,
                       _LOGGED_BAD_ROWS)
    for key, why in sorted(skipped.items()):
        logger.warning("data: %s: row key %r is not passed to rewards: %s", source, key, why)
    if not records:
        raise ValueError(f"prompt data {source!r} has no valid rows ({len(bad)} bad"
                         + (f", first: {bad[0]}" if bad else "") + ")")
    return records, bad


class _KeyCensus:
    """Which of the configured prompt / answer keys a file's rows have, and the keys they have instead."""

    _MAX_KEYS = 40  # keys named in the error

    def __init__(self, config: PromptDataConfig):
        self.rows = 0
        self.seen: dict[str, None] = {}  # every key met, in first-seen order
        wanted = [(config.prompt_key, "prompt", config.prompt_key_option)]
        if config.answer_key is not None:
            wanted.append((config.answer_key, "answer", config.answer_key_option))
        self.wanted = wanted
        self.found = {key: False for key, _, _ in wanted}

    def add(self, row: dict) -> None:
        self.rows += 1
        for key in self.found:
            if not self.found[key] and key in row:
                self.found[key] = True
        if len(self.seen) < 10 * self._MAX_KEYS:
            self.seen.update(dict.fromkeys(row))

    def lacks_a_key(self) -> bool:
        return not all(self.found.values())

    def check(self, source: str) -> None:
        for key, role, option in self.wanted:
            if self.rows and not self.found[key]:
                have = sorted(map(str, self.seen))
                shown = have[:self._MAX_KEYS] + (["..."] if len(have) > self._MAX_KEYS else [])
                raise ValueError(
                    f"prompt data {source!r} has no valid rows: none of its {self.rows} rows has the {role} key "
                    f"{key!r}; its rows have the keys {shown}. Set {option} to the key that holds the {role}")


def fingerprint(records: Sequence[PromptRecord]) -> int:
    """crc32 over every record's token ids: resuming on different data is an error, not a silent mix."""
    crc = 0
    for record in records:
        crc = zlib.crc32(np.asarray(record.prompt_ids, np.int64).tobytes(), crc)
        crc = zlib.crc32(b"|", crc)
    return crc


class PromptStream:
    """Endless, deterministic, resumable stream of `PromptItem`s over `records` (see module doc)."""

    def __init__(self, records: Sequence[PromptRecord], *, seed: int = 0, shuffle: bool = True,
                 bad_rows: Sequence[BadRow] = ()):
        if not records:
            raise ValueError("PromptStream needs at least one prompt record")
        self.records = list(records)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.bad_rows = list(bad_rows)
        self._fingerprint = fingerprint(self.records)
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next record
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, config: PromptDataConfig, tokenizer: Any) -> "PromptStream":
        records, bad = load_prompts(config, tokenizer)
        return cls(records, seed=config.seed, shuffle=config.shuffle, bad_rows=bad)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next(self) -> PromptItem:
        """The next prompt; a new epoch (new permutation) starts after the last one."""
        if self.position == len(self.records):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        row = int(self._order[self.position])
        record = self.records[row]
        item = PromptItem(prompt_index=self.epoch * len(self.records) + self.position,
                          prompt_ids=list(record.prompt_ids),
                          metadata={**record.metadata, "row": row, "epoch": self.epoch})
        self.position += 1
        return item

    def take(self, n: int) -> list[PromptItem]:
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[PromptItem]:
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        """JSON-able position: the next `next()` after `load_state_dict` of this returns the same prompt."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.records), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_prompts") != len(self.records) or state.get("fingerprint") != self._fingerprint:
            raise ValueError(f"prompt data changed since this state was saved: it had {state.get('num_prompts')} "
                             f"prompts (fingerprint {state.get('fingerprint')}), the data now has "
                             f"{len(self.records)} (fingerprint {self._fingerprint})")
        if not 0 <= int(state["position"]) <= len(self.records) or int(state["epoch"]) < 0:
            raise ValueError(f"prompt stream state out of range: epoch {state['epoch']}, "
                             f"position {state['position']} of {len(self.records)}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
