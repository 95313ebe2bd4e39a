"""Run configuration: a typed schema of every option, YAML files, `key=value` overrides.

One nested dataclass per concern (model, mesh, data, rollout, algorithm, optim,
trainer, reward, eval, checkpoint, logging), composed into `RunConfig`. Files
and overrides are merged onto the schema by OmegaConf; unknown keys, wrong types
and out-of-range values are `ConfigError`s that name the key (with its full
dotted path), the value and what was expected. Names follow verl where the
concept matches (`rollout.n`, `ppo_mini_batch_size`, `clip_ratio_low`, ...).

Defaults are the paper's recipe (ULORL.md "Rest of the recipe") wherever it
gives a value; the model and the data have no default.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ulorl_jax import choices
from ulorl_jax.models.config import (
    ConfigError,  # the same class as ulorl_jax.models.config.ConfigError (a ValueError)
    ModelConfig,
    resolve_dtype,
)
from ulorl_jax.options import (  # every option's allowed values, once
    CHOICES,
    RANGES,
    check_option,
)

__all__ = [
    "CHOICES",
    "AlgorithmOptions",
    "CheckpointOptions",
    "ConfigError",
    "DataOptions",
    "EvalOptions",
    "LoggingOptions",
    "MeshOptions",
    "ModelOptions",
    "OptimOptions",
    "RewardOptions",
    "RolloutOptions",
    "RunConfig",
    "TrainerOptions",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "remat_policy",
    "shipped_configs",
]

# Runtime fields of ModelConfig that live in `model.*`, not in `model.arch`.
_RUNTIME_MODEL_FIELDS = ("dtype", "param_dtype", "attention_impl", "moe_impl")


@dataclasses.dataclass
class ModelOptions:
    # HF folder (config.json + safetensors) or ulorl folder; null = a fresh random model built from `arch`.
    path: str | None = None
    # ModelConfig fields (HF config.json names). With path null: the architecture of the fresh model.
    # With path set: the values the checkpoint must have (checked at load; a YAML documents its model).
    arch: dict[str, Any] | None = None
    # ModelConfig fields replaced after loading, e.g. rope_scaling for YaRN.
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str | None = None  # HF tokenizer folder; null = the one in `path` (or the synthetic task's)
    dtype: str = "float32"  # activations
    param_dtype: str = "float32"
    attention_impl: str = "blockwise"  # xla (materialised reference) | blockwise | cudnn | pallas
    moe_impl: str = "ragged"

    def model_config(self, loaded: ModelConfig | None = None) -> ModelConfig:
        """The ModelConfig to build: `loaded` (a checkpoint's) or `arch`, checked, overridden, runtime set."""
        runtime = {name: getattr(self, name) for name in _RUNTIME_MODEL_FIELDS}
        if loaded is None:
            if self.arch is None:
                raise ConfigError("model.arch is needed to build a fresh model (model.path is null)")
            return ModelConfig(**{**self.arch, **self.overrides, **runtime})
        for name, want in (self.arch or {}).items():
            have = getattr(loaded, name)
            if _normalise(have) != _normalise(want):
                raise ConfigError(f"model.arch.{name}={want!r} but the checkpoint {self.path} has {have!r}")
        return loaded.replace(**self.overrides, **runtime)


def _normalise(value):
    return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass
class MeshOptions:
    """Device mesh (sharding.MeshConfig): sizes positive, or -1 (one axis) for the remaining devices."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    # Context parallelism: each packed row's tokens split over this many devices (load-balanced causal
    # layout, models/context_layout.py); parameters are split over it as over fsdp. For rows too long for
    # one device's activations (64k-128k tokens); trainer.row_len must be a multiple of 2 x context.
    context: int = 1
    tensor: int = 1

    def mesh_config(self):
        from ulorl_jax.sharding import MeshConfig

        return MeshConfig(data=self.data, fsdp=self.fsdp, expert=self.expert, context=self.context,
                          tensor=self.tensor)


@dataclasses.dataclass
class DataOptions:
    train_files: list[str] = dataclasses.field(default_factory=list)  # jsonl / parquet
    eval_files: list[str] = dataclasses.field(default_factory=list)  # held-out sets for `eval`
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle_seed: int = 0
    apply_chat_template: bool = True
    eval_prompt_key: str | None = None  # keys of eval_files' rows; null = prompt_key / answer_key
    eval_answer_key: str | None = None
    on_bad_row: str = "skip"  # skip (counted and reported per file) | error
    max_dropped_fraction: float = 0.2  # refuse a file when more of its rows are bad (skipped); 1 = never
    max_prompt_len: int | None = 1024  # tokens; longer prompts are bad rows; null = no limit
    system_prompt: str | None = None  # a system turn before every text prompt (chat template)
    # extra arguments of the tokenizer's chat template, e.g. {enable_thinking: true} for Qwen3
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # row keys passed to rewards in their metadata (besides prompt / answer); null = every other key; [] = none
    extra_keys: list[str] | None = None
    # Knobs of a generated task (see ulorl_jax.data); null when reading files.
    synthetic: dict[str, Any] | None = None


@dataclasses.dataclass
class RolloutOptions:
    backend: str = "engine"  # in-process PolicyEngine | JetStream orchestrator
    global_max_len: int = 131072  # max response tokens (ULORL.md §1)
    num_segments: int = 8  # segment_len = global_max_len / num_segments
    n: int = 8  # samples per prompt (GRPO group size G)
    temperature: float = 0.85
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    max_concurrent_decodes: int | None = None  # decode slots; null = the whole batch at once
    prefill_buckets: list[int] | None = None  # padded prompt lengths; null = powers of two
    # padded tokens per batched prefill call (rows x bucket): a step's new and continued samples are
    # prefilled in as few calls as this allows (decode/engine.py)
    prefill_token_budget: int = 4096
    # where the rollout decodes (decode/placement.py): auto = the learner's mesh with one process; with
    # several, every local device (replicate: whole weights on each; shard: weights split, for a model that
    # does not fit one device) | learner | replicate | shard | first_device
    decode_mesh: str = "auto"
    # the engine's KV cache (decode/cache_layout.py): paged = pages of page_size positions from a pool of
    # kv_pages (null: as many as the dense cache's memory, max_concurrent_decodes x max length), handed to
    # samples as they grow, so short samples leave room for more in flight; dense = one max-length row per slot
    kv_cache: str = "paged"
    page_size: int = 64
    kv_pages: int | None = None
    # a sample preempted when the pool runs out: recompute = prefilled again from its prompt + tokens so far;
    # swap = its KV pages wait in host memory and are copied back (no prefill; host memory of its KV size)
    preemption: str = "recompute"

    @property
    def segment_len(self) -> int:
        return self.global_max_len // self.num_segments


@dataclasses.dataclass
class RolloutCorrectionOptions:
    """verl's algorithm.rollout_correction (rl/rollout_correction.py): IS weights and rejection against the
    train-inference mismatch, with POIS's π_old as the proximal policy; all off by default."""

    rollout_is: str | None = None  # token | sequence | null (off)
    rollout_is_threshold: Any = 2.0  # a float: truncate the weights there (TIS); "lo_hi": zero outside (IcePop)
    rollout_rs: str | None = None  # rejection: comma-separated token_k1..3, seq_{sum,mean}_k1..3, seq_max_k2/k3
    rollout_rs_threshold: Any = None  # one per option (or one for all); k1: "lo_hi" ratio bounds


@dataclasses.dataclass
class AlgorithmOptions:
    is_mode: str = "pois"  # importance sampling under segments (ULORL.md §2)
    mask_mode: str = "dmmpt"  # masking of well-mastered positive tokens (ULORL.md §3)
    tau: float = 0.99  # MPT probability threshold
    sigma: float = 0.2  # DMMPT target entropy
    entropy_mode: str = "sample"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"  # Eq. 10; or any of verl's agg_loss modes
    # verl's policy-loss family (rl/policy_losses.py): vanilla (PPO-clip, UloRL's), gspo, cispo, geo_mean, sapo
    loss_mode: str = "vanilla"
    clip_ratio_c: float | None = 3.0  # dual-clip bound for negative advantages (verl's default); null = off
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor; null = rollout.global_max_len
    tau_pos: float = 1.0  # SAPO gate temperature, positive advantages
    tau_neg: float = 1.05  # SAPO gate temperature, negative advantages
    rollout_correction: RolloutCorrectionOptions = dataclasses.field(default_factory=RolloutCorrectionOptions)
    entropy_coeff: float = 0.0
    norm_adv_by_std: bool = True  # GRPO: divide by the group std
    dynamic_sampling: bool = True  # DAPO: drop all-0 / all-1 groups
    aux_loss_coef: float = 0.0  # MoE load-balancing loss weight


@dataclasses.dataclass
class OptimOptions:
    """AdamW (optax.adamw) with linear warmup then a constant rate."""

    lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # global-norm clip; null = off
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclasses.dataclass
class TrainerOptions:
    train_batch_size: int = 128  # prompts per RL step
    ppo_mini_batch_size: int = 1024  # samples per optimizer update
    ppo_epochs: int = 1
    micro_batch_rows: int = 1  # packed rows per gradient-accumulation micro-batch
    row_len: int | None = None  # tokens per packed row; null = max_prompt_len + global_max_len
    # per-layer recomputation in the backward pass: full (save each layer's input only), dots (also save
    # the weight matmuls), dots_saveable, none; true / false (older configs) mean full / none. Typed Any so
    # that the older booleans load; load_config turns them into the policy name (remat_policy).
    remat: Any = "full"
    # decoder layers as one lax.scan over their stacked weights: compile time independent of depth and
    # one layer's activations live in the backward pass; costs a compute-dtype copy of the layer weights
    scan_layers: bool = False
    logprob_chunk: int = 1024  # positions per chunk of the vocab projection
    total_steps: int = 100
    eval_every: int = 0  # RL steps between held-out evals; 0 = never
    seed: int = 0
    max_consecutive_skips: int = 10  # steps with no trainable group before stopping with an error
    # Steps in a row whose every learner update was skipped for a non-finite loss or gradient
    # (params and optimizer state kept); the run stops with an error when this many are reached.
    max_consecutive_nonfinite: int = 5
    # DAPO dynamic sampling: rollout rounds (fresh prompts, same weights) per step until
    # train_batch_size groups with unequal rewards are ready; 1 = train on what one round gives.
    dynamic_sampling_max_rounds: int = 1
    sft_steps: int = 0  # supervised warm start on noisy synthetic traces; 0 = none
    sft_lr: float = 1e-4
    sft_batch_size: int | None = None  # samples per warm-start step; null = train_batch_size * rollout.n


@dataclasses.dataclass
class OverlongBufferOptions:
    """DAPO's soft overlong punishment, verl's reward_model.overlong_buffer with its defaults (off); added to the
    task reward for the advantages only (rl/reward_shaping.py says how it meets UloRL's truncated = 0 rule)."""

    enable: bool = False
    len: int = 0  # buffer tokens before rollout.global_max_len: the penalty grows linearly over them
    penalty_factor: float = 0.0  # the penalty at rollout.global_max_len (DAPO: 1.0)
    log: bool = False  # log overlong_reward_mean / overlong_fraction


@dataclasses.dataclass
class RewardOptions:
    kind: str = "rule"  # rule (math-verify) | verifier (generative judge) | custom (python function)
    answer_pattern: str | None = None  # regex whose group 1 is the final answer; null = last \boxed{...}
    extraction: str = "boxed"  # kind=rule: boxed (last \boxed{}, the paper's rule) | math_verify (its extraction)
    timeout_s: float = 5.0  # per-sample equivalence check
    workers: int | None = None  # sandbox processes for math-verify / custom_fn; null = the machine's cores (>= 2)
    custom_fn: str | None = None  # "module:function" (kind=custom)
    verifier_model: str | None = None  # model folder (kind=verifier)
    # math-verify's own options, by its names and with its defaults (kind=rule; rewards/equivalence.py):
    # verify(): how two answers are compared
    float_rounding: int = 6  # decimal places floats are rounded to (math-verify's tests: `precision`)
    numeric_precision: int = 15  # significant digits of numeric comparisons
    strict: bool = True  # false: variables matched by position (x+1 = y+1), sets comparable with tuples
    allow_set_relation_comp: bool = False  # true: a relation may equal a set (1 < x < 2 = (1, 2))
    # parse(): how math-verify finds an answer (in the reference, and in the response or its boxed answer)
    extraction_config: list[str] = dataclasses.field(default_factory=lambda: ["latex", "expr"])  # | string
    boxed_match_priority: int = 50  # latex: 0 = \boxed{} before "final answer is" anchors, -1 = off
    try_extract_without_anchor: bool = True  # false: only after "answer" / "final answer is" (or boxed)
    fallback_mode: str = "first_match"  # first_match (keep the first match's string too) | no_fallback
    extraction_mode: str = "any_match"  # any_match (try until one parses) | first_match
    overlong_buffer: OverlongBufferOptions = dataclasses.field(default_factory=OverlongBufferOptions)


@dataclasses.dataclass
class EvalOptions:
    k: int = 32  # avg@k
    temperature: float = 0.85
    top_k: int = 20
    top_p: float = 0.95
    max_new_tokens: int | None = None  # null = rollout.global_max_len


@dataclasses.dataclass
class CheckpointOptions:
    save_every: int = 50  # RL steps; 0 = only at the end
    keep_last: int = 3
    async_save: bool = True
    on_save_error: str = "stop"  # stop | continue (log and keep training)


@dataclasses.dataclass
class LoggingOptions:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "ulorl"
    log_every: int = 1


@dataclasses.dataclass
class RunConfig:
    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    mesh: MeshOptions = dataclasses.field(default_factory=MeshOptions)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    rollout: RolloutOptions = dataclasses.field(default_factory=RolloutOptions)
    algorithm: AlgorithmOptions = dataclasses.field(default_factory=AlgorithmOptions)
    optim: OptimOptions = dataclasses.field(default_factory=OptimOptions)
    trainer: TrainerOptions = dataclasses.field(default_factory=TrainerOptions)
    reward: RewardOptions = dataclasses.field(default_factory=RewardOptions)
    eval: EvalOptions = dataclasses.field(default_factory=EvalOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    logging: LoggingOptions = dataclasses.field(default_factory=LoggingOptions)


# --- the schema as dotted keys -------------------------------------------------------------


def _schema(cls=RunConfig, prefix: str = "") -> dict[str, str]:
    """Every leaf key of the schema -> its type, as written in the dataclass ('float', 'int | None')."""
    hints = typing.get_type_hints(cls)
    out: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        if dataclasses.is_dataclass(hints[field.name]):
            out.update(_schema(hints[field.name], key + "."))
        else:
            out[key] = field.type if isinstance(field.type, str) else str(field.type)
    return out


SCHEMA: dict[str, str] = _schema()
_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
# Groups of options nested inside a section (algorithm.rollout_correction, reward.overlong_buffer)
_SUBSECTIONS = tuple(sorted({key.rsplit(".", 1)[0] for key in SCHEMA if key.count(".") > 1}))
# Options whose value is a free-form dict (model.arch, data.chat_template_kwargs, ...): keys below them are not
# schema keys, and `option.key=value` overrides set one of their entries.
_DICT_KEYS = tuple(key for key, kind in SCHEMA.items() if kind.startswith("dict"))
_MODEL_DICT_KEYS = ("model.arch", "model.overrides")  # entries checked against ModelConfig's fields


def _closest_key(key: str, candidates) -> str:
    """The most similar valid key: same section first, then by leaf name anywhere, then overall."""
    candidates = list(candidates)
    parent, _, leaf = key.rpartition(".")
    siblings = [c for c in candidates if c.rpartition(".")[0] == parent]
    for pool, query, strip in ((siblings, leaf, True), (candidates, leaf, True), (candidates, key, False)):
        names = [c.rpartition(".")[2] if strip else c for c in pool]
        match = difflib.get_close_matches(query, names, n=1, cutoff=0.6)
        if match:
            return pool[names.index(match[0])]
    scored = sorted(candidates, key=lambda c: -difflib.SequenceMatcher(None, key, c).ratio())
    return scored[0]


def _unknown(key: str, candidates, where: str) -> ConfigError:
    return ConfigError(f"unknown option {key!r}{where}; the closest valid key is {_closest_key(key, candidates)!r}")


def _check_keys(tree: Any, where: str, prefix: str = "") -> None:
    """Every key of a (YAML) mapping must be in the schema; dict-valued options are free below."""
    if not isinstance(tree, dict):
        if prefix == "":
            raise ConfigError(f"{where.strip(' ()') or 'config'}: expected a mapping of sections, got {tree!r}")
        return
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if not isinstance(name, str):
            raise ConfigError(f"option name {key!r}{where} is not a string")
        if key in SCHEMA:
            if key in _MODEL_DICT_KEYS:
                _check_model_fields(key, value)
            if key in _DICT_KEYS:
                _check_colon_keys(key, value, where)
            continue
        if key in _SECTIONS or key in _SUBSECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"section {key!r}{where} must be a mapping of options, got {value!r}")
            _check_keys(value, where, key + ".")
            continue
        raise _unknown(key, list(SCHEMA) + list(_SECTIONS), where)


def _check_model_fields(key: str, value: Any) -> None:
    if not isinstance(value, dict):
        return  # None, or a type error OmegaConf reports
    valid = [f for f in ModelConfig.field_names() if f not in _RUNTIME_MODEL_FIELDS]
    for name in value:
        if name in _RUNTIME_MODEL_FIELDS:
            raise ConfigError(f"{key}.{name}: set model.{name} instead (a runtime choice, not architecture)")
        if name not in valid:
            raise _unknown(f"{key}.{name}", [f"{key}.{v}" for v in valid], "")


# --- loading -------------------------------------------------------------------------------


def shipped_configs() -> list[str]:
    """Names of the YAMLs shipped in ulorl_jax.configs (e.g. 'tiny_cpu')."""
    root = importlib.resources.files("ulorl_jax.configs")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _read_yaml(path: str) -> tuple[dict, str]:
    """Text of a YAML file, or of a shipped config given by bare name; returns (mapping, description)."""
    file = Path(path)
    if file.is_file():
        text, where = file.read_text(), str(file)
    elif not any(sep in path for sep in ("/", "\\")) and path.removesuffix(".yaml") in shipped_configs():
        name = path.removesuffix(".yaml")
        text = importlib.resources.files("ulorl_jax.configs").joinpath(name + ".yaml").read_text()
        where = f"shipped config {name}"
    else:
        raise ConfigError(f"config file {path!r} not found (shipped configs: {', '.join(shipped_configs())})")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from None
    return (data or {}), where


def _check_colon_keys(key: str, value: Any, where: str, override: str | None = None) -> None:
    """Refuse `{a:1}` in a free-form mapping: YAML reads it as the key 'a:1' with no value (a flow mapping needs
    a space after the colon), which no option means."""
    if not isinstance(value, dict):
        return
    for name, entry in value.items():
        if isinstance(name, str) and ":" in name and entry is None:
            head, _, tail = name.partition(":")
            head, tail = head.strip(), tail.strip()
            fix = (f"{key}={{{head}: {tail}}}, or {key}.{head}={tail}" if override is not None
                   else f"{key.rpartition('.')[2]}: {{{head}: {tail}}}")
            raise ConfigError(f"{key}{where}: the entry {name!r} has no value: YAML reads a colon without a space "
                              f"after it as part of the key. Write {fix}")
        _check_colon_keys(f"{key}.{name}", entry, where, override)


def _parse_override(item: str) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. algorithm.sigma=0.3)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key in _SECTIONS:
        example = next(k for k in SCHEMA if k.startswith(key + "."))
        raise ConfigError(f"override {item!r}: {key!r} is a section; set one of its keys, e.g. {example}=...")
    if key not in SCHEMA:
        head = next((d for d in _DICT_KEYS if key.startswith(d + ".")), None)
        if head is None:
            raise _unknown(key, list(SCHEMA), " in overrides")
        if head in _MODEL_DICT_KEYS:
            _check_model_fields(head, {key[len(head) + 1:].split(".")[0]: None})
    if (key in _DICT_KEYS or key not in SCHEMA) and "{" in raw:  # a mapping value: YAML's flow-mapping pitfall
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = None  # the merge reports it
        _check_colon_keys(key, value, " (in overrides)", override=item)
    return key, raw


