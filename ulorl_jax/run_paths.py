"""The path-valued options of a run config, resolved in one place.

A run folder must work from any working directory (`ulorl eval --run-dir`, `ulorl generate --model RUN`,
`ulorl export RUN`, `ulorl train --config RUN/config.yaml --resume`). So the trainer resolves every
path-valued option against the directory `ulorl train` was started from, before the run folder is made,
and `config.yaml` stores them absolute. A config file given to `ulorl train` keeps its relative paths
relative to the working directory, as a shell user expects. A run folder written before this stored the
paths as given: `run_config` resolves those against the working directory and says so in a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Every option of config.py's schema whose value is a local file or folder (a list of them for the data
# files). tests/test_run_folder.py checks that no path-like option of the schema is missing here.
PATH_OPTIONS = ("model.path", "model.tokenizer", "data.train_files", "data.eval_files", "reward.verifier_model")
# Options that name a folder (the others name files or folders).
FOLDER_OPTIONS = ("model.path", "model.tokenizer", "reward.verifier_model")


def absolute(path: str, base: str | os.PathLike | None = None) -> str:
    """`path` with `~` expanded, made absolute against `base` (default: the working directory), normalised."""
    p = os.path.expanduser(str(path))
    return os.path.normpath(os.path.join(os.fspath(base) if base is not None else os.getcwd(), p))


def option_value(cfg, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def relative_paths(values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` ({option: value}, PATH_OPTIONS keys) that hold a relative path."""
    out = {}
    for key in PATH_OPTIONS:
        value = values.get(key)
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, str) and not os.path.isabs(os.path.expanduser(v)) for v in items):
            out[key] = value
    return out


def resolve_value(value: Any, base: str | os.PathLike | None = None) -> Any:
    """One option's value with its path(s) made absolute; None stays None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [absolute(v, base) for v in value]
    return absolute(value, base)


def resolve_paths(cfg, base: str | os.PathLike | None = None):
    """A copy of RunConfig `cfg` whose PATH_OPTIONS are absolute (relative ones resolved against `base`,
    default the working directory)."""
    sections: dict[str, dict[str, Any]] = {}
    for key in PATH_OPTIONS:
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = resolve_value(option_value(cfg, key), base)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                       for section, fields in sections.items()})


def resolve_flat(flat: dict[str, Any], base: str | os.PathLike | None = None) -> dict[str, Any]:
    """`flat` ({'model.path': ..., ...}, e.g. a saved config.yaml flattened) with PATH_OPTIONS absolute."""
    return {key: resolve_value(value, base) if key in PATH_OPTIONS else value for key, value in flat.items()}


def used_paths(cfg) -> tuple[str, ...]:
    """The PATH_OPTIONS a training run reads: the data files unless data.synthetic is set, the verifier's
    model only with reward.kind=verifier."""
    keys = ["model.path", "model.tokenizer"]
    if cfg.data.synthetic is None:
        keys += ["data.train_files", "data.eval_files"]
    if cfg.reward.kind == "verifier":
        keys.append("reward.verifier_model")
    return tuple(keys)


def check_paths_exist(cfg, keys: tuple[str, ...] = PATH_OPTIONS, where: str = "") -> None:
    """FileNotFoundError naming the first option in `keys` whose file or folder does not exist, its
    value, and the fix. `where`: where the value comes from (e.g. ' in runs/x/config.yaml')."""
    for key in keys:
        value = option_value(cfg, key)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is None:
                continue
            p = Path(item)
            if key in FOLDER_OPTIONS and p.is_file():
                raise FileNotFoundError(f"{key}={item}{where} is a file, not a folder: give the model folder "
                                        f"(config.json + *.safetensors, or a ulorl folder)")
            if not p.exists():
                kind = "folder" if key in FOLDER_OPTIONS else "file or folder"
                raise FileNotFoundError(f"{key}={item}{where}: no such {kind} (relative paths are resolved against "
                                        f"the working directory, {os.getcwd()}): fix {key} or run from the "
                                        f"directory it is relative to")
