"""Decoder layers as one `jax.lax.scan` over their stacked weights (MaxText's `scan_layers`).

The model keeps one parameter tree per layer (the HF / orbax layout stays as
it is); `scan_layers` stacks the layers' weights inside the traced step, cast
to the compute dtype (each layer casts its weights to it anyway, so the
result is the same), and runs one layer body L times. Why:

- compile time no longer grows with depth (a 48-layer program compiles like
  a 1-layer one), which is what makes `ulorl plan` at full size practical;
- with remat, the backward pass is a loop that recomputes one layer per
  iteration, so only one layer's activations are ever live. Unrolled,
  every layer's recomputation depends only on its saved input, and a
  scheduler that is not memory-aware (XLA's CPU one) runs them all early.

Cost: a compute-dtype copy of the layer weights (and of their gradient) per
step — on a bf16 model with f32 master weights, the size of the f32 weights
once more, sharded as the weights are.

Only layers of one structure scan (every layer MoE, or every layer dense);
`unscannable` says why a model does not.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ulorl_jax.sharding import constrain

__all__ = ["unscannable", "stack_layers", "scan_layers"]


def unscannable(layers: Sequence[nnx.Module]) -> str | None:
    """None when `layers` can run as one scan, else the reason they cannot."""
    if len(layers) < 2:
        return f"{len(layers)} layer(s): nothing to scan"
    kinds = {bool(getattr(layer, "is_moe", False)) for layer in layers}
    if len(kinds) > 1:
        moe = [i for i, layer in enumerate(layers) if getattr(layer, "is_moe", False)]
        return (f"the layers mix MoE ({len(moe)} of {len(layers)}) and dense MLP blocks "
                f"(mlp_only_layers / decoder_sparse_step): they have different weights")
    graphdef = nnx.graphdef(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        if nnx.graphdef(layer) != graphdef:
            return f"layer {i} has a different structure from layer 0"
    return None


def _cast(x, dtype):
    return x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x


def stack_layers(layers: Sequence[nnx.Module], dtype=None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef of one layer, state whose every leaf is the layers' leaves stacked on a new axis 0).
    `dtype`: cast floating weights to it first. Under a mesh context each stacked weight keeps its
    layer's sharding (logical axes) with the new layer axis unsharded."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def stack(*variables):
        value = jnp.stack([_cast(v[...], dtype) for v in variables])
        axes = getattr(variables[0], "logical_axes", None)
        if axes is not None:
            value = constrain(value, (None, *axes))
        return variables[0].replace(value)

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, stacked


def scan_layers(layers: Sequence[nnx.Module], fn: Callable[..., tuple[jnp.ndarray, Any]], x: jnp.ndarray,
                *args, policy=None, dtype=None) -> tuple[jnp.ndarray, Any]:
    """Run `x = fn(layer, x, *args)[0]` through every layer as one `lax.scan`.

    fn(layer, x, *args) -> (new x, per-layer output or None); returns (x after the last layer,
    per-layer outputs stacked on axis 0). `policy`: a `jax.checkpoint` policy to rematerialise each
    layer with (None = keep activations). `dtype`: the compute dtype the weights are cast to."""
    reason = unscannable(layers)
    if reason is not None:
        raise ValueError(f"cannot scan these decoder layers: {reason}")
    graphdef, stacked = stack_layers(layers, dtype)

    def body(carry, state):
        return fn(nnx.merge(graphdef, state), carry, *args)

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)  # a scan body is never CSE'd across steps
    return jax.lax.scan(body, x, stacked)