# What a merge raises on a bad value: OmegaConf's own errors, and (OmegaConf >= 2.4) a plain TypeError when a
# list meets a mapping ("Cannot merge incompatible container types").
_MERGE_ERRORS = (OmegaConfBaseException, TypeError)


def _omegaconf_error(err: Exception, given: dict[str, Any], where: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if key not in SCHEMA and len(given) == 1:  # e.g. a tuple length error carries no key
        key = next(iter(given))
    msg = str(err).splitlines()[0] if str(err) else type(err).__name__
    if key in SCHEMA:
        value = given.get(key, getattr(err, "value", None))
        return ConfigError(f"{key}={value!r}{where}: expected {SCHEMA[key]} ({msg})")
    if key and key not in SCHEMA and isinstance(err, KeyError):
        return _unknown(key, list(SCHEMA), where)
    return ConfigError(f"{key or 'config'}{where}: {msg}")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    if isinstance(tree, dict):
        for name, value in tree.items():
            key = f"{prefix}{name}"
            if key in SCHEMA or not isinstance(value, dict):
                out[key] = value
            else:
                out.update(_flatten(value, key + "."))
    return out


@functools.lru_cache(maxsize=1)
def _schema_node():
    """The structured schema node (merges copy it, so one instance serves every load)."""
    return OmegaConf.structured(RunConfig)


def _merge_override(merged, key: str, raw: str):
    try:
        return OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={raw}"]))
    except _MERGE_ERRORS as err:
        raise _omegaconf_error(err, {key: raw}, " (in overrides)") from None
    except yaml.YAMLError as err:  # OmegaConf parses the value as YAML
        raise ConfigError(f"override {key}={raw!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None


def _file_error(merged, err: Exception, given: dict[str, Any], where: str) -> ConfigError:
    """The error of a failed file merge, naming its key: merged key by key when the error does not say."""
    if getattr(err, "full_key", None) or len(given) == 1:
        return _omegaconf_error(err, given, where)
    for key, value in given.items():
        try:
            OmegaConf.merge(merged, OmegaConf.create(_nest(key, value)))
        except _MERGE_ERRORS as one:
            return _omegaconf_error(one, {key: value}, where)
    return _omegaconf_error(err, given, where)


def _nest(key: str, value: Any) -> dict[str, Any]:
    """'a.b.c', v -> {'a': {'b': {'c': v}}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Schema defaults <- YAML file `path` (a file, or a shipped name like 'tiny_cpu') <- `key=value` overrides.

    Raises ConfigError naming the bad key, value and what was expected.
    """
    merged = _schema_node()
    given: dict[str, Any] = {}
    if path is not None:
        data, where = _read_yaml(str(path))
        _check_keys(data, f" (in {where})")
        given.update(_flatten(data))
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        except _MERGE_ERRORS as err:
            raise _file_error(merged, err, _flatten(data), f" (in {where})") from None
    pairs = [_parse_override(item) for item in overrides]
    given.update(pairs)
    if pairs:
        try:  # all at once (OmegaConf merges are slow); one by one only to name a failing override
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{k}={v}" for k, v in pairs]))
        except (*_MERGE_ERRORS, yaml.YAMLError):
            for key, raw in pairs:
                merged = _merge_override(merged, key, raw)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, given, "") from None
    cfg.trainer.remat = remat_policy(cfg.trainer.remat)  # from here on always a name of choices.REMAT
    validate(cfg)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (lists for tuples), loadable again by `load_config`."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# --- cross-field validation ----------------------------------------------------------------


def _require(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def remat_policy(value) -> str:
    """`trainer.remat` as a policy name of `choices.REMAT`: true / false (older configs) are full / none."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in choices.REMAT:
        raise ConfigError(f"trainer.remat={value!r}: expected one of {list(choices.REMAT)}, or true (= full) / "
                          "false (= none)")
    return value


def validate(cfg: RunConfig) -> None:
    """Range and cross-field checks; raises ConfigError naming the key, value and expectation."""
    flat = _flatten(config_to_dict(cfg))
    for key, value in flat.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
    for key in (*CHOICES, *RANGES):  # the bounds of options.py, shared with LearnerConfig
        check_option(key, flat[key])
    resolve_dtype(cfg.model.dtype, option="model.dtype")

    m = cfg.model
    _check_model_fields("model.arch", m.arch)  # again: a whole-dict override skips the per-key check
    _check_model_fields("model.overrides", m.overrides)
    if m.path is None and m.arch is None:
        raise ConfigError("model.path and model.arch are both null: set a checkpoint folder or an architecture")
    if m.path is None:
        try:
            m.model_config()
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"model.arch: {err}") from None

    mesh = cfg.mesh
    sizes = {a: getattr(mesh, a) for a in ("data", "fsdp", "expert", "context", "tensor")}
    for axis, size in sizes.items():
        _require(size >= 1 or size == -1, f"mesh.{axis}", size, "a positive size or -1 (the remaining devices)")
    fill = [a for a, s in sizes.items() if s == -1]
    _require(len(fill) <= 1, "mesh", sizes, f"at most one axis set to -1, got {fill}")

    _require(cfg.rollout.prefill_token_budget >= 1, "rollout.prefill_token_budget", cfg.rollout.prefill_token_budget,
             ">= 1 token")
    d = cfg.data
    _require(0.0 <= d.max_dropped_fraction <= 1.0, "data.max_dropped_fraction", d.max_dropped_fraction,
             "a fraction in [0, 1]")
    if not d.train_files and d.synthetic is None:
        raise ConfigError("data.train_files is empty and data.synthetic is null: give training data")
    _require(d.max_prompt_len is None or d.max_prompt_len >= 1, "data.max_prompt_len", d.max_prompt_len,
             "a positive token count or null")
    if d.extra_keys:
        from ulorl_jax.data.prompts import RESERVED_METADATA_KEYS

        reserved = sorted(set(d.extra_keys) & set(RESERVED_METADATA_KEYS))
        _require(not reserved, "data.extra_keys", d.extra_keys,
                 f"row keys other than the metadata keys ulorl sets itself ({', '.join(RESERVED_METADATA_KEYS)}; "
                 f"got {reserved}): rename the field in the data")

    r = cfg.rollout
    _require(r.global_max_len >= 1, "rollout.global_max_len", r.global_max_len, "a positive token count")
    _require(r.num_segments >= 1, "rollout.num_segments", r.num_segments, ">= 1")
    _require(r.global_max_len % r.num_segments == 0, "rollout.num_segments", r.num_segments,
             f"a divisor of rollout.global_max_len={r.global_max_len}")
    from ulorl_jax.rl.rollout_correction import (
        check_rollout_correction,  # ulorl_jax.rl imports this module
    )

    rc = cfg.algorithm.rollout_correction
    check_rollout_correction(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold,
                             is_mode=cfg.algorithm.is_mode, loss_mode=cfg.algorithm.loss_mode)
    ob = cfg.reward.overlong_buffer
    if ob.enable:  # DAPO: the buffer is the last `len` tokens before the max response length
        _require(0 < ob.len <= r.global_max_len, "reward.overlong_buffer.len", ob.len,
                 f"1 .. rollout.global_max_len={r.global_max_len} with reward.overlong_buffer.enable")
    _require(r.n >= 2, "rollout.n", r.n, ">= 2 samples per prompt (GRPO normalises within each group)")
    _require(r.top_k >= 0, "rollout.top_k", r.top_k, ">= 0 (0 = off)")
    _require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "a value in (0, 1]")
    _require(r.max_concurrent_decodes is None or r.max_concurrent_decodes >= 1, "rollout.max_concurrent_decodes",
             r.max_concurrent_decodes, ">= 1 or null")
    if r.prefill_buckets is not None:
        b = r.prefill_buckets
        _require(len(b) > 0 and all(x >= 1 for x in b) and list(b) == sorted(set(b)), "rollout.prefill_buckets", b,
                 "a non-empty, strictly increasing list of positive lengths, or null")

    t = cfg.trainer
    for name in ("train_batch_size", "ppo_mini_batch_size", "max_consecutive_skips", "max_consecutive_nonfinite",
                 "dynamic_sampling_max_rounds"):  # ppo_mini_batch_size: an int here, never null
        _require(getattr(t, name) >= 1, f"trainer.{name}", getattr(t, name), ">= 1")
    for name in ("total_steps", "eval_every", "sft_steps"):
        _require(getattr(t, name) >= 0, f"trainer.{name}", getattr(t, name), ">= 0")
    _require(t.sft_lr > 0, "trainer.sft_lr", t.sft_lr, "> 0")
    _require(t.sft_batch_size is None or t.sft_batch_size >= 1, "trainer.sft_batch_size", t.sft_batch_size,
             ">= 1 or null")
    if -1 not in (mesh.data, mesh.fsdp, mesh.expert):  # else the Learner checks it once devices are known
        shards = mesh.data * mesh.fsdp * mesh.expert  # sharding.BATCH_AXES: packed rows are split over these
        _require(t.micro_batch_rows % shards == 0, "trainer.micro_batch_rows", t.micro_batch_rows,
                 f"a multiple of mesh.data * mesh.fsdp * mesh.expert = {mesh.data} * {mesh.fsdp} * {mesh.expert} "
                 f"= {shards} (the batch axes each micro-batch's rows are split over)")
    samples = t.train_batch_size * r.n
    _require(samples % t.ppo_mini_batch_size == 0, "trainer.ppo_mini_batch_size", t.ppo_mini_batch_size,
             f"a divisor of trainer.train_batch_size * rollout.n = {t.train_batch_size} * {r.n} = {samples}")
    if t.row_len is not None:
        longest = (d.max_prompt_len or 0) + r.global_max_len
        _require(t.row_len >= longest, "trainer.row_len", t.row_len,
                 f">= data.max_prompt_len + rollout.global_max_len = {longest} (one sample must fit a row), "
                 "or null")
        if mesh.context > 1:
            _require(t.row_len % (2 * mesh.context) == 0, "trainer.row_len", t.row_len,
                     f"a multiple of 2 x mesh.context = {2 * mesh.context} (context parallelism cuts each row into "
                     f"two chunks per context shard)")

    w = cfg.reward
    _require(w.timeout_s > 0, "reward.timeout_s", w.timeout_s, "> 0 seconds")
    _require(w.workers is None or w.workers >= 0, "reward.workers", w.workers, ">= 0 (0 = in-process) or null")
    if w.answer_pattern is not None:
        try:
            re.compile(w.answer_pattern)
        except re.error as err:
            raise ConfigError(f"reward.answer_pattern={w.answer_pattern!r}: not a valid regex ({err})") from None
    if w.kind == "custom":
        _require(bool(w.custom_fn) and ":" in w.custom_fn, "reward.custom_fn", w.custom_fn,
                 "'module:function' when reward.kind=custom")
    if w.kind == "verifier":
        _require(bool(w.verifier_model), "reward.verifier_model", w.verifier_model,
                 "a model folder when reward.kind=verifier")

    e = cfg.eval
    _require(e.k >= 1, "eval.k", e.k, ">= 1")
    _require(e.temperature >= 0, "eval.temperature", e.temperature, ">= 0")
    _require(e.top_k >= 0, "eval.top_k", e.top_k, ">= 0 (0 = off)")
    _require(0 < e.top_p <= 1, "eval.top_p", e.top_p, "a value in (0, 1]")
    _require(e.max_new_tokens is None or e.max_new_tokens >= 1, "eval.max_new_tokens", e.max_new_tokens,
             ">= 1 or null")

    c = cfg.checkpoint
    _require(c.save_every >= 0, "checkpoint.save_every", c.save_every, ">= 0 (0 = only at the end)")
    _require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, ">= 1")
    _require(cfg.logging.log_every >= 1, "logging.log_every", cfg.logging.log_every, ">= 1")
