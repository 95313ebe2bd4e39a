"""UloRL learner: the jitted, sharded train step and the `Learner` that drives it.

One optimizer update (`train_step`) is a pure function
  (params, opt_state, packed mini-batch) -> (params, opt_state, metrics)
jitted once with explicit in/out shardings over the mesh (FSDP + expert
parallel, tensor parallel optional) and donated state. Inside it:

- the mini-batch arrives as packed rows [M, r, L] (M micro-batches of r rows,
  `ulorl_jax.rl.packing`); `lax.scan` walks the micro-batches and sums their
  gradients (the per-token loss weights are global, so the sum *is* the
  mini-batch gradient); all-padding micro-batches (shape buckets) are skipped
  with `lax.cond`;
- each micro-batch runs the policy with per-layer remat (`remat`), then the
  chunked log-prob / entropy of `ulorl_jax.models.logprobs` (never [r, L, V] at
  once), the per-sample entropy H̄_i as a segment reduction over packed
  samples, and the Eq. 10 loss with the DMMPT mask (`weighted_policy_loss`);
- optax AdamW with optional warmup and global-norm clipping; if the loss or
  the gradient norm is non-finite, the old params / opt_state are kept
  (a `jnp.where` select) and `skipped` = 1.

π_old (ULORL.md §2): POIS uses the policy at the start of `Learner.update`.
With one optimizer update per call (the paper's setting: mini-batch = whole
batch) that is the very policy of the step, so π_old = stop_gradient(log p)
in-step and r == 1 exactly, with no extra forward pass. With several updates
(mini-batches or epochs) a forward-only scoring pass computes π_old once, at
the start, for all of them. SAIS uses the rollout's recorded log-probs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ulorl_jax import choices
from ulorl_jax.models.attention import ATTENTION_LSE, ATTENTION_OUT
from ulorl_jax.models.config import ConfigError
from ulorl_jax.models.context_layout import check_row_len, to_layout
from ulorl_jax.models.logprobs import chunked_logprobs_and_entropy
from ulorl_jax.options import CHOICES, RANGES, check_option
from ulorl_jax.rl.losses import (
    logprob_mismatch_sums,
    weighted_policy_loss,
)
from ulorl_jax.rl.packing import (
    PackedBatch,
    TrainSample,
    loss_weights,
    pack_samples,
    validate_samples,
)
from ulorl_jax.rl.policy_losses import (
    Segments,
    aggregation_weights,
    check_policy_loss_options,
    sample_mean,
)
from ulorl_jax.rl.rollout_correction import (
    check_rollout_correction,
    correct_loss_weights,
)
from ulorl_jax.sharding import (
    BATCH_AXES,
    CONTEXT_AXIS,
    MeshConfig,
    MeshError,
    axis_size,
    constrain_tokens,
    context_size,
    make_mesh,
    mesh_context,
    param_shardings,
)

log = logging.getLogger(__name__)

__all__ = [
    "REMAT_POLICIES",
    "Learner",
    "LearnerConfig",
    "TrainSample",
    "build_grad_fn",
    "build_score_fn",
    "build_train_step",
    "make_optimizer",
    "policy_forward",
]

REMAT_POLICIES: dict[str, Any] = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # per layer: save only the layer input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # save weight matmuls, recompute the rest
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    # per layer: the layer input, the attention output and its log-sum-exp; the backward reruns the layer's
    # O(T) matmuls but not the O(T^2) attention forward
    "attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE),
}
assert tuple(REMAT_POLICIES) == choices.REMAT, "choices.REMAT names the policies"


# Which section of the run config each LearnerConfig field is (same name there): `build.learner_config`
# takes them by name, and a bad value gets the same check (options.py) and message as in a YAML.
OPTION_SECTIONS: dict[str, tuple[str, ...]] = {
    "algorithm": ("is_mode", "mask_mode", "tau", "sigma", "entropy_mode", "clip_ratio_low", "clip_ratio_high",
                  "loss_agg_mode", "entropy_coeff", "aux_loss_coef", "loss_mode", "clip_ratio_c",
                  "loss_scale_factor", "tau_pos", "tau_neg"),
    "algorithm.rollout_correction": ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold"),
    "optim": ("lr", "warmup_steps", "weight_decay", "betas", "eps", "grad_clip"),
    "trainer": ("ppo_mini_batch_size", "ppo_epochs", "micro_batch_rows", "row_len", "remat", "scan_layers",
                "logprob_chunk"),
}


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Learner options: the run config's `algorithm`, `optim` and `trainer` fields of the same names
    (OPTION_SECTIONS; names follow verl where the concept is the same), plus the rollout temperature."""

    is_mode: str = "pois"  # "pois" | "sais" (ULORL.md §2)
    mask_mode: str = "dmmpt"  # "none" | "mpt" | "dmmpt" (ULORL.md §3)
    tau: float = 0.99  # MPT probability threshold τ
    sigma: float = 0.2  # DMMPT entropy target σ
    entropy_mode: str = "sample"  # H̄_i per sample (paper) or one batch mean
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"  # Eq. 10; or any of verl's agg_loss modes (choices.LOSS_AGG_MODES)
    entropy_coeff: float = 0.0  # entropy bonus (loss −= coeff · entropy)
    aux_loss_coef: float = 0.0  # MoE router load-balancing loss weight
    loss_mode: str = "vanilla"  # verl's policy_loss.loss_mode (rl/policy_losses.py)
    clip_ratio_c: float | None = 3.0  # dual-clip bound for negative advantages (vanilla); None = off
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's divisor (the run config: global_max_len)
    tau_pos: float = 1.0  # SAPO gate temperatures
    tau_neg: float = 1.05
    # rollout correction (rl/rollout_correction.py), verl's algorithm.rollout_correction; off by default
    rollout_is: str | None = None  # "token" | "sequence"
    rollout_is_threshold: float | str = 2.0  # truncation bound, or "lo_hi"
    rollout_rs: str | None = None  # e.g. "seq_mean_k3" or "token_k1,seq_max_k2"
    rollout_rs_threshold: float | str | None = None
    lr: float = 1e-6  # constant after warmup, as the paper
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; None = off
    ppo_mini_batch_size: int | None = None  # samples per optimizer update; None = all of them
    ppo_epochs: int = 1
    micro_batch_rows: int = 1  # packed rows per micro-batch (a multiple of the mesh's data shards)
    row_len: int = 2048  # packing row length in tokens
    remat: str = "full"  # see REMAT_POLICIES
    scan_layers: bool = False  # decoder layers as one lax.scan (compile time independent of depth)
    logprob_chunk: int = 1024  # sequence chunk of the log-prob / entropy scan
    temperature: float = 1.0  # rollout temperature; log-probs are recomputed at it

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        for section, names in OPTION_SECTIONS.items():
            for name in names:
                if f"{section}.{name}" in CHOICES or f"{section}.{name}" in RANGES:
                    check_option(f"{section}.{name}", getattr(self, name))
        if self.row_len is None:
            raise ConfigError("trainer.row_len=None: the learner needs a row length (the run config derives it "
                              "from data.max_prompt_len + rollout.global_max_len)")
        check_policy_loss_options(self.loss_mode, self.loss_agg_mode, self.loss_scale_factor)
        check_rollout_correction(self.rollout_is, self.rollout_is_threshold, self.rollout_rs, self.rollout_rs_threshold,
                                 is_mode=self.is_mode, loss_mode=self.loss_mode)
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ConfigError(f"rollout.temperature={self.temperature!r}: the learner needs > 0 (greedy rollouts: "
                              "score at 1.0)")

    @classmethod
    def from_dict(cls, d: dict) -> LearnerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown learner option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def make_optimizer(config: LearnerConfig) -> optax.GradientTransformation:
    """AdamW, constant lr after a linear warmup, global-norm clipping first."""
    lr = optax.warmup_constant_schedule(0.0, config.lr, config.warmup_steps) if config.warmup_steps else config.lr
    adamw = optax.adamw(lr, b1=config.betas[0], b2=config.betas[1], eps=config.eps,
                        weight_decay=config.weight_decay)
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw) if config.grad_clip else adamw


