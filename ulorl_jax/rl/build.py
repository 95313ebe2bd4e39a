"""The run's parts from its RunConfig: model, mesh, learner config, reward scorer, sampling, EOS ids.

Shared by the trainer, `ulorl eval` and `ulorl plan` (the tokenizer: `model_source.build_tokenizer`)."""

from __future__ import annotations

import jax
import numpy as np

from ulorl_jax.config import RunConfig, remat_policy
from ulorl_jax.decode.sampling import SamplingParams
from ulorl_jax.rewards.scorer import RewardConfig, RewardScorer
from ulorl_jax.rl.learner import LearnerConfig
from ulorl_jax.sharding import MeshConfig, make_mesh


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
    sizes = (m.data, m.fsdp, m.expert, m.tensor)
    devices = jax.devices()
    if -1 not in sizes:
        need = int(np.prod(sizes))
        if need > len(devices):
            raise ValueError(f"mesh {dict(data=m.data, fsdp=m.fsdp, expert=m.expert, tensor=m.tensor)} needs "
                             f"{need} devices, {len(devices)} available")
        devices = devices[:need]
    return make_mesh(MeshConfig(data=m.data, fsdp=m.fsdp, expert=m.expert, tensor=m.tensor), devices=devices)


def learner_config(cfg: RunConfig) -> LearnerConfig:
    a, o, t, r = cfg.algorithm, cfg.optim, cfg.trainer, cfg.rollout
    row_len = t.row_len or (cfg.data.max_prompt_len or 0) + r.global_max_len
    return LearnerConfig(
        is_mode=a.is_mode, mask_mode=a.mask_mode, tau=a.tau, sigma=a.sigma, entropy_mode=a.entropy_mode,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, loss_agg_mode=a.loss_agg_mode,
        entropy_coeff=a.entropy_coeff, aux_loss_coef=a.aux_loss_coef,
        lr=o.lr, warmup_steps=o.warmup_steps, weight_decay=o.weight_decay, adam_b1=o.betas[0],
        adam_b2=o.betas[1], adam_eps=o.eps, grad_clip=o.grad_clip or 0.0,
        ppo_mini_batch_size=t.ppo_mini_batch_size, ppo_epochs=t.ppo_epochs, micro_batch_rows=t.micro_batch_rows,
        row_len=row_len, remat=remat_policy(t.remat), scan_layers=t.scan_layers,
        logprob_chunk=t.logprob_chunk,
        temperature=r.temperature if r.temperature > 0 else 1.0)


def build_scorer(cfg: RunConfig) -> RewardScorer:
    r = cfg.reward
    return RewardScorer(RewardConfig(kind=r.kind, answer_pattern=r.answer_pattern, timeout_s=r.timeout_s,
                                     custom_fn=r.custom_fn, workers=r.workers, extraction=r.extraction))


def sampling_params(cfg: RunConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


def eval_sampling_params(cfg: RunConfig) -> SamplingParams:
    e = cfg.eval
    return SamplingParams(temperature=e.temperature, top_k=e.top_k, top_p=e.top_p)


def eos_ids(tokenizer) -> tuple[int, ...]:
    ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; the rollout needs one to end samples")
    return tuple(int(i) for i in ids)
