"""Hugging Face checkpoints <-> ulorl models, streamed tensor by tensor.

`from_pretrained(path, dtype=..., mesh=None)` reads a local folder
(config.json + model.safetensors or a sharded index). Each tensor is
memory-mapped, converted to our layout as a lazy view, and placed straight
into its target sharding (`jax.make_array_from_callback` reads only each
device's shard), so the host never holds two copies of the model.

`save_pretrained(model, path)` writes a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads with equal logits.

Layout differences (ours <- HF):
  q_proj [D, H, Dh] <- q_proj.weight [H*Dh, D];   o_proj [H, Dh, D] <- o_proj.weight [D, H*Dh]
  dense MLP kernels [in, out] <- weight [out, in];  router [D, E] <- mlp.gate.weight [E, D]
  experts gate / up [E, D, F], down [E, F, D] <- either
    per-expert  mlp.experts.N.{gate,up,down}_proj.weight ([F, D] / [D, F]), or
    fused       mlp.experts.gate_up_proj [E, 2F, D] and mlp.experts.down_proj [E, D, F].
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from ulorl_jax.models.config import ConfigError, ModelConfig
from ulorl_jax.models.qwen3 import Qwen3ForCausalLM
from ulorl_jax.models.safetensors_io import CheckpointError, CheckpointReader, save_safetensors_folder

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass
class TensorMap:
    """One parameter of ours and how it is read from / written to HF tensors."""

    path: tuple  # our nnx path, e.g. ("layers", 0, "self_attn", "q_proj")
    read: Callable[[CheckpointReader], np.ndarray]  # -> lazy view in our layout
    write: Callable[[np.ndarray], dict[str, np.ndarray]]  # our array -> HF tensors


def _t(a: np.ndarray) -> np.ndarray:
    return a.T


def _simple(path, hf_name, hf_shape, to_ours=lambda a: a, to_hf=lambda a: a) -> TensorMap:
    return TensorMap(path, lambda r: to_ours(r.get(hf_name, hf_shape)), lambda a: {hf_name: to_hf(a)})


def detect_expert_layout(reader: CheckpointReader, config: ModelConfig) -> str:
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            prefix = f"model.layers.{layer}.mlp.experts."
            return "fused" if prefix + "gate_up_proj" in reader else "per_expert"
    return config.expert_layout


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """The full name / layout mapping for a model of this config."""
    d, h, k, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    maps = [_simple(("embed_tokens",), "model.embed_tokens.weight", (config.vocab_size, d)),
            _simple(("norm", "scale"), "model.norm.weight", (d,))]
    if not config.tie_word_embeddings:
        maps.append(_simple(("lm_head",), "lm_head.weight", (config.vocab_size, d), _t, _t))
    for i in range(config.num_hidden_layers):
        pre, hf = ("layers", i), f"model.layers.{i}."
        maps += [
            _simple(pre + ("input_layernorm", "scale"), hf + "input_layernorm.weight", (d,)),
            _simple(pre + ("post_attention_layernorm", "scale"), hf + "post_attention_layernorm.weight", (d,)),
            _simple(pre + ("self_attn", "q_norm", "scale"), hf + "self_attn.q_norm.weight", (dh,)),
            _simple(pre + ("self_attn", "k_norm", "scale"), hf + "self_attn.k_norm.weight", (dh,)),
            _simple(pre + ("self_attn", "q_proj"), hf + "self_attn.q_proj.weight", (h * dh, d),
                    lambda a: a.T.reshape(d, h, dh), lambda a: a.reshape(d, h * dh).T),
            _simple(pre + ("self_attn", "o_proj"), hf + "self_attn.o_proj.weight", (d, h * dh),
                    lambda a: a.T.reshape(h, dh, d), lambda a: a.reshape(h * dh, d).T),
        ]
        for name in ("k_proj", "v_proj"):
            maps.append(_simple(pre + ("self_attn", name), hf + f"self_attn.{name}.weight", (k * dh, d),
                                lambda a: a.T.reshape(d, k, dh), lambda a: a.reshape(d, k * dh).T))
        if config.is_moe_layer(i):
            maps += _moe_maps(config, pre + ("mlp",), hf + "mlp.")
        else:
            f = config.intermediate_size
            maps += [
                _simple(pre + ("mlp", "gate_proj"), hf + "mlp.gate_proj.weight", (f, d), _t, _t),
                _simple(pre + ("mlp", "up_proj"), hf + "mlp.up_proj.weight", (f, d), _t, _t),
                _simple(pre + ("mlp", "down_proj"), hf + "mlp.down_proj.weight", (d, f), _t, _t),
            ]
    return maps


def _moe_maps(config: ModelConfig, pre: tuple, hf: str) -> list[TensorMap]:
    d, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    maps = [_simple(pre + ("router",), hf + "gate.weight", (e, d), _t, _t)]
    if config.expert_layout == "fused":
        gate_up, down = hf + "experts.gate_up_proj", hf + "experts.down_proj"
        maps += [
            TensorMap(pre + ("gate",), lambda r: r.get(gate_up, (e, 2 * f, d))[:, :f, :].transpose(0, 2, 1),
                      lambda a: {}),
            TensorMap(pre + ("up",), lambda r: r.get(gate_up, (e, 2 * f, d))[:, f:, :].transpose(0, 2, 1),
                      lambda a: {}),
            _simple(pre + ("down",), down, (e, d, f), lambda a: a.transpose(0, 2, 1), lambda a: a.transpose(0, 2, 1)),
        ]
        return maps

    def stack(name, shape):
        return lambda r: np.stack([r.get(f"{hf}experts.{j}.{name}.weight", shape).T for j in range(e)])

    def unstack(name):
        return lambda a: {f"{hf}experts.{j}.{name}.weight": a[j].T for j in range(e)}

    maps += [TensorMap(pre + ("gate",), stack("gate_proj", (f, d)), unstack("gate_proj")),
             TensorMap(pre + ("up",), stack("up_proj", (f, d)), unstack("up_proj")),
             TensorMap(pre + ("down",), stack("down_proj", (d, f)), unstack("down_proj"))]
    return maps


def load_hf_config(path: str | os.PathLike) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: config.json not found (is this a Hugging Face model folder?)")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({err})") from None


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def from_pretrained(path: str | os.PathLike, dtype: str = "float32", mesh=None, rules=None,
                    **runtime) -> Qwen3ForCausalLM:
    """Load a local HF Qwen3 / Qwen3-MoE folder. `dtype` sets parameter and compute
    dtype (override compute with `compute_dtype=`); `runtime` sets other ModelConfig
    runtime fields (attention_impl, moe_impl)."""
    from ulorl_jax.sharding import spec_for

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder not found: {path}")
    compute_dtype = runtime.pop("compute_dtype", dtype)
    if dtype not in _NP_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; choose one of {sorted(_NP_DTYPES)}")
    config = ModelConfig.from_hf_dict(load_hf_config(path), param_dtype=dtype, dtype=compute_dtype, **runtime)
    reader = CheckpointReader(path)
    config = config.replace(expert_layout=detect_expert_layout(reader, config))
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    np_dtype = _NP_DTYPES[dtype]
    device = jax.devices()[0]
    for tmap in tensor_maps(config):
        var = _get(state, tmap.path)
        name = ".".join(map(str, tmap.path))
        view = tmap.read(reader)
        if tuple(view.shape) != tuple(var.shape):  # should be impossible after the HF shape check
            raise CheckpointError(f"{path}: parameter {name} has shape {view.shape}, expected {var.shape}")
        if mesh is None:
            array = jax.device_put(np.asarray(view, dtype=np_dtype), device)
        else:
            sharding = spec_for(name, var.shape, getattr(var, "logical_axes", None), mesh, rules)
            array = jax.make_array_from_callback(
                var.shape, sharding, lambda idx, v=view: np.asarray(v[idx], dtype=np_dtype))
        var.set_value(array)
        del view
    return nnx.merge(graphdef, state)


def hf_state_dict(model: Qwen3ForCausalLM, expert_layout: str | None = None) -> dict[str, np.ndarray]:
    """All HF tensors of `model` as host numpy arrays (gathered from any sharding)."""
    config = model.config.replace(expert_layout=expert_layout or model.config.expert_layout)
    state = nnx.state(model)
    out: dict[str, np.ndarray] = {}
    gate_up_parts: dict[str, dict[str, np.ndarray]] = {}
    for tmap in tensor_maps(config):
        array = np.asarray(jax.device_get(_get(state, tmap.path)[...]))
        out.update({k: np.ascontiguousarray(v) for k, v in tmap.write(array).items()})
        if config.expert_layout == "fused" and tmap.path[-1] in ("gate", "up"):
            layer = tmap.path[1]
            gate_up_parts.setdefault(f"model.layers.{layer}.mlp.experts.gate_up_proj", {})[tmap.path[-1]] = array
    for name, parts in gate_up_parts.items():  # fused [E, 2F, D]: gate rows first, then up
        out[name] = np.ascontiguousarray(np.concatenate([parts["gate"], parts["up"]], axis=2).transpose(0, 2, 1))
    return out


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, max_shard_size: int = 5 * 2**30,
                    expert_layout: str | None = None) -> Path:
    """Write config.json + safetensors that transformers loads. `expert_layout`
    ('per_expert' | 'fused') defaults to the layout the model was loaded from."""
    path = Path(path)
    tensors = hf_state_dict(model, expert_layout)
    save_safetensors_folder(tensors, path, max_shard_bytes=max_shard_size)
    model.config.to_hf_config().save_pretrained(path)
    return path

