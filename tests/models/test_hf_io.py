"""HF checkpoint import / export: round trips, transformers reload, sharded files, bf16, bad input."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from hf_utils import hf_logits, random_tokens, save_hf_model
from ulorl_jax.models import ConfigError, init_model, tiny_config
from ulorl_jax.models.hf import from_pretrained, hf_state_dict, save_pretrained
from ulorl_jax.models.safetensors_io import CheckpointError, CheckpointReader


def _tensors(folder) -> dict[str, np.ndarray]:
    reader = CheckpointReader(folder)
    return {name: np.array(reader.get(name)) for name in reader.keys()}


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_round_trip_is_tensor_identical_and_transformers_reloads(tmp_path, model_type):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf = save_hf_model(model_type, src)
    save_pretrained(from_pretrained(src), dst)
    a, b = _tensors(src), _tensors(dst)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    tokens = random_tokens(2, 9)
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-5)


def test_fused_expert_layout_loads_and_round_trips(tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj / down_proj) as found on disk."""
    per_expert, fused, back = tmp_path / "per_expert", tmp_path / "fused", tmp_path / "back"
    hf = save_hf_model("qwen3_moe", per_expert)
    save_pretrained(from_pretrained(per_expert), fused, expert_layout="fused")
    names = _tensors(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    # The fused file is exactly transformers' own parameter layout.
    sd = hf.state_dict()
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        np.testing.assert_array_equal(names[name], sd[name].numpy())
    model = from_pretrained(fused)
    assert model.config.expert_layout == "fused"
    tokens = random_tokens(2, 7)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=1e-4)
    save_pretrained(model, back)
    a, b = _tensors(fused), _tensors(back)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fused).eval()
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-5)


def test_sharded_index_read_and_write(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf = save_hf_model("qwen3_moe", src)
    hf.save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").is_file()
    model = from_pretrained(src)
    save_pretrained(model, dst, max_shard_size=20_000)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = random_tokens(1, 6)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-5)


def test_bfloat16_checkpoint(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf = save_hf_model("qwen3", src)
    hf.to(torch.bfloat16).save_pretrained(src)
    model = from_pretrained(src, dtype="bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    save_pretrained(model, dst)
    a, b = _tensors(src), _tensors(dst)
    for name in a:
        assert b[name].dtype == ml_dtypes.bfloat16 and np.array_equal(a[name].view(np.uint16),
                                                                       b[name].view(np.uint16)), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    assert reloaded.dtype == torch.bfloat16


def test_export_of_fresh_model_loads_in_transformers(tmp_path):
    model = init_model(tiny_config("qwen3_moe", mlp_only_layers=(1,), tie_word_embeddings=True), seed=2)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = random_tokens(2, 8, vocab=128)
    np.testing.assert_allclose(hf_logits(hf, tokens), np.asarray(model(jnp.asarray(tokens))), atol=1e-4)


def test_hf_state_dict_names_match_transformers():
    model = init_model(tiny_config("qwen3_moe"))
    ours = hf_state_dict(model)
    cfg = model.config.to_hf_config()
    hf_names = set(transformers.Qwen3MoeForCausalLM(cfg).state_dict())
    fused = hf_state_dict(model, expert_layout="fused")
    assert set(fused) == hf_names  # transformers' own (fused) parameter names
    assert {n for n in ours if ".experts." not in n} == {n for n in hf_names if ".experts." not in n}


# --- bad input -------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    save_hf_model("qwen3", tmp_path)
    return tmp_path


def test_missing_folder_and_files(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="not found"):
        from_pretrained(tmp_path / "nope")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(checkpoint)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        from_pretrained(checkpoint)


def test_truncated_file(checkpoint):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"truncated.*tensor '.*' needs bytes"):
        from_pretrained(checkpoint)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        from_pretrained(checkpoint)


def test_missing_tensor(checkpoint):
    tensors = _tensors(checkpoint)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    from ulorl_jax.models.safetensors_io import write_safetensors
    write_safetensors(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' is missing"):
        from_pretrained(checkpoint)


def test_wrong_shape(checkpoint):
    tensors = _tensors(checkpoint)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((5, 32), np.float32)
    from ulorl_jax.models.safetensors_io import write_safetensors
    write_safetensors(tensors, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.weight' has shape \(5, 32\), expected \(48, 32\)"):
        from_pretrained(checkpoint)


def test_sharded_index_pointing_at_missing_file(tmp_path):
    hf = save_hf_model("qwen3", tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"file not found: .*{shards[-1].name}"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type='llama' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}}, "rope_type='dynamic'"),
])
def test_unsupported_config(checkpoint, change, message):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg.update(change)
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        from_pretrained(checkpoint)


def test_bad_dtype_option(checkpoint):
    with pytest.raises(ConfigError, match="dtype='int8'"):
        from_pretrained(checkpoint, dtype="int8")


def test_legacy_rope_keys_parse():
    """transformers 4.x style: rope_theta top level, rope_scaling dict with `type`."""
    from ulorl_jax.models.config import ModelConfig

    hf = dict(model_type="qwen3", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, intermediate_size=16, rope_theta=5e5,
              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
