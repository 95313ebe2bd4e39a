"""Our own model folders: `model_config.json` + an orbax (tensorstore) parameter tree.

This is the format `ulorl convert` produces from HF folders and the one later
training checkpoints embed. Restores go straight into the requested sharding.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ulorl_jax.models.config import ModelConfig
from ulorl_jax.models.qwen3 import Qwen3ForCausalLM
from ulorl_jax.models.safetensors_io import CheckpointError

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"


def is_native(path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_native(model: Qwen3ForCausalLM, path) -> Path:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    if (path / PARAMS_DIR).exists():
        raise CheckpointError(f"{path / PARAMS_DIR} already exists; refusing to overwrite")
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, nnx.to_pure_dict(state))
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    return path


def load_native(path, mesh=None, rules=None, **runtime) -> Qwen3ForCausalLM:
    from ulorl_jax.sharding import param_shardings

    path = Path(path).absolute()
    if not is_native(path):
        raise CheckpointError(f"{path}: no {CONFIG_FILE} (not a ulorl model folder)")
    fields = json.loads((path / CONFIG_FILE).read_text())
    fields["mlp_only_layers"] = tuple(fields.get("mlp_only_layers", ()))
    config = ModelConfig(**{**fields, **runtime})
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, state)
    else:
        shardings = param_shardings(state, mesh, rules)
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), state, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / PARAMS_DIR, nnx.to_pure_dict(target))
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def load_any(path, dtype: str | None = None, mesh=None, **runtime) -> Qwen3ForCausalLM:
    """A ulorl folder or an HF folder, whichever `path` is."""
    from ulorl_jax.models.hf import from_pretrained

    if is_native(path):
        if dtype is not None:
            runtime.update(param_dtype=dtype, dtype=dtype)
        return load_native(path, mesh=mesh, **runtime)
    return from_pretrained(path, dtype=dtype or "float32", mesh=mesh, **runtime)
