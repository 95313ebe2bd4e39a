"""Training checkpoints: params, optimizer state, rng and run metadata, for exact resume.

Built on orbax-checkpoint's `CheckpointManager`: each step is one directory
holding four items (`params`, `opt_state`, `rng`: tensorstore arrays; `meta`:
JSON with the step, data position, rollout pools, policy version, ...). Orbax
writes a step into a temporary directory and renames it when complete (atomic
commit), so a half-written step is never listed. Saves may run in the
background (`async_save`); `keep_last` prunes old steps.

Array pytrees are stored as flat, index-keyed dicts of leaves plus a list of
their paths in `meta`, so any pytree (nnx.State, optax namedtuples, plain dicts)
round-trips and is restored into the *target's* structure, dtypes and
shardings. A target whose paths or shapes differ from the saved ones is an
error naming the first differing leaf.

Several processes (`jax.distributed`): every process calls `save` and `restore`
(orbax's are collectives; process 0 writes the JSON and host numpy arrays,
each process its shards of the global arrays), so the run folder must be on a
filesystem every process sees. `meta` must be the same on every process: host
state that differs per process is gathered first and saved as a list indexed
by process (the trainer does this for the unfinished pools).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

__all__ = ["TrainCheckpointer", "CheckpointError", "export_hf"]
_ARRAY_ITEMS = ("params", "opt_state", "rng")


class CheckpointError(ValueError):
    """No usable checkpoint, or a checkpoint that does not match the restore target."""


class _Mismatch(CheckpointError):
    """The target's structure/shapes differ from the saved ones (a caller error: no fallback)."""


def _path_name(path) -> str:
    """'layers.0.attn.q_proj.kernel': dict keys / indices / attributes, minus nnx's trailing `.value`."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name in ("value", "raw_value"):
            continue
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return ".".join(parts)


def _flatten(tree) -> tuple[dict[str, Any], list[str], Any]:
    """pytree -> ({'00000': leaf, ...}, [path names], treedef)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = {f"{i:05d}": leaf for i, (_, leaf) in enumerate(with_paths)}
    return leaves, [_path_name(p) for p, _ in with_paths], treedef


def _describe(leaves: dict[str, Any], names: list[str]) -> list[dict]:
    return [{"path": n, "shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype if not hasattr(x, "dtype")
                                                                  else x.dtype)}
            for n, x in zip(names, leaves.values())]


def _abstract(leaf) -> jax.ShapeDtypeStruct:
    """Restore target for one leaf: its shape and dtype, its sharding (default: this process's first device)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = _local_device()
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def _local_device() -> jax.sharding.SingleDeviceSharding:
    """This process's first device (`jax.devices()[0]` belongs to process 0 when there are several)."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _rng_parts(rng) -> tuple[np.ndarray | jax.Array, dict]:
    """A typed jax key array -> (its uint32 key data, {'typed': True, 'impl': name}); raw data passes through."""
    if jax.dtypes.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        return jax.random.key_data(rng), {"typed": True, "impl": str(jax.random.key_impl(rng))}
    return rng, {"typed": False}


