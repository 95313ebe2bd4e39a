"""Mosaic GPU (Hopper) decode attention: sm90 lowering without a GPU, and numerics
under jax's Mosaic GPU interpreter on CPU.

The lowering test exports `decode_attention_mgpu` for CUDA on an abstract H100
(kernels/pallas/gpu_target.py) and checks that the module calls a Mosaic GPU
kernel (`mosaic_gpu_v2` custom call) and no Triton kernel: the Pallas -> Mosaic
GPU lowering rejects what Hopper cannot express (WGMMA operand shapes and
layouts, TMA transfer shapes, shared-memory transforms). The interpreter test
runs the same kernel body on CPU (`plgpu.InterpretGPUParams`: simulated shared
memory, TMA copies, barriers and WGMMA) against `decode_attention_reference`.
Neither covers PTX compilation, real-hardware races, or speed: that needs an
H100/H200 run.

Both need jax >= 0.12 (`plgpu.kernel(out_type=...)`, the Mosaic GPU
interpreter); on older jax the module is skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
    pytest.skip(f"Mosaic GPU decode attention needs jax >= 0.12 (plgpu.kernel out_type=, the "
                f"Mosaic GPU interpreter); this is jax {jax.__version__}", allow_module_level=True)

from jax import export  # noqa: E402
from jax.sharding import use_abstract_mesh  # noqa: E402

from ulorl_jax.kernels import decode_attention_reference  # noqa: E402
from ulorl_jax.kernels.decode_attention_mgpu import decode_attention_mgpu  # noqa: E402
from ulorl_jax.kernels.gpu_target import abstract_gpu_mesh  # noqa: E402

MOSAIC_GPU = "mosaic_gpu_v2"
TRITON = "__gpu$xla.gpu.triton"


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _custom_calls(module: str) -> set[str]:
    return {line.split("stablehlo.custom_call @", 1)[1].split("(", 1)[0]
            for line in module.splitlines() if "stablehlo.custom_call @" in line}


@pytest.mark.parametrize("segments", [False, True])
def test_decode_attention_mgpu_lowers_for_sm90(segments):
    b, s, hq, hkv, d = 2, 1000, 8, 2, 128  # cache not a multiple of block_k * num_splits; GQA 4
    args = [_spec((b, hq, d)), _spec((b, s, hkv, d)), _spec((b, s, hkv, d)), _spec((b,), jnp.int32)]
    if segments:
        args += [_spec((b,), jnp.int32), _spec((b, s), jnp.int32)]

    def fn(q, k, v, n, *seg):
        kw = dict(q_segment_ids=seg[0], kv_segment_ids=seg[1]) if seg else {}
        return decode_attention_mgpu(q, k, v, n, **kw)

    with use_abstract_mesh(abstract_gpu_mesh()):
        module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    calls = _custom_calls(module)
    assert MOSAIC_GPU in calls, f"no Mosaic GPU kernel in the lowering: {calls}"
    assert TRITON not in calls


def _inputs(seed, b, s, hq, hkv, d):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


def _max_err(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)).max())


def test_decode_attention_mgpu_interpreted_matches_reference():
    # S = 200 (padded to 256 = 4 blocks of 64), 2 splits of 2 blocks. Lengths: 0 (output 0),
    # 1 key, one past a block edge, one past the first split, the full cache. GQA 3 (padded to 64 rows).
    q, k, v = _inputs(0, 5, 200, 6, 2, 64)
    lengths = jnp.asarray([0, 1, 65, 129, 200], jnp.int32)
    out = decode_attention_mgpu(q, k, v, lengths, num_splits=2, block_k=64, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _max_err(out, decode_attention_reference(q, k, v, lengths)) < 2e-2
    assert not np.asarray(out[0], np.float32).any()  # length 0 -> 0


def test_decode_attention_mgpu_interpreted_segments():
    # Left-padded prompts: segment 0 is padding the query must not see; row 2 sees nothing (-> 0).
    q, k, v = _inputs(1, 3, 192, 4, 1, 128)
    lengths = jnp.asarray([192, 100, 150], jnp.int32)
    pad = jnp.asarray([[5], [70], [1000]])
    q_seg = jnp.asarray([1, 2, 1], jnp.int32)
    kv_seg = jnp.where(jnp.arange(192)[None] < pad, 0, q_seg[:, None]).astype(jnp.int32)
    out = decode_attention_mgpu(q, k, v, lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                num_splits=3, block_k=64, interpret=True)
    ref = decode_attention_reference(q, k, v, lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    assert _max_err(out, ref) < 2e-2
    assert not np.asarray(out[2], np.float32).any()


@pytest.mark.parametrize("kwargs,match", [
    (dict(d=96), "multiple of 64"),
    (dict(dtype=jnp.float32), "bf16/f16"),
    (dict(hq=2 * 65), "above 64"),
    (dict(block_k=32), "multiple of 64"),
])
def test_decode_attention_mgpu_rejects_what_it_cannot_run(kwargs, match):
    d, hq = kwargs.get("d", 64), kwargs.get("hq", 4)
    dtype = kwargs.get("dtype", jnp.bfloat16)
    q = jnp.zeros((1, hq, d), dtype)
    kv = jnp.zeros((1, 64, 2, d), dtype)
    with pytest.raises(ValueError, match=match):
        decode_attention_mgpu(q, kv, kv, jnp.ones((1,), jnp.int32), block_k=kwargs.get("block_k"))
