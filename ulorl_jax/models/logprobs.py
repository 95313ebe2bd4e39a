"""Token log-probs and full-vocab entropy without materialising [B, T, V].

At 128k output tokens and a 152k vocab the logits of one sample alone are
~80 GB in float32, so the learner never builds them whole: `lax.scan` walks
the sequence in chunks of `chunk_size` positions, and a custom VJP saves only
each position's log-sum-exp and entropy; the backward pass recomputes a
chunk's logits once and forms their cotangent in closed form,

    d z_k = g_lp · ([k = y] − p_k) − g_H · p_k · (log p_k + H),

instead of differentiating the softmax op by op. Peak temp memory is then
O(B · chunk · V), independent of T. (The closed form also avoids XLA:CPU's
slow fused `sum(exp(x) * x)` over a [1, C, V] array: the sums over V here are
contractions.)

Entropy is H = −Σ_j p_j log p_j over the full vocabulary; its per-sample mean
over response tokens is the H̄_i of the DMMPT test (ULORL.md §3).

`full_logprobs_and_entropy` is the plain reference the chunked path is tested
against, forward and backward.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

DType = Any


def _logits(hidden: jnp.ndarray, lm_head: jnp.ndarray, compute_dtype: DType, temperature: float) -> jnp.ndarray:
    """hidden [..., D] @ lm_head [D, V] -> float32 logits [..., V], divided by temperature."""
    logits = jnp.einsum(
        "...d,dv->...v",
        hidden.astype(compute_dtype),
        lm_head.astype(compute_dtype),
        preferred_element_type=jnp.float32,
    )
    return logits / temperature


def _logprobs_and_entropy_from_logits(logits: jnp.ndarray, targets: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """float32 logits [..., V], targets [...] -> (log p(target) [...], entropy [...])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_logp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # −Σ p log p
    return token_logp, entropy


def full_logprobs_and_entropy(
    hidden: jnp.ndarray,
    lm_head: jnp.ndarray,
    targets: jnp.ndarray,
    *,
    compute_dtype: DType = jnp.float32,
    temperature: float = 1.0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Reference: full [B, T, V] softmax. Same contract as the chunked version."""
    return _logprobs_and_entropy_from_logits(_logits(hidden, lm_head, compute_dtype, temperature), targets)


def chunked_logprobs_and_entropy(
    hidden: jnp.ndarray,
    lm_head: jnp.ndarray,
    targets: jnp.ndarray,
    *,
    chunk_size: int = 1024,
    compute_dtype: DType = jnp.float32,
    temperature: float = 1.0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Log-prob of each target and full-vocab entropy, chunked along T.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm).
      lm_head: [D, V] output projection.
      targets: [B, T] int token ids scored at each position.
      chunk_size: positions per scan step (clamped to T); T is padded up to a
        multiple internally and sliced back.
      compute_dtype: matmul input dtype; accumulation and softmax are float32.
      temperature: logits are divided by it; must match the rollout's sampling
        temperature for the ratio and the DMMPT test to mean anything.

    Returns (logprobs [B, T] float32, entropy [B, T] float32).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    b, t, d = hidden.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets has shape {targets.shape}, expected {(b, t)} to match hidden {hidden.shape}")
    if lm_head.ndim != 2 or lm_head.shape[0] != d:
        raise ValueError(f"lm_head has shape {lm_head.shape}, expected [D={d}, V]")
    if t == 0:
        return jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.float32)

    chunk = min(chunk_size, t)
    num_chunks = -(-t // chunk)
    pad = num_chunks * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    # Scan over the chunk axis, each chunk one [B·C, D] matrix: [B, N*C, D] -> [N, B·C, D].
    hidden_chunks = hidden.reshape(b, num_chunks, chunk, d).swapaxes(0, 1).reshape(num_chunks, b * chunk, d)
    target_chunks = targets.reshape(b, num_chunks, chunk).swapaxes(0, 1).reshape(num_chunks, b * chunk)
    stats = _chunked(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature)  # [N, B·C] each
    logp, entropy = (x.reshape(num_chunks, b, chunk).swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :t]
                     for x in stats)
    return logp, entropy


def _chunk_stats(h: jnp.ndarray, lm_head: jnp.ndarray, y: jnp.ndarray, compute_dtype: DType,
                 temperature: float) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One chunk, h [..., D], y [...] -> (log p(y), entropy, log-sum-exp), each [...] float32."""
    z = _logits(h, lm_head, compute_dtype, temperature)  # [..., V] float32
    m = jnp.max(z, axis=-1)
    e = jnp.exp(z - m[..., None])
    total = jnp.sum(e, axis=-1)
    lse = m + jnp.log(total)
    z_y = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.einsum("...v,...v->...", e, z) / total  # H = lse − Σ p z
    return z_y - lse, entropy, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature):
    """[N, B·C, D] chunks -> (log p(target), entropy), each [N, B·C]; see the module docstring."""
    logp, entropy, _ = _chunked_forward(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature)
    return logp, entropy


def _chunked_forward(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature):
    def body(carry, xs):
        return carry, _chunk_stats(xs[0], lm_head, xs[1], compute_dtype, temperature)

    _, stats = jax.lax.scan(body, None, (hidden_chunks, target_chunks))
    return stats


def _chunked_fwd(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature):
    logp, entropy, lse = _chunked_forward(hidden_chunks, lm_head, target_chunks, compute_dtype, temperature)
    return (logp, entropy), (hidden_chunks, lm_head, target_chunks, lse, entropy)


def _chunked_bwd(compute_dtype, temperature, residuals, cotangents):
    hidden_chunks, lm_head, target_chunks, lse, entropy = residuals
    g_logp, g_entropy = cotangents
    w = lm_head.astype(compute_dtype)
    vocab = jnp.arange(lm_head.shape[1], dtype=jnp.int32)

    def body(d_lm_head, xs):
        h, y, lse_c, ent_c, g_lp, g_h = xs  # [B·C, D], then [B·C] each
        z = _logits(h, w, compute_dtype, temperature)
        p = jnp.exp(z - lse_c[..., None])
        # dz = g_lp ([k = y] − p) − g_H p (z − lse + H), folded as −p (a + g_H z) + g_lp [k = y]
        a = g_lp + g_h * (ent_c - lse_c)
        dz = jnp.where(vocab == y[..., None], g_lp[..., None], 0.0) - p * (a[..., None] + g_h[..., None] * z)
        dz = (dz / temperature).astype(compute_dtype)
        dh = jnp.einsum("tv,dv->td", dz, w, preferred_element_type=jnp.float32).astype(h.dtype)
        d_lm_head = d_lm_head + jnp.einsum("td,tv->dv", h.astype(compute_dtype), dz,
                                           preferred_element_type=jnp.float32)
        return d_lm_head, dh

    d_lm_head, d_hidden = jax.lax.scan(body, jnp.zeros(lm_head.shape, jnp.float32),
                                       (hidden_chunks, target_chunks, lse, entropy, g_logp, g_entropy))
    return d_hidden, d_lm_head.astype(lm_head.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def sample_mean_entropy(entropy: jnp.ndarray, response_mask: jnp.ndarray) -> jnp.ndarray:
    """H̄_i [B]: mean token entropy over each sample's response tokens; 0 where none."""
    m = response_mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(m > 0, entropy.astype(jnp.float32), 0.0), axis=-1)
    count = m.sum(axis=-1)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
