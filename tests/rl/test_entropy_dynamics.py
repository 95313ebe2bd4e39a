"""The DMMPT mechanism at toy scale (ULORL.md §3; the paper's Figures 4/5).

A tiny policy (vocab 4) writes 4-token responses to a one-token prompt.
Reward: Bernoulli(0.9 · fraction of response tokens in {1, 2}): two equally
good tokens, and noise that keeps every group mixed. The exact softmax
policy gradient favours whichever good token is already more likely, so
without masking the policy collapses onto one of them and the entropy falls
towards 0. Masking the well-mastered positive tokens (p ≥ τ in reward-1
samples) stops that rich-get-richer push, so the other good token survives
and the entropy stays up; DMMPT masks only while the sample's entropy H̄_i is
below σ, so it holds the entropy near σ.

Toy constants (not the paper's): τ = 0.9 instead of 0.99, because with two
tokens H̄ = σ = 0.2 is reached at p ≈ 0.95, where p ≥ 0.99 tokens would not
exist yet. σ = 0.2 as the paper. GRPO advantages, dynamic sampling (groups
with equal rewards are dropped), POIS, 32 samples per step, AdamW lr 3e-3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.rl import dynamic_sampling_keep, grpo_advantages
from ulorl_jax.rl.learner import Learner, LearnerConfig, TrainSample

VOCAB, RESPONSE, GROUP, STEPS = 4, 4, 32, 200
TAU, SIGMA = 0.9, 0.2
# Bands on the mean entropy of the last 20 updates. The initial entropy is ≈ 1.38 = ln 4 and lies outside
# every band, so a mode that does not learn fails. Measured (2026-12-04, jax 0.10.2 CPU): none 0.032, mpt
# 0.354 (bad tokens pushed out, the two good ones kept: towards ln 2 = 0.69 minus the noise), dmmpt 0.225.
BANDS = {"none": (0.0, 0.1), "mpt": (0.25, 0.8), "dmmpt": (0.1, 0.3)}


def _train(mask_mode: str) -> list[float]:
    cfg = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    learner = Learner(init_model(cfg, seed=0),
                      LearnerConfig(mask_mode=mask_mode, tau=TAU, sigma=SIGMA, lr=3e-3, row_len=8,
                                    micro_batch_rows=GROUP, logprob_chunk=8, remat="none"))
    graphdef, other = learner.graphdef, learner._other

    @jax.jit
    def sample(params, key):  # [G, RESPONSE] tokens from the current policy, temperature 1
        model = nnx.merge(graphdef, params, other)

        def body(t, carry):
            buf, key = carry
            key, sub = jax.random.split(key)
            return buf.at[:, t + 1].set(jax.random.categorical(sub, model(buf)[:, t])), key

        buf, _ = jax.lax.fori_loop(0, RESPONSE, body, (jnp.zeros((GROUP, 1 + RESPONSE), jnp.int32), key))
        return buf[:, 1:]

    rng, key = np.random.default_rng(0), jax.random.PRNGKey(0)
    entropy = []
    for _ in range(STEPS):
        key, sub = jax.random.split(key)
        responses = np.asarray(sample(learner.params, sub))
        good = np.isin(responses, (1, 2)).mean(axis=1)
        rewards = (rng.random(GROUP) < 0.9 * good).astype(np.float32)
        if not dynamic_sampling_keep(rewards[None])[0]:
            continue  # all-equal group: no signal
        adv = np.asarray(grpo_advantages(rewards[None]))[0]
        metrics = learner.update([TrainSample([0], responses[i].tolist(), float(adv[i]), float(rewards[i]))
                                  for i in range(GROUP)])
        entropy.append(metrics["entropy"])
    return entropy


@pytest.mark.slow
def test_entropy_collapses_without_masking_and_dmmpt_holds_it_near_sigma():
    final = {}
    for mode in ("none", "mpt", "dmmpt"):
        history = _train(mode)
        assert len(history) > STEPS // 2, mode
        final[mode] = float(np.mean(history[-20:]))
    for mode, (lo, hi) in BANDS.items():
        assert lo <= final[mode] <= hi, f"{mode}: final entropy {final[mode]:.3f} outside [{lo}, {hi}] ({final})"
    assert final["none"] < final["dmmpt"] < final["mpt"], final
