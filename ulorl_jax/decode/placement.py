"""Where the rollout decodes: the engine's mesh and the weights it decodes with (`rollout.decode_mesh`).

    learner       the learner's mesh and its own (sharded) param arrays: no copy, no transfer. One process
                  only (the learner's mesh spans every process; an engine's calls stay in one process).
    replicate     a mesh of this process's local devices: the slots are split over them and each holds
                  the whole weights (one data-parallel replica per device, in one SPMD engine).
    shard         a mesh of this process's local devices: slots and weights split over them (fsdp), for a
                  model that does not fit one device; every decode step all-gathers the weights.
    first_device  this process's first device alone (the others idle through the rollout).
    auto          learner with one process; with several, replicate when the weights take at most half of
                  a device's memory (or the backend does not say: CPU), else shard.

Weight sync: after each learner update, `DecodePlacement.params(learner_params)` hands the engine the new
weights: the learner's arrays themselves (learner), or an all-gather over the learner's mesh whose
per-device copies become the local mesh's arrays without another copy (replicate, first_device), then
sliced on device (shard). Every process must call it (the all-gather is a collective).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulorl_jax.choices import DECODE_MESHES
from ulorl_jax.sharding import MeshConfig, make_mesh, param_shardings


@functools.lru_cache(maxsize=8)
def _replicate(mesh: Mesh) -> Callable:
    """A jitted identity whose outputs are replicated over `mesh` (one per mesh: compiled once)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


def weight_bytes(params: Any) -> int:
    """Bytes of the whole (unsharded) weights."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def device_memory_bytes(device) -> int | None:
    """The allocator's limit on `device`, or None where the backend does not report one (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def resolve_kind(kind: str, process_count: int, weights: int, device_bytes: int | None) -> str:
    """`auto` -> the concrete layout; `learner` with several processes is refused."""
    if kind not in DECODE_MESHES:
        raise ValueError(f"rollout.decode_mesh={kind!r}: choose one of {', '.join(DECODE_MESHES)}")
    if kind == "learner" and process_count > 1:
        raise ValueError(f"rollout.decode_mesh=learner needs one process, this run has {process_count}: the "
                         f"learner's mesh spans every process; use replicate, shard or first_device")
    if kind != "auto":
        return kind
    if process_count == 1:
        return "learner"
    return "replicate" if device_bytes is None or weights <= device_bytes // 2 else "shard"


@dataclasses.dataclass(frozen=True)
class DecodePlacement:
    kind: str  # a concrete layout (never auto)
    mesh: Mesh  # the engine's mesh
    learner_mesh: Mesh
    shardings: Any = None  # the weights' shardings on `mesh` (shard only)

    @property
    def engine_mesh(self) -> Mesh | None:
        """What `PolicyEngine(mesh=...)` takes: the mesh, one device included (the engine then splits no work
        but keeps its state laid out on that mesh: left to propagation from the learner's weights, the
        state's layout changed from call to call, and each new layout compiled the step again)."""
        return self.mesh

    @property
    def devices(self) -> int:
        return self.mesh.size

    def params(self, learner_params: Any) -> Any:
        """The weights on the engine's mesh (a collective unless kind is learner)."""
        if self.kind == "learner":
            return learner_params
        whole = _replicate(self.learner_mesh)(learner_params)
        devices = list(self.mesh.devices.flat)
        sharding = NamedSharding(self.mesh, P())

        def local(x):  # this process's copies of a replicated global array, as an array on `mesh`
            by_device = {s.device: s.data for s in x.addressable_shards}
            return jax.make_array_from_single_device_arrays(x.shape, sharding, [by_device[d] for d in devices])

        out = jax.tree.map(local, whole)
        return out if self.shardings is None else jax.device_put(out, self.shardings)

    def describe(self, weights: int) -> str:
        gib = weights / 2**30
        if self.kind == "learner":
            return f"the learner's mesh ({self.devices} device(s), its sharded weights, no copy)"
        if self.kind == "shard":
            return (f"{self.devices} local device(s), slots and weights split over them "
                    f"({gib / self.devices:.3g} GiB of weights per device)")
        return f"{self.devices} local device(s), slots split over them, whole weights on each ({gib:.3g} GiB)"


def decode_placement(kind: str, learner_mesh: Mesh, params: Any) -> DecodePlacement:
    """The placement `rollout.decode_mesh=kind` asks for, given the learner's mesh and (abstract or
    concrete) params."""
    local = jax.local_devices()
    weights = weight_bytes(params)
    kind = resolve_kind(kind, jax.process_count(), weights, device_memory_bytes(local[0]))
    if kind == "learner":
        return DecodePlacement(kind, learner_mesh, learner_mesh)
    if kind == "first_device":
        return DecodePlacement(kind, make_mesh(MeshConfig(fsdp=1), local[:1]), learner_mesh)
    if kind == "replicate":
        return DecodePlacement(kind, make_mesh(MeshConfig(data=-1, fsdp=1), local), learner_mesh)
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1), local)
    return DecodePlacement(kind, mesh, learner_mesh, param_shardings(params, mesh))