class TrainCheckpointer:
    """`run_dir/checkpoints/<step>/{params,opt_state,rng,meta}` via orbax's CheckpointManager."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3, async_save: bool = True):
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least one checkpoint")
        self.directory = Path(os.path.abspath(directory))  # absolute and normalised (no "..")
        self.async_save = async_save
        options = ocp.CheckpointManagerOptions(max_to_keep=keep_last, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=(*_ARRAY_ITEMS, "meta"))

    # --- save ------------------------------------------------------------------------------

    def save(self, step: int, *, params, opt_state, rng, meta: dict) -> None:
        """Write step `step` (in the background when async_save; call wait() before reading it)."""
        key_data, rng_info = _rng_parts(rng)
        items, record = {}, {"user": meta, "rng": rng_info, "trees": {}}
        for name, tree in (("params", params), ("opt_state", opt_state), ("rng", {"key": key_data})):
            leaves, names, _ = _flatten(tree)
            items[name] = ocp.args.StandardSave(leaves)
            record["trees"][name] = _describe(leaves, names)
        try:
            saved = self._manager.save(int(step), args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(record)),
                                       force=True)
        except Exception as err:  # orbax errors on disk problems, a step already present, ...
            raise CheckpointError(f"saving checkpoint step {step} to {self.directory} failed: {err}") from err
        if not saved:
            raise CheckpointError(f"checkpoint step {step} was not saved to {self.directory}")

    def wait(self) -> None:
        """Block until background saves are committed; a failed background save raises CheckpointError."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise CheckpointError(f"a background checkpoint save to {self.directory} failed: {err}") from err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> "TrainCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- inspect ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (temporary directories of unfinished saves are not listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --- restore ---------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, params_target, opt_state_target) -> tuple[Any, Any, Any, dict]:
        """(params, opt_state, rng, meta) of `step` (default: the latest readable one).

        Targets give the structure, dtypes and shardings (arrays or ShapeDtypeStructs). With
        step=None a checkpoint that cannot be read is skipped with a warning naming it, and the
        previous one is tried.
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no committed checkpoint in {self.directory}")
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"checkpoint step {step} not in {self.directory} (available: {steps})")
            return self._restore(step, params_target, opt_state_target)
        for candidate in reversed(steps):
            try:
                return self._restore(candidate, params_target, opt_state_target)
            except _Mismatch:
                raise
            except Exception as err:  # corrupt or partial files: fall back to the previous step
                log.warning("checkpoint step %d in %s could not be restored (%s: %s); trying the previous one",
                            candidate, self.directory, type(err).__name__, str(err).splitlines()[0][:300])
        raise CheckpointError(f"no checkpoint in {self.directory} could be restored (tried steps {steps[::-1]})")

    def read_meta(self, step: int) -> dict:
        """The JSON record of a step (user meta under 'user')."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_tree(self, step: int, item: str, target) -> Any:
        """One array item ('params' / 'opt_state') of `step` into `target`'s structure."""
        return self._restore_items(step, {item: target})[item]

    def _restore(self, step, params_target, opt_state_target):
        record = self.read_meta(step)
        rng_saved = record["trees"]["rng"][0]
        rng_target = jax.ShapeDtypeStruct(tuple(rng_saved["shape"]), np.dtype(rng_saved["dtype"]),
                                          sharding=_local_device())
        out = self._restore_items(step, {"params": params_target, "opt_state": opt_state_target,
                                         "rng": {"key": rng_target}}, record)
        key_data = out["rng"]["key"]
        info = record["rng"]
        rng = jax.random.wrap_key_data(key_data, impl=info["impl"]) if info["typed"] else key_data
        return out["params"], out["opt_state"], rng, record["user"]

    def _restore_items(self, step, targets: dict, record: dict | None = None) -> dict:
        record = record or self.read_meta(step)
        args, treedefs, keys = {}, {}, {}
        for name, target in targets.items():
            leaves, names, treedefs[name] = _flatten(target)
            keys[name] = list(leaves)
            _check_matches(name, step, record["trees"][name], names, leaves)
            args[name] = ocp.args.StandardRestore({k: _abstract(v) for k, v in leaves.items()})
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        return {name: jax.tree_util.tree_unflatten(treedefs[name], [restored[name][k] for k in keys[name]])
                for name in targets}


def _check_matches(item: str, step: int, saved: list[dict], names: list[str], leaves: dict) -> None:
    if len(saved) != len(names) or any(s["path"] != n for s, n in zip(saved, names)):
        saved_names = [s["path"] for s in saved]
        diff = next((i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b), min(len(saved), len(names)))
        have = saved_names[diff] if diff < len(saved_names) else "<end>"
        want = names[diff] if diff < len(names) else "<end>"
        raise _Mismatch(f"checkpoint step {step} {item}: leaf #{diff} is {have!r} in the checkpoint but {want!r} in "
                        f"the restore target ({len(saved_names)} vs {len(names)} leaves)")
    for s, (name, leaf) in zip(saved, leaves.items()):
        if tuple(s["shape"]) != tuple(np.shape(leaf)):
            raise _Mismatch(f"checkpoint step {step} {item}.{s['path']}: shape {tuple(s['shape'])} in the checkpoint, "
                            f"{tuple(np.shape(leaf))} in the restore target")


def export_hf(checkpoint_dir: str | os.PathLike, step: int | None, model, out_dir: str | os.PathLike,
              expert_layout: str | None = None) -> Path:
    """Write the params of checkpoint `step` (default latest) as an HF folder via models.hf.save_pretrained.

    `model` is a Qwen3ForCausalLM of the trained architecture (its values are replaced; it is the
    template for structure, dtypes and shardings).
    """
    from flax import nnx

    from ulorl_jax.models.hf import save_pretrained

    ckpt = TrainCheckpointer(checkpoint_dir, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointError(f"no committed checkpoint in {ckpt.directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointError(f"checkpoint step {step} not in {ckpt.directory} (available: {steps})")
        params = ckpt.restore_tree(step, "params", nnx.state(model, nnx.Param))
    finally:
        ckpt.close()
    nnx.update(model, params)
    save_pretrained(model, out_dir, expert_layout=expert_layout)
    return Path(out_dir)
