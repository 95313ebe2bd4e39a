"""Device mesh and logical-axis sharding rules.

Parameters carry logical axis names (`logical_axes` metadata on each
`nnx.Param`, e.g. ("embed", "mlp")); a rules table maps each logical name to
mesh axes. Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with
sharded parameters and optimizer state), `expert` (MoE experts), `context`
(the token axis of the learner's packed rows: context parallelism,
models/context_attention.py; parameters are split over it as over `fsdp`),
`tensor` (heads / MLP width / vocab).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

# Parameter logical axes -> mesh axes. None = replicated.
DEFAULT_PARAM_RULES: dict[str, Any] = {
    "vocab": "tensor",
    # ZeRO-3 over both: a context shard holds a slice of every row, so it shares the weights' memory as an
    # fsdp shard does (gathered per layer in the forward, gradients reduce-scattered)
    "embed": ("fsdp", "context"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "norm": None,
}
# Activations: the batch is split over every data-like axis (experts see the
# whole batch through GSPMD's collectives); the learner's packed rows are split along
# their tokens over `context` as well, so a flattened token axis [rows * row_len] is
# split over TOKEN_AXES (rows major, then the context shards of each row).
BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_AXIS = "context"
TOKEN_AXES = BATCH_AXES + (CONTEXT_AXIS,)


class MeshError(ValueError):
    """The requested mesh does not fit the devices, or a tensor does not divide over it."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; one axis may be -1 to take the remaining devices."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def shape(self, num_devices: int) -> dict[str, int]:
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise MeshError(f"mesh.{axis}={size}: sizes must be positive or -1 (fill)")
        fill = [a for a, s in sizes.items() if s == -1]
        if len(fill) > 1:
            raise MeshError(f"only one mesh axis may be -1, got {fill}")
        known = math.prod(s for s in sizes.values() if s != -1)
        if fill:
            if num_devices % known:
                raise MeshError(
                    f"mesh {self._describe(sizes)} cannot fill {num_devices} devices: "
                    f"{num_devices} is not a multiple of {known}"
                )
            sizes[fill[0]] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            raise MeshError(
                f"mesh {self._describe(sizes)} = {math.prod(sizes.values())} devices, "
                f"but {num_devices} are available"
            )
        return sizes

    @staticmethod
    def _describe(sizes: dict[str, int]) -> str:
        return " x ".join(f"{a}={s}" for a, s in sizes.items())


def make_mesh(config: MeshConfig | None = None, devices=None) -> Mesh:
    """A Mesh with axes (data, fsdp, expert, context, tensor) over `devices` (default: all)."""
    config = config or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    sizes = config.shape(len(devices))
    grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: tuple | None, rules: dict | None = None) -> P:
    rules = DEFAULT_PARAM_RULES if rules is None else rules
    if axes is None:
        return P()
    specs = []
    for name in axes:
        if name is not None and name not in rules:
            raise MeshError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(rules)}")
        specs.append(None if name is None else rules[name])
    return P(*specs)


