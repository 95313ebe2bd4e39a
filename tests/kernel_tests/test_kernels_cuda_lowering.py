"""The Pallas kernels lower for CUDA (Pallas -> Triton IR) on a machine without a GPU.

`jax.export(..., platforms=["cuda"])` runs the real GPU lowering path: Pallas'
Triton lowering turns every kernel body into a Triton module (a
`__gpu$xla.gpu.triton` custom call holding the serialized IR). That lowering
rejects what Triton cannot express (block shapes, unsupported ops, dtype
mixes), so these tests catch a kernel that only works in interpret mode long
before a GPU run. What they do not cover: Triton -> PTX compilation, numerics
and speed on a real GPU (benchmarks/attention.py does those on a GPU host).

jax >= 0.12 asks which GPU it lowers for (the compute capability Triton targets)
and, without a local GPU, raises "No supported GPU devices found, please
specify an abstract GPU device using AbstractDevice". `_cuda_module` names one:
it exports inside `jax.sharding.use_abstract_mesh(abstract_gpu_mesh())`, a
one-device abstract mesh on an H100 `AbstractDevice` (sm90; see
kernels/pallas/gpu_target.py). jax 0.10.x ignores the abstract device and
lowers for sm90 when no GPU is present, so one code path serves both.

Shapes use the GPU default block sizes, bf16, GQA and lengths that are not
multiples of the blocks, so the padded paths lower too.

Every Triton module is also run through MLIR's verifier as it is built
(`_verified_triton_modules`). The GPU parses the module and verifies it before
compiling; an op that lowers but does not verify (an `scf.for` whose bounds have
different types: the grouped matmul's, found on the first H200 run) fails there
with "Failed to parse Triton module", and fails here too.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import use_abstract_mesh

try:  # the hook where Pallas builds each Triton module (jax internals, checked in _verified_triton_modules)
    from jax._src.pallas.triton import pallas_call_registration as _triton_registration
except ImportError:  # pragma: no cover - depends on the jax version
    _triton_registration = None

from ulorl_jax.kernels import (
    decode_attention,
    flash_attention,
    grouped_matmul,
    paged_decode_attention,
)
from ulorl_jax.kernels.decode_attention import default_decode_params
from ulorl_jax.kernels.flash_attention import default_block_sizes
from ulorl_jax.kernels.gpu_target import abstract_gpu_mesh
from ulorl_jax.kernels.grouped_matmul import default_gmm_block_sizes
from ulorl_jax.kernels.paged_decode_attention import default_paged_decode_params

TRITON = "__gpu$xla.gpu.triton"
# The one way to run this file's tests without the verifier hook: set it to 1 (never in CI). A skip here
# would turn the whole file green on a jax that moved the hook, so a missing hook fails unless opted out.
SKIP_ENV = "ULORL_SKIP_TRITON_VERIFY"


def triton_hook_missing(jax_version: str, opt_out: str | None) -> None:
    """Fails (skips only with SKIP_ENV=1) when jax no longer has the hook _verified_triton_modules patches."""
    message = (f"jax {jax_version} moved Pallas' Triton lowering hook (jax._src.pallas.triton."
               "pallas_call_registration.lowering.lower_jaxpr_to_triton_module), so the Triton modules cannot "
               "be verified: point _verified_triton_modules in tests/kernel_tests/test_kernels_cuda_lowering.py "
               f"at the new hook, or set {SKIP_ENV}=1 to skip these tests on this jax")
    if opt_out == "1":
        pytest.skip(message)
    pytest.fail(message)


@pytest.fixture(autouse=True)
def _verified_triton_modules(monkeypatch):
    """Runs MLIR's verifier on every Triton module Pallas builds while a test lowers; a module that
    fails (as the GPU's parser would reject it) fails the test with the verifier's message."""
    lower = getattr(getattr(_triton_registration, "lowering", None), "lower_jaxpr_to_triton_module", None)
    if lower is None:
        triton_hook_missing(jax.__version__, os.environ.get(SKIP_ENV))
    failures = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        try:
            result.module.operation.verify()
        except Exception as e:  # MLIRError: the verifier's diagnostics
            failures.append(str(e).splitlines()[0][:400])
        return result

    monkeypatch.setattr(_triton_registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    yield failures
    assert not failures, f"Triton modules that do not verify: {failures}"


def _cuda_module(fn, *args) -> str:
    """StableHLO text of `fn` lowered for CUDA on an abstract H100 (Triton custom calls allowed)."""
    with use_abstract_mesh(abstract_gpu_mesh()):
        exported = export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exported.mlir_module()


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _triton_kernels(module: str) -> set[str]:
    """Names of the Triton kernels called in a lowered module."""
    names = set()
    for line in module.splitlines():
        if TRITON in line and 'name = "' in line:
            names.add(line.split('name = "', 1)[1].split('"', 1)[0])
    return names


@pytest.mark.parametrize("causal,segments", [(True, False), (False, False), (True, True)])
def test_flash_attention_forward_and_backward_lower_to_triton(causal, segments):
    blocks = default_block_sizes("gpu")
    b, t, hq, hkv, d = 1, 200, 8, 2, 128  # 200: not a multiple of the 64 blocks; GQA 4
    q, kv = _spec((b, t, hq, d)), _spec((b, t, hkv, d))
    seg = _spec((b, t), jnp.int32) if segments else None

    def loss(q, k, v, *seg_ids):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg_ids[0] if seg_ids else None,
                              interpret=False, **blocks)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    args = (q, kv, kv) + ((seg,) if segments else ())
    forward = _triton_kernels(_cuda_module(loss, *args))
    assert forward, "no Triton kernel in the forward lowering"
    grads = _triton_kernels(_cuda_module(jax.grad(loss, argnums=(0, 1, 2)), *args))
    assert len(grads) >= 3, f"forward + dq + dk/dv kernels expected in the backward lowering, got {grads}"


def test_decode_attention_lowers_to_triton():
    params = default_decode_params("gpu")
    b, s, hq, hkv, d = 2, 1000, 8, 2, 128  # cache not a multiple of block_k * num_splits
    fn = lambda q, k, v, n: decode_attention(q, k, v, n, interpret=False, **params)  # noqa: E731
    module = _cuda_module(fn, _spec((b, hq, d)), _spec((b, s, hkv, d)), _spec((b, s, hkv, d)),
                          _spec((b,), jnp.int32))
    assert _triton_kernels(module), "no Triton kernel in the decode attention lowering"


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_attention_lowers_to_triton(page_size):
    params = default_paged_decode_params("gpu")
    # Pool and table width not powers of two; table width not a multiple of num_splits; GQA 4.
    b, hq, hkv, d, pages, width = 2, 8, 2, 128, 37, 13
    pool = _spec((pages, page_size, hkv, d))
    fn = lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, interpret=False, **params)  # noqa: E731
    module = _cuda_module(fn, _spec((b, hq, d)), pool, pool, _spec((b, width), jnp.int32), _spec((b,), jnp.int32))
    assert _triton_kernels(module) == {"paged_decode_attention_split_kv"}, "the paged kernel did not lower to Triton"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_matmul_and_its_gradients_lower_to_triton(dtype):
    blocks = default_gmm_block_sizes("gpu")
    m, k, n, g = 300, 192, 256, 8  # rows not a multiple of block_m

    def loss(lhs, rhs, sizes):
        out = grouped_matmul(lhs, rhs, sizes, interpret=False, **blocks)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    args = (_spec((m, k), dtype), _spec((g, k, n), dtype), _spec((g,), jnp.int32))
    assert _triton_kernels(_cuda_module(loss, *args))
    grads = _triton_kernels(_cuda_module(jax.grad(loss, argnums=(0, 1)), *args))
    assert len(grads) >= 2, f"d_lhs (grouped matmul) and d_rhs (transposed grouped matmul) expected, got {grads}"


def test_a_moved_hook_fails_unless_opted_out():
    """If jax moves the hook, the fixture must not skip the whole file quietly: it fails, naming the hook, the
    file to fix and the opt-out variable; only the explicit opt-out skips."""
    outcomes = {}
    for opt_out in (None, "true", "1"):  # only "1" opts out
        # Both outcomes caught here: a skip escaping this test would itself pass as "skipped".
        with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as info:
            triton_hook_missing("9.9.9", opt_out)
        outcomes[opt_out] = (info.type.__name__, str(info.value))
    assert [kind for kind, _ in outcomes.values()] == ["Failed", "Failed", "Skipped"], outcomes
    for _, message in outcomes.values():
        assert "jax 9.9.9 moved Pallas' Triton lowering hook" in message and f"{SKIP_ENV}=1" in message
        assert "tests/kernel_tests/test_kernels_cuda_lowering.py" in message
