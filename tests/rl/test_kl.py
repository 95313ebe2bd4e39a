"""KL estimators against verl's kl_penalty restated in torch: values and gradients, straight-through forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ulorl_jax.rl.kl import KL_TYPES, kl_penalty


def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    assert kl_penalty in ("low_var_kl", "k3")
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty.removesuffix("+"))
    if not kl_penalty.endswith("+") or kl_penalty in ("mse+", "k2+"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


@pytest.mark.parametrize("kind", KL_TYPES)
def test_values_and_gradients_equal_verl(kind):
    rng = np.random.default_rng(0)
    lp = -rng.uniform(0.01, 4.0, 64)
    ref = lp + rng.normal(0.0, 1.0, 64)
    ref[:3] = lp[:3] - np.array([30.0, 12.0, -25.0])  # through verl's clamps
    weights = rng.normal(size=64)
    lp_t = torch.tensor(lp, requires_grad=True)
    want = verl_kl_penalty(lp_t, torch.tensor(ref), kind)
    (want * torch.tensor(weights)).sum().backward()
    got, grad = jax.value_and_grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref, jnp.float32), kind) * weights)
                                   )(jnp.asarray(lp, jnp.float32))
    np.testing.assert_allclose(np.asarray(kl_penalty(jnp.asarray(lp, jnp.float32), jnp.asarray(ref, jnp.float32),
                                                     kind)), want.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), lp_t.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_zero_when_policy_is_reference_and_bad_kind_named():
    lp = jnp.asarray([-0.3, -2.0, -5.0])
    for kind in KL_TYPES:
        assert float(jnp.abs(kl_penalty(lp, lp, kind)).max()) == 0.0
    with pytest.raises(ValueError, match="kl type 'k4'"):
        kl_penalty(lp, lp, "k4")
