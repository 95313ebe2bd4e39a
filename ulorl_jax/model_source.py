"""What `--model` may point at, and how to load it with its tokenizer.

Every command that takes `--model` accepts:
  - a Hugging Face folder   config.json + *.safetensors (+ tokenizer files)
  - a ulorl model folder    model_config.json + params/ (`ulorl convert hf-to-ulorl`)
  - a run folder            config.yaml + checkpoints/ (`ulorl train`): its latest checkpoint
  - one checkpoint          RUN/checkpoints/STEP: that step
A run's architecture and tokenizer come from its own config.yaml (the base model folder it
started from, or `model.arch`); the weights come from the checkpoint, restored into an abstract
model (no second copy of the weights is built first).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("hf", "ulorl", "run", "config")  # config: a fresh model built from a run config's model.arch
RUN_CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # one of KINDS
    path: Path  # the model folder, or the run folder for kind "run"
    step: int | None = None  # kind "run": the checkpoint step (None: the latest)

    def describe(self) -> str:
        if self.kind == "run":
            return f"run {self.path} checkpoint {'latest' if self.step is None else self.step}"
        if self.kind == "config":
            return "a fresh (randomly initialised) model from the config's model.arch"
        return f"{'Hugging Face' if self.kind == 'hf' else 'ulorl'} model folder {self.path}"


@dataclasses.dataclass
class LoadedModel:
    model: Any  # Qwen3ForCausalLM
    tokenizer: Any  # a transformers tokenizer, or None (a model folder without tokenizer files)
    source: ModelSource  # with the step resolved for runs
    run_config: Any = None  # RunConfig of a run source


def resolve(path: str | Path, step: int | None = None) -> ModelSource:
    """Classify `path` (see the module docstring); `step` picks a checkpoint of a run folder."""
    from ulorl_jax.models.native import is_native

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no such folder (expected a model folder, a run folder or a checkpoint)")
    if step is not None and not _is_run(p):
        raise ValueError(f"a checkpoint step ({step}) only applies to a run folder; {path} is not one")
    if is_native(p):
        return ModelSource("ulorl", p)
    if (p / "config.json").is_file():
        return ModelSource("hf", p)
    if _is_run(p):
        return ModelSource("run", p, step)
    if p.name.isdigit() and p.parent.name == CHECKPOINTS and _is_run(p.parent.parent):
        return ModelSource("run", p.parent.parent, int(p.name))
    raise ValueError(
        f"{path} is not a model: expected a Hugging Face folder (config.json + *.safetensors), a ulorl folder "
        f"(model_config.json + params/), a run folder ({RUN_CONFIG} + {CHECKPOINTS}/) or one checkpoint of a run "
        f"(RUN/{CHECKPOINTS}/STEP)")


def _is_run(p: Path) -> bool:
    return (p / RUN_CONFIG).is_file() and (p / CHECKPOINTS).is_dir()


def run_config(run_dir: str | Path, overrides: list[str] | None = None):
    """The RunConfig a run was trained with (its config.yaml), with `overrides` applied, its path-valued
    options absolute (`run_paths.py`: a run stores them so; an older run's relative ones, and relative
    overrides, are resolved against the working directory)."""
    from ulorl_jax import run_paths
    from ulorl_jax.config import load_config

    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run folder (`ulorl train` writes it first)")
    cfg = load_config(str(path), list(overrides or []))
    relative = run_paths.relative_paths({key: run_paths.option_value(cfg, key) for key in run_paths.PATH_OPTIONS})
    if relative:
        log.warning("%s holds relative paths (%s), resolved against the working directory %s; runs written by "
                    "this version store them absolute", path,
                    ", ".join(f"{k}={v}" for k, v in relative.items()), Path.cwd())
    return run_paths.resolve_paths(cfg)


def read_model_config(path: str | Path, dtype: str | None = None, **runtime):
    """The ModelConfig of an HF or ulorl folder, without reading any weights."""
    import json

    from ulorl_jax.models.config import ModelConfig
    from ulorl_jax.models.hf import load_hf_config
    from ulorl_jax.models.native import CONFIG_FILE, is_native

    if dtype is not None:
        runtime = {"param_dtype": dtype, "dtype": dtype, **runtime}
    if is_native(path):
        fields = json.loads((Path(path) / CONFIG_FILE).read_text())
        fields["mlp_only_layers"] = tuple(fields.get("mlp_only_layers", ()))
        return ModelConfig(**{**fields, **runtime})
    return ModelConfig.from_hf_dict(load_hf_config(path), **runtime)


def checkpoint_step(run_dir: str | Path, step: int | None) -> int:
    """`step` if the run has it committed, else the latest; a clear error names what exists."""
    from ulorl_jax.checkpoint import CheckpointError

    folder = Path(run_dir) / CHECKPOINTS
    steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    if not steps:
        raise CheckpointError(f"no committed checkpoint in {folder}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"checkpoint step {step} not in {folder} (available: {steps})")
    return step


def load(source: ModelSource, dtype: str | None = None, overrides: list[str] | None = None) -> LoadedModel:
    """The model and tokenizer of `source` on this process's first device. `overrides` (run sources):
    key=value changes to the run's config (runtime options such as model.attention_impl)."""
    from ulorl_jax.models.native import load_any

    if source.kind != "run":
        return LoadedModel(load_any(source.path, dtype=dtype), load_tokenizer(source.path), source)
    from flax import nnx

    from ulorl_jax import run_paths
    from ulorl_jax.checkpoint import TrainCheckpointer
    from ulorl_jax.models.qwen3 import Qwen3ForCausalLM

    cfg = run_config(source.path, overrides)
    run_paths.check_paths_exist(cfg, ("model.path", "model.tokenizer"),
                                where=f" (in {Path(source.path) / RUN_CONFIG})")
    step = checkpoint_step(source.path, source.step)
    dtype = dtype or cfg.model.param_dtype
    base = None if cfg.model.path is None else read_model_config(cfg.model.path, dtype)
    config = cfg.model.model_config(base)
    if dtype is not None:
        config = config.replace(param_dtype=dtype, dtype=dtype)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    ckpt = TrainCheckpointer(Path(source.path) / CHECKPOINTS, async_save=False)
    try:
        params = ckpt.restore_tree(step, "params", nnx.state(model, nnx.Param))
    finally:
        ckpt.close()
    nnx.update(model, params)
    return LoadedModel(model, build_tokenizer(cfg), dataclasses.replace(source, step=step), cfg)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def eos_token_ids(config, tokenizer) -> tuple[int, ...]:
    """The ids that end a sample: the model config's `eos_token_id` (an int or a list) and the tokenizer's."""
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(int(i) for i in ids)))


