"""The run's parts from its RunConfig: model, mesh, learner and rollout configs, engine, reward scorer,
sampling, EOS ids.

Shared by the trainer, `ulorl eval` and `ulorl plan` (the tokenizer: `model_source.build_tokenizer`). A part's
config takes the options of the same name from its YAML section (`same_named`), so an option is never
copied field by field; only what is derived from several options is computed here."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from ulorl_jax.config import RunConfig
from ulorl_jax.decode.engine import PolicyEngine
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.model_source import eos_token_ids
from ulorl_jax.rewards.scorer import RewardConfig, RewardScorer
from ulorl_jax.rl.learner import OPTION_SECTIONS, LearnerConfig
from ulorl_jax.rollout.segment import RolloutConfig
from ulorl_jax.sharding import MeshConfig, make_mesh


def same_named(cls, section: Any, **derived: Any):
    """`cls` (a dataclass) built from the fields of the config `section` that have its field names, and
    `derived` for the rest (a derived value wins over a same-named option)."""
    taken = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)
             if f.init and f.name not in derived and hasattr(section, f.name)}
    return cls(**taken, **derived)


def build_model(cfg: RunConfig, tokenizer, seed: int):
    from ulorl_jax.models import init_model
    from ulorl_jax.models.native import load_any

    if cfg.model.path is None:
        model_config = cfg.model.model_config()
        model = init_model(model_config, seed=seed)
    else:
        loaded = load_any(cfg.model.path, dtype=cfg.model.param_dtype)
        model_config = cfg.model.model_config(loaded.config)
        if model_config != loaded.config:
            from flax import nnx

            graphdef, state = nnx.split(loaded)
            model = nnx.merge(graphdef, state)
            model.config = model_config
        else:
            model = loaded
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but model vocab_size={model.config.vocab_size}")
    return model


def build_mesh(cfg: RunConfig):
    """The learner's mesh; with no -1 axis it may use fewer devices than the host has (the first ones)."""
    m = cfg.mesh
    sizes = dict(data=m.data, fsdp=m.fsdp, expert=m.expert, context=m.context, tensor=m.tensor)
    devices = jax.devices()
    if -1 not in sizes.values():
        need = int(np.prod(list(sizes.values())))
        if need > len(devices):
            raise ValueError(f"mesh {sizes} needs {need} devices, {len(devices)} available")
        devices = devices[:need]
    return make_mesh(same_named(MeshConfig, m), devices=devices)


def learner_config(cfg: RunConfig) -> LearnerConfig:
    """The learner's options, taken by name from the run config's sections (`learner.OPTION_SECTIONS`); only
    what is derived is computed here: the row length when `trainer.row_len` is null (rounded up to a multiple
    of 2 x mesh.context under context parallelism) and the temperature
    log-probs are scored at (1.0 for greedy rollouts)."""
    values = {name: getattr(functools.reduce(getattr, section.split("."), cfg), name)
              for section, names in OPTION_SECTIONS.items() for name in names}
    r = cfg.rollout
    if not values["row_len"]:  # derived: a multiple of the 2 x mesh.context chunks context parallelism cuts
        longest, chunks = (cfg.data.max_prompt_len or 0) + r.global_max_len, 2 * max(cfg.mesh.context, 1)
        values["row_len"] = longest if cfg.mesh.context == 1 else -(-longest // chunks) * chunks
    if values["loss_scale_factor"] is None:  # derived: verl's default, the (padded) response length
        values["loss_scale_factor"] = float(r.global_max_len)
    return LearnerConfig(**values, temperature=r.temperature if r.temperature > 0 else 1.0)


def rollout_config(cfg: RunConfig, model, tokenizer, max_prompt_len: int) -> RolloutConfig:
    """Segment rollout's options: `rollout.global_max_len` / `num_segments` by name, the group size from
    `rollout.n`, the sampling from `rollout.temperature` / `top_k` / `top_p`."""
    return same_named(RolloutConfig, cfg.rollout, samples_per_prompt=cfg.rollout.n, max_prompt_len=max_prompt_len,
                      eos_token_ids=eos_ids(model.config, tokenizer), sampling=sampling_params(cfg))


def build_engine(cfg: RunConfig, model, tokenizer, *, slots: int, max_len: int, sampling: SamplingParams,
                 mesh=None) -> PolicyEngine:
    """The decode engine of the trainer and `ulorl eval`: `slots` samples in flight, prompts + outputs up to
    `max_len` tokens, prefill cut by `rollout.prefill_buckets` / `prefill_token_budget`, a prefill row shared
    by a group's `rollout.n` samples."""
    r = cfg.rollout
    return PolicyEngine(model, max_concurrent_decodes=slots, max_prefill_length=max_len, max_cache_len=max_len,
                        prefill_buckets=r.prefill_buckets, prefill_token_budget=r.prefill_token_budget,
                        sampling=sampling, eos_token_ids=eos_ids(model.config, tokenizer), tokenizer=tokenizer,
                        mesh=mesh, kv_cache=r.kv_cache, page_size=r.page_size, num_pages=r.kv_pages,
                        preemption=r.preemption, prefill_fanout=r.n)


def build_scorer(cfg: RunConfig) -> RewardScorer:
    return RewardScorer(same_named(RewardConfig, cfg.reward))


def sampling_params(cfg: RunConfig) -> SamplingParams:
    return same_named(SamplingParams, cfg.rollout)


def eval_sampling_params(cfg: RunConfig) -> SamplingParams:
    return same_named(SamplingParams, cfg.eval)


def eos_ids(model_config, tokenizer) -> tuple[int, ...]:
    """The ids that end a sample (`model_source.eos_token_ids`: the model config's and the tokenizer's, as
    `ulorl generate` and `ulorl serve` use); a run cannot go on without one."""
    ids = eos_token_ids(model_config, tokenizer)
    if not ids:
        raise ValueError("neither the tokenizer nor the model config has an eos_token_id; the rollout needs one "
                         "to end samples")
    return ids
