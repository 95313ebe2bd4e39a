"""Dropless MoE experts on the Pallas grouped matmul (``moe_impl="pallas"``).

Same contract and math as ``ulorl_jax.models.moe.experts_ragged`` (the
reference it is tested against): assignments sorted by expert, SwiGLU
experts as three grouped matmuls, results scattered back and combined with
the router weights. Only the grouped matmul differs: ``dispatch.gmm`` picks
our Pallas kernel (CPU interpret / GPU) or megablox (TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .dispatch import gmm

__all__ = ["grouped_matmul_experts"]


def grouped_matmul_experts(x, weights, experts, w_gate, w_up, w_down) -> jax.Array:
    """x [N, D]; weights / experts [N, K] (router output); w_gate / w_up [E, D, F];
    w_down [E, F, D] -> [N, D] = sum_k weights[n, k] * expert_{experts[n, k]}(x[n])."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat_experts = experts.reshape(-1)  # [N*K], row-major over (n, k)
    order = jnp.argsort(flat_experts, stable=True)  # assignments grouped by expert
    x_sorted = x[order // k]  # [N*K, D]
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # [E]
    dt = x.dtype
    gate = gmm(x_sorted, w_gate.astype(dt), group_sizes)  # 'md,edf->mf' per group [N*K, F]
    up = gmm(x_sorted, w_up.astype(dt), group_sizes)
    y_sorted = gmm(jax.nn.silu(gate) * up, w_down.astype(dt), group_sizes)  # [N*K, D]
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)  # back to (n, k) order
    return jnp.einsum("nkd,nk->nd", y, weights)