def axis_size(mesh: Mesh, entry) -> int:
    """Devices along one PartitionSpec entry (None, an axis name or a tuple of names) of `mesh`."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def spec_on(spec: P, mesh) -> P:
    """`spec` with the size-1 mesh axes left out of its multi-axis entries: ('fsdp', 'context') on a mesh
    without context parallelism is spelled 'fsdp', as before the context axis existed (a differently spelled
    but equal sharding is a new jit signature for code that compares them)."""
    def entry(e):
        if not isinstance(e, tuple):
            return e
        kept = tuple(a for a in e if mesh.shape[a] > 1) or e[:1]
        return kept[0] if len(kept) == 1 else kept

    return P(*(entry(e) for e in spec))


def spec_for(name: str, shape: tuple[int, ...], axes: tuple | None, mesh: Mesh, rules=None) -> NamedSharding:
    """NamedSharding for one tensor, after checking every sharded dim divides."""
    spec = spec_on(logical_to_spec(axes, rules), mesh)
    for dim, entry in zip(shape, spec):
        if dim % axis_size(mesh, entry):
            raise MeshError(
                f"parameter {name} with shape {tuple(shape)} and logical axes {axes}: dimension {dim} "
                f"does not divide over mesh axis {entry!r} of size {axis_size(mesh, entry)}"
            )
    return NamedSharding(mesh, spec)


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_shardings(state: nnx.State, mesh: Mesh, rules: dict | None = None):
    """A pytree like `state` with a NamedSharding per parameter (from its logical axes)."""

    def one(path, var):
        return var.replace(spec_for(_path_str(path), var.shape, getattr(var, "logical_axes", None), mesh, rules))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: dict | None = None) -> nnx.Module:
    """Move a model's parameters onto `mesh` (in place) and return it."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def mesh_context(fn, mesh: Mesh):
    """`fn` traced with `mesh` as jax's (abstract) mesh context, for use under `jax.jit`: model
    code that needs the mesh reads `jax.sharding.get_abstract_mesh()` (models/moe_parallel.py)
    instead of taking a mesh argument. The jit must place its arguments on `mesh` (in_shardings)."""

    @functools.wraps(fn)
    def traced_under_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced_under_mesh


def context_mesh() -> jax.sharding.AbstractMesh | None:
    """Jax's mesh context (as `mesh_context` sets it) when it has the MESH_AXES and more than one
    device, else None: model code that lays out work by hand (sharded Pallas attention) reads it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names) or mesh.size == 1:
        return None
    return mesh


def constrain(x, axes: tuple):
    """`x` laid out by logical `axes` (one name or None per dim, mapped as parameters are) when traced
    under `context_mesh()`; otherwise `x` unchanged."""
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_on(logical_to_spec(axes), mesh)))


def constrain_tokens(x):
    """`x` [N, ...] with N = rows x context shards (a row's slice per context shard, rows major) laid out
    over TOKEN_AXES when traced under `context_mesh()`; otherwise `x` unchanged."""
    mesh = context_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(TOKEN_AXES, *([None] * (x.ndim - 1)))))


def batch_axes_for(batch: int, mesh) -> tuple[str, ...]:
    """The BATCH_AXES, in order, that split `batch` rows evenly: all of them when the
    batch divides over the data shards (the learner's micro-batches always do); otherwise
    the rows are split over the axes that still divide and replicated over the rest."""
    return _dividing_axes(batch, mesh, BATCH_AXES)


def _dividing_axes(n: int, mesh, candidates: tuple[str, ...]) -> tuple[str, ...]:
    axes: tuple[str, ...] = ()
    for axis in candidates:
        if n % axis_size(mesh, axes + (axis,)) == 0:
            axes += (axis,)
    return axes


def token_axes_for(tokens: int, mesh) -> tuple[str, ...]:
    """The TOKEN_AXES, in order, that split a flattened token axis of `tokens` evenly (as
    `batch_axes_for`; the context axis last, as the learner's rows are laid out)."""
    return _dividing_axes(tokens, mesh, TOKEN_AXES)


def context_size(mesh=None) -> int:
    """Devices along the `context` axis of `mesh` (default: jax's mesh context); 1 without one."""
    mesh = context_mesh() if mesh is None else mesh
    if mesh is None or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[CONTEXT_AXIS]


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch dimension over (data, fsdp, expert); the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def shard_batch(x, mesh: Mesh):
    """Place a host batch [B, ...] on the mesh, checking B divides over the batch axes."""
    n = axis_size(mesh, BATCH_AXES)
    if x.shape[0] % n:
        raise MeshError(f"batch of shape {tuple(x.shape)}: size {x.shape[0]} does not divide over {n} data shards "
                        f"(mesh axes {BATCH_AXES})")
    return jax.device_put(x, batch_sharding(mesh, x.ndim))