# ---------------------------------------------------------------------------
# Forward pass with per-layer remat
# ---------------------------------------------------------------------------


def policy_forward(model, tokens: jnp.ndarray, positions: jnp.ndarray, segment_ids: jnp.ndarray, *,
                   remat: str = "none", scan: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Packed rows -> (hidden [B, T, D] after the final norm, MoE aux loss): the model's own
    `forward(compute_logits=False)` with the named remat policy (REMAT_POLICIES) and optional
    scanned layers."""
    out = model.forward(tokens, positions=positions, segment_ids=segment_ids, compute_logits=False,
                        remat_policy=REMAT_POLICIES[remat], scan=scan)
    return out.hidden, out.aux_loss


def _token_scores(model, mb: dict, config: LearnerConfig) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One micro-batch -> (log p(target) [r, L], entropy [r, L], aux loss)."""
    hidden, aux = policy_forward(model, mb["tokens"], mb["positions"], mb["segment_ids"], remat=config.remat,
                                 scan=config.scan_layers)
    targets = mb["targets"]
    r, row_len = targets.shape
    context = context_size()
    if context > 1:
        # Rows split over `context`: score each shard's slice of a row as a row of its own, so the chunked
        # scan below walks local tokens (a scan over the sharded token axis would gather it whole).
        hidden = constrain_tokens(hidden.reshape(r * context, row_len // context, -1))
        targets = constrain_tokens(targets.reshape(r * context, row_len // context))
    logp, entropy = chunked_logprobs_and_entropy(
        hidden, model.lm_head_weight(), targets, chunk_size=config.logprob_chunk,
        compute_dtype=hidden.dtype, temperature=config.temperature)
    return logp.reshape(r, row_len), entropy.reshape(r, row_len), aux


# ---------------------------------------------------------------------------
# The train step
# ---------------------------------------------------------------------------

SUM_METRICS = ("tokens", "masked_tokens", "mpt_tokens", "clip_low_tokens", "clip_high_tokens", "ratio_sum",
               "entropy_sum", "real_tokens", "mismatch_abs_sum", "mismatch_tokens", "pg_loss", "entropy_term",
               "aux_loss", "nll_sum", "pg_clip_tokens", "pg_clip_lower_tokens", "ppo_kl_sum")
MAX_METRICS = ("ratio_max", "mismatch_abs_max")


def _micro_loss(params, graphdef, other, mb: dict, scalars: dict, config: LearnerConfig, objective: str):
    """Loss of one micro-batch (already globally weighted) and its metric sums."""
    model = nnx.merge(graphdef, params, other)
    logp, entropy, aux = _token_scores(model, mb, config)  # [r, L] each
    m = mb["response_mask"]
    w = mb["loss_weight"]
    resp = m > 0
    ent_sg = jax.lax.stop_gradient(entropy)
    logp_sg = jax.lax.stop_gradient(logp)
    sums = {
        "tokens": jnp.sum(m),
        "entropy_sum": jnp.sum(jnp.where(resp, ent_sg, 0.0)),
        "real_tokens": jnp.sum((mb["segment_ids"] > 0).astype(jnp.float32)),
        **logprob_mismatch_sums(mb["rollout_logprobs"], logp_sg, mb["has_rollout_logprobs"] * m),
        "nll_sum": jnp.sum(jnp.where(resp, -logp_sg, 0.0)),
        "aux_loss": jax.lax.stop_gradient(aux) * scalars["aux_scale"],
    }
    if objective == "sft":  # token-mean NLL of the response tokens
        loss = jnp.sum(jnp.where(resp, -logp * w, 0.0))
        sums["pg_loss"] = jax.lax.stop_gradient(loss)
    else:
        # H̄_i of each token's sample: a segment sum over the packed samples (a
        # sample lives in one row, hence in one micro-batch); gspo / geo_mean take their sequence means so.
        segments = Segments(mb["sample_index"], scalars["sample_lengths"])
        token_entropy = sample_mean(ent_sg, resp, segments) if config.entropy_mode == "sample" else (
            jnp.broadcast_to(scalars["batch_entropy"], resp.shape))
        if config.loss_mode == "geo_mean":  # one loss per sample, averaged over samples (verl: torch.mean)
            w = aggregation_weights(resp, segments, "seq-mean-token-mean")
        elif config.loss_agg_mode == "seq-mean-token-sum-norm":  # `pack` leaves the constant divisor to here
            w = w / config.loss_scale_factor
        old = jnp.where(scalars["old_from_current"], logp_sg, mb["old_logprobs"])
        loss, loss_sums = weighted_policy_loss(
            logp, old, mb["advantages"], m, w, mb["rewards"], token_entropy,
            clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high, mask_mode=config.mask_mode,
            tau=config.tau, sigma=config.sigma, loss_mode=config.loss_mode, clip_ratio_c=config.clip_ratio_c,
            tau_pos=config.tau_pos, tau_neg=config.tau_neg, segments=segments)
        sums.update({k: v for k, v in loss_sums.items() if k != "tokens"})
        sums["pg_loss"] = jax.lax.stop_gradient(loss)
        if config.entropy_coeff:
            entropy_term = jnp.sum(jnp.where(resp, w * entropy, 0.0))
            loss = loss - config.entropy_coeff * entropy_term
            sums["entropy_term"] = jax.lax.stop_gradient(entropy_term)
    if config.aux_loss_coef:
        loss = loss + config.aux_loss_coef * aux * scalars["aux_scale"]
    return loss, {**_zero_sums(), **sums}


def _zero_sums() -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in SUM_METRICS + MAX_METRICS}


def build_train_step(graphdef, other, tx: optax.GradientTransformation, config: LearnerConfig,
                     objective: str = "policy"):
    """The pure step (params, opt_state, batch) -> (params, opt_state, metrics).

    batch: dict of [M, r, L] micro-batched packed arrays (plus "loss_weight",
    "old_logprobs") and the scalars / sample arrays "sample_lengths" [S],
    "batch_entropy" [], "old_from_current" [] bool, "aux_scale" [].
    """
    if objective not in ("policy", "sft"):
        raise ValueError(f"objective={objective!r} is not 'policy' or 'sft'")
    accumulate = build_grad_fn(graphdef, other, config, objective)

    def step(params, opt_state, batch):
        loss, grads, sums = accumulate(params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # numerical safety: keep the old state otherwise
        new_params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_params, params)
        new_opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_opt_state, opt_state)
        metrics = {**sums, "loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.float32)}
        return new_params, new_opt_state, metrics

    return step


def build_grad_fn(graphdef, other, config: LearnerConfig, objective: str = "policy"):
    """(params, batch) -> (loss, grads, metric sums), accumulated over the micro-batches with lax.scan."""
    scalar_keys = ("sample_lengths", "batch_entropy", "old_from_current", "aux_scale")

    def accumulate(params, batch):
        scalars = {k: batch[k] for k in scalar_keys}
        micro = {k: v for k, v in batch.items() if k not in scalar_keys}
        grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
        zero_grads = jax.tree.map(jnp.zeros_like, params)

        def body(carry, mb):
            grads, loss_sum, sums = carry

            def compute(_):
                (loss, s), g = grad_fn(params, graphdef, other, mb, scalars, config, objective)
                return loss, s, g

            def skip(_):  # an all-padding micro-batch of the shape bucket
                return jnp.zeros((), jnp.float32), _zero_sums(), zero_grads

            loss, s, g = jax.lax.cond(jnp.any(mb["segment_ids"] > 0), compute, skip, None)
            grads = jax.tree.map(jnp.add, grads, g)
            sums = {k: jnp.maximum(sums[k], s[k]) if k in MAX_METRICS else sums[k] + s[k] for k in sums}
            return (grads, loss_sum + loss, sums), None

        (grads, loss, sums), _ = jax.lax.scan(body, (zero_grads, jnp.zeros((), jnp.float32), _zero_sums()), micro)
        return loss, grads, sums

    return accumulate


def build_score_fn(graphdef, other, config: LearnerConfig):
    """(params, batch) -> (log p [M, r, L], entropy [M, r, L]): forward only, per micro-batch."""

    forward_only = dataclasses.replace(config, remat="none")  # no backward pass: nothing to rematerialise

    def score(params, batch):
        def one(mb):
            model = nnx.merge(graphdef, params, other)  # inside the map's trace (nnx state is trace-bound)
            logp, entropy, _ = _token_scores(model, mb, forward_only)
            return logp, entropy

        return jax.lax.map(one, {k: batch[k] for k in ("tokens", "targets", "positions", "segment_ids")})

    return score


# ---------------------------------------------------------------------------
# Learner: the stateful edge
# ---------------------------------------------------------------------------

MICRO_KEYS = ("tokens", "targets", "segment_ids", "positions", "response_mask", "advantages", "rewards",
              "rollout_logprobs", "has_rollout_logprobs", "sample_index", "loss_weight", "old_logprobs")


def optimizer_shardings(tx, params, param_sh, mesh: Mesh):
    """Shardings of `tx`'s state for `params`: moments laid out as their params (`param_sh`), the rest
    (step counts) replicated."""
    abstract = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, s: s, abstract, param_sh, transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))


class Learner:
    """Owns the policy params and optimizer state; `update(samples)` trains on them.

    model: a Qwen3ForCausalLM (its weights are copied onto `mesh`);
    mesh: a `jax.sharding.Mesh` with axes (data, fsdp, expert, tensor), or
    None for one device.
    """

    def __init__(self, model, config: LearnerConfig, mesh: Mesh | None = None):
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(MeshConfig(), devices=jax.devices()[:1])
        self._batch_shards = axis_size(self.mesh, BATCH_AXES)
        if config.micro_batch_rows % self._batch_shards:
            raise MeshError(f"learner.micro_batch_rows={config.micro_batch_rows} must be a multiple of the mesh's "
                            f"{self._batch_shards} data shards (axes {BATCH_AXES})")
        self.context = context_size(self.mesh)  # rows split along their tokens over this many devices
        check_row_len(config.row_len, self.context)
        if self.context > 1 and (config.row_len // self.context) % min(config.logprob_chunk, config.row_len):
            log.info("learner: trainer.logprob_chunk=%d does not divide a context shard's %d tokens per row; "
                     "the last chunk is padded", config.logprob_chunk, config.row_len // self.context)
        self.graphdef, params, self._other = nnx.split(model, nnx.Param, ...)
        self._param_sh = param_shardings(params, self.mesh)
        self._place_params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self._param_sh)
        self.params = self._place_params(params)  # a copy: the step donates it, the caller's model stays valid
        self.tx = make_optimizer(config)
        self._opt_sh = optimizer_shardings(self.tx, self.params, self._param_sh, self.mesh)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self._opt_sh)(self.params)
        self.step = 0
        self._replicated = NamedSharding(self.mesh, P())
        # [M, r, L]: rows over the data shards, their tokens over `context` (in the load-balanced layout)
        self._micro_sh = NamedSharding(self.mesh, P(None, BATCH_AXES, CONTEXT_AXIS))
        batch_sh = {**{k: self._micro_sh for k in MICRO_KEYS},
                    **{k: self._replicated for k in ("sample_lengths", "batch_entropy", "old_from_current",
                                                     "aux_scale")}}
        self._batch_sh = batch_sh
        # Steps are traced under the mesh context: the MoE experts run expert-parallel on it (models/moe_parallel.py).
        jit_step = lambda fn: jax.jit(mesh_context(fn, self.mesh),  # noqa: E731
                                      in_shardings=(self._param_sh, self._opt_sh, batch_sh),
                                      out_shardings=(self._param_sh, self._opt_sh, self._replicated),
                                      donate_argnums=(0, 1))
        self._train_step = jit_step(build_train_step(self.graphdef, self._other, self.tx, config, "policy"))
        self._sft_step = jit_step(build_train_step(self.graphdef, self._other, self.tx, config, "sft"))
        self._grad_fn = None
        self._score = jax.jit(mesh_context(build_score_fn(self.graphdef, self._other, config), self.mesh),
                              in_shardings=(self._param_sh, {k: self._micro_sh for k in
                                                             ("tokens", "targets", "positions", "segment_ids")}),
                              out_shardings=self._micro_sh)

    # -- views ------------------------------------------------------------------------

    @property
    def model(self):
        """An nnx model view of the current params (for save_pretrained / the engine)."""
        return nnx.merge(self.graphdef, self.params, self._other)

    def state_dict(self) -> dict:
        """{params, opt_state, step}. The arrays are the live ones, donated by the next update:
        save (or copy) them before calling `update` again."""
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step}

    def load_state_dict(self, d: dict) -> None:
        """Restore {params, opt_state, step}; arrays are placed into this learner's shardings."""
        for key in ("params", "opt_state", "step"):
            if key not in d:
                raise ValueError(f"state dict lacks {key!r} (has {sorted(d)})")
        try:
            self.params = self._place_params(d["params"])  # copies: the caller's arrays survive donation
            self.opt_state = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=self._opt_sh)(
                d["opt_state"])
        except ValueError as err:
            raise ValueError(f"state dict does not match this learner's model / optimizer: {err}") from None
        self.step = int(d["step"])

    def jit_cache_sizes(self) -> dict[str, int]:
        """Compiled variants of each jitted function (shape buckets); should stay small."""
        return {"train": self._train_step._cache_size(), "sft": self._sft_step._cache_size(),
                "score": self._score._cache_size()}

    # -- host-side batch building -------------------------------------------------------

    def pack(self, samples: Sequence[TrainSample], loss_agg_mode: str | None = None) -> tuple[PackedBatch, dict]:
        """Pack samples and lay them out as [M, r, L] micro-batches (numpy). Under context parallelism the
        token axis of every [M, r, L] array is in the load-balanced layout (models/context_layout.py;
        `context_layout.from_layout(x, learner.context)` gives natural rows back)."""
        cfg = self.config
        packed = pack_samples(samples, cfg.row_len, row_multiple=cfg.micro_batch_rows)
        arrays = packed.arrays()
        arrays["loss_weight"] = loss_weights(packed, loss_agg_mode or cfg.loss_agg_mode)
        arrays["old_logprobs"] = arrays["rollout_logprobs"].copy()
        r = cfg.micro_batch_rows
        batch = {k: to_layout(arrays[k].reshape(-1, r, cfg.row_len), self.context) for k in MICRO_KEYS}
        batch["sample_lengths"] = arrays["sample_lengths"]
        batch["batch_entropy"] = np.zeros((), np.float32)
        batch["old_from_current"] = np.ones((), bool)
        num_real_micro = sum(1 for mb in batch["segment_ids"] if mb.any())
        batch["aux_scale"] = np.asarray(1.0 / max(num_real_micro, 1), np.float32)  # aux = mean over micro-batches
        return packed, batch

    def put_batch(self, batch: dict) -> dict:
        """A packed batch (numpy, from `pack`) on the devices, laid out as the jitted steps take it. A batch
        already placed (what `update` hands `apply`) is returned as it is: `device_put` of placed arrays
        still costs about 0.2 ms per batch on a CPU."""
        shardings = {k: self._batch_sh[k] for k in batch}
        if all(isinstance(v, jax.Array) and v.sharding == shardings[k] for k, v in batch.items()):
            return batch
        return jax.device_put(batch, shardings)

    def lower_update(self, samples: Sequence[TrainSample]):
        """The jitted policy train step for `samples`' packed batch, lowered (not run): `.compile()` gives
        XLA's memory and cost analyses. For `ulorl plan` and the benches."""
        _, batch = self.pack(samples)
        return self._train_step.lower(self.params, self.opt_state, self.put_batch(batch))

    # -- updates ------------------------------------------------------------------------

    def _minibatches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        size = self.config.ppo_mini_batch_size or len(samples)
        return [list(samples[i:i + size]) for i in range(0, len(samples), size)]

    def update(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Policy-gradient updates on finished samples (Eq. 10); returns float metrics.

        ppo_epochs x ceil(N / ppo_mini_batch_size) optimizer updates. With more
        than one, a forward-only pass first scores every sample under the
        current policy: POIS's π_old (once, for all updates) and the rollout
        log-prob mismatch. With entropy_mode="batch" that pass also gives the
        batch entropy of the DMMPT test.
        """
        cfg = self.config
        validate_samples(samples, cfg.row_len, need_rewards_01=cfg.mask_mode != "none",
                         need_logprobs=cfg.is_mode == "sais")
        minis = [self.pack(mb) for mb in self._minibatches(samples)]
        num_updates = len(minis) * cfg.ppo_epochs
        correct = cfg.rollout_is is not None or cfg.rollout_rs is not None  # needs π_old before the step
        prescore = num_updates > 1 or cfg.entropy_mode == "batch" or correct
        pre = {"mismatch_abs_sum": 0.0, "mismatch_tokens": 0.0, "mismatch_abs_max": 0.0}
        corr_metrics: list[dict[str, float]] = []
        device_batches = []
        for _, batch in minis:
            if prescore:
                logp, entropy = self._score_batch(batch)
                m = batch["response_mask"]
                if cfg.is_mode == "pois":
                    batch["old_logprobs"] = logp
                batch["old_from_current"] = np.zeros((), bool)
                tokens = m.sum()
                batch["batch_entropy"] = np.asarray((entropy * m).sum() / max(tokens, 1.0), np.float32)
                sums = logprob_mismatch_sums(batch["rollout_logprobs"], logp, batch["has_rollout_logprobs"] * m)
                pre["mismatch_abs_sum"] += float(sums["mismatch_abs_sum"])
                pre["mismatch_tokens"] += float(sums["mismatch_tokens"])
                pre["mismatch_abs_max"] = max(pre["mismatch_abs_max"], float(sums["mismatch_abs_max"]))
                if correct:  # rollout correction (rl/rollout_correction.py) as loss weights
                    batch["loss_weight"], metrics = correct_loss_weights(
                        batch, loss_agg_mode=cfg.loss_agg_mode, rollout_is=cfg.rollout_is,
                        rollout_is_threshold=cfg.rollout_is_threshold, rollout_rs=cfg.rollout_rs,
                        rollout_rs_threshold=cfg.rollout_rs_threshold)
                    corr_metrics.append(metrics)
            else:  # one update: the step's own forward is the policy at the start
                batch["old_from_current"] = np.asarray(cfg.is_mode == "pois")
            device_batches.append(self.put_batch(batch))

        per_update = [self.apply(batch) for _ in range(cfg.ppo_epochs) for batch in device_batches]
        if prescore:
            for k, v in pre.items():
                per_update[0][k] = v
        out = self._summarise(per_update, minis, num_updates, policy=True)
        for key in corr_metrics[0] if corr_metrics else ():  # the mean over the mini-batches
            out[key] = float(np.mean([m[key] for m in corr_metrics if key in m]))
        return out

    def _score_batch(self, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        """Forward only at the current params: (log p(target), entropy), both [M, r, L] numpy."""
        logp, entropy = self._score(self.params, self.put_batch({k: batch[k] for k in
                                                            ("tokens", "targets", "positions", "segment_ids")}))
        return np.asarray(logp), np.asarray(entropy)

    def mean_entropy(self, samples: Sequence[TrainSample]) -> float:
        """Mean per-token entropy (nats, full vocabulary, temperature 1) of the current policy over the
        samples' response tokens: the quantity DMMPT compares with sigma, on any set of responses."""
        validate_samples(samples, self.config.row_len)
        total, tokens = 0.0, 0.0
        for mb in self._minibatches(samples):
            _, batch = self.pack(mb)
            _, entropy = self._score_batch(batch)
            total += float((entropy * batch["response_mask"]).sum())
            tokens += float(batch["response_mask"].sum())
        return total / max(tokens, 1.0)

    def sft_update(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Supervised updates (token-mean NLL of the response tokens) through the same machinery.

        Advantages, rewards and rollout log-probs are ignored.
        """
        validate_samples(samples, self.config.row_len)
        minis = [self.pack(mb, loss_agg_mode="token-mean") for mb in self._minibatches(samples)]
        device_batches = [self.put_batch(batch) for _, batch in minis]
        per_update = [self.apply(batch, objective="sft") for _ in range(self.config.ppo_epochs)
                      for batch in device_batches]
        return self._summarise(per_update, minis, len(per_update), policy=False)

    def apply(self, batch: dict, objective: str = "policy") -> dict[str, float]:
        """One optimizer update on a packed batch (from `pack`); raw per-update sums as floats.

        A non-finite loss or grad norm leaves params / opt_state unchanged
        (decided inside the jitted step), logs a warning, and `step` is not advanced.
        """
        fn = self._train_step if objective == "policy" else self._sft_step
        self.params, self.opt_state, metrics = fn(self.params, self.opt_state, self.put_batch(batch))
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if metrics["skipped"]:
            log.warning("learner: non-finite loss (%s) or grad norm (%s) at update %d (%s); params and optimizer "
                        "state left unchanged", metrics["loss"], metrics["grad_norm"], self.step, objective)
        else:
            self.step += 1
        return metrics

    def gradients(self, samples: Sequence[TrainSample], objective: str = "policy"):
        """(loss, grads) of one mini-batch at the current params, with π_old = current policy
        (POIS's first update). For tests and debugging; not used by `update`."""
        _, batch = self.pack(samples)
        batch["old_from_current"] = np.asarray(self.config.is_mode == "pois")
        if self._grad_fn is None:
            self._grad_fn = jax.jit(mesh_context(build_grad_fn(self.graphdef, self._other, self.config, objective),
                                                 self.mesh),
                                    in_shardings=(self._param_sh, self._batch_sh),
                                    out_shardings=(self._replicated, self._param_sh, self._replicated))
        loss, grads, _ = self._grad_fn(self.params, self.put_batch(batch))
        return loss, grads

    @staticmethod
    def _summarise(per_update: list[dict], minis, num_updates: int, policy: bool) -> dict[str, float]:
        """Per-update sums -> fractions; losses / norms averaged over updates; counts from the first epoch."""
        first_epoch = per_update[:len(minis)]
        tot = {k: sum(u[k] for u in per_update) for k in SUM_METRICS}
        n_tok = max(tot["tokens"], 1.0)
        rows = sum(b["tokens"].shape[0] * b["tokens"].shape[1] for _, b in minis)
        row_len = minis[0][1]["tokens"].shape[2]
        real = sum(u["real_tokens"] for u in first_epoch)
        mismatch_tokens = max(sum(u["mismatch_tokens"] for u in first_epoch[:1]), 0.0)
        out = {
            "loss": float(np.mean([u["loss"] for u in per_update])),
            "pg_loss": float(np.mean([u["pg_loss"] for u in per_update])),
            "grad_norm": float(np.mean([u["grad_norm"] for u in per_update])),
            "entropy": tot["entropy_sum"] / n_tok,
            "nll": tot["nll_sum"] / n_tok,
            "tokens": sum(u["tokens"] for u in first_epoch),
            "padding_fraction": 1.0 - real / max(rows * row_len, 1),
            "updates": float(num_updates),
            "skipped": sum(u["skipped"] for u in per_update),
            "aux_loss": float(np.mean([u["aux_loss"] for u in per_update])),
        }
        if policy:
            out.update({
                "masked_fraction": tot["masked_tokens"] / n_tok,
                "mpt_fraction": tot["mpt_tokens"] / n_tok,
                "clip_fraction_low": tot["clip_low_tokens"] / n_tok,
                "clip_fraction_high": tot["clip_high_tokens"] / n_tok,
                "ratio_mean": tot["ratio_sum"] / n_tok,
                "ratio_max": max(u["ratio_max"] for u in per_update),
                # verl's names for what it computes the same way (README "Baselines": the mapping)
                "actor/pg_loss": float(np.mean([u["pg_loss"] for u in per_update])),
                "actor/pg_clipfrac": tot["pg_clip_tokens"] / n_tok,
                "actor/pg_clipfrac_lower": tot["pg_clip_lower_tokens"] / n_tok,
                "actor/ppo_kl": tot["ppo_kl_sum"] / n_tok,
                "actor/entropy": tot["entropy_sum"] / n_tok,
                "actor/grad_norm": float(np.mean([u["grad_norm"] for u in per_update])),
                # Rollout vs learner log-probs, at the policy that was current when the batch arrived
                # (the prescoring pass, or the first update's own forward).
                "logprob_mismatch_mean_abs": (first_epoch[0]["mismatch_abs_sum"] / mismatch_tokens
                                              if mismatch_tokens else 0.0),
                "logprob_mismatch_max_ratio": math.exp(first_epoch[0]["mismatch_abs_max"]),
                "logprob_mismatch_tokens": mismatch_tokens,
            })
        return out