def load_tokenizer(model_dir: str | Path) -> Any:
    """The folder's tokenizer, or None when it has no tokenizer files (AutoTokenizer would silently
    build an empty one from such a folder)."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files (and chat template) of model folder `src` into `dst`; the names copied."""
    import shutil

    names = [f for f in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja", "merges.txt",
                         "added_tokens.json") if (Path(src) / f).is_file()]
    for name in names:
        shutil.copy2(Path(src) / name, Path(dst) / name)
    return names


def build_tokenizer(cfg):
    """The run's tokenizer: `model.tokenizer`, else the model folder's, else the synthetic task's."""
    folder = cfg.model.tokenizer or cfg.model.path
    if folder is not None:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        from ulorl_jax import run_paths

        run_paths.check_paths_exist(cfg, (key,))  # a missing folder is named as missing, not as tokenizer-less
        try:
            tokenizer = load_tokenizer(folder)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot load a tokenizer from {folder} ({key}): {err}") from None
        if tokenizer is None:  # AutoTokenizer would silently build an empty tokenizer from such a folder
            raise ValueError(f"{folder} ({key}) has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy the "
                             f"base model's tokenizer there or set model.tokenizer=DIR")
        return tokenizer
    if cfg.data.synthetic is None:
        raise ValueError("no tokenizer: set model.tokenizer or model.path (or use data.synthetic)")
    from ulorl_jax.data.tokenizer import build_tokenizer as build_char_tokenizer
    from ulorl_jax.data.tokenizer import synthetic_alphabet

    return build_char_tokenizer(synthetic_alphabet())
