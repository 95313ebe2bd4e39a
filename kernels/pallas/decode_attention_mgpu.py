"""Flash-decoding for Hopper (sm90) with Pallas Mosaic GPU: the successor of the
Pallas Triton ``decode_attention`` kernel (the Triton backend is deprecated as of
jax 0.12).

Same contract as ``decode_attention.decode_attention``: q [B, Hq, D], k_cache /
v_cache [B, S, Hkv, D], lengths [B] (sequence b attends to cache entries
0 .. lengths[b] - 1), optional q_segment_ids [B] / kv_segment_ids [B, S]
(entry s visible only if kv_segment_ids[b, s] == q_segment_ids[b]); a query with
nothing visible outputs 0. Returns [B, Hq, D] in q.dtype.

Layout of the work: grid (num_splits, Hkv, B), one warpgroup (128 threads) per
program. A program holds the G = Hq / Hkv query heads of one kv head as a
[64, D] tile in shared memory (zero-padded to the 64 rows one WGMMA needs), and
walks the k/v blocks of its chunk of the KV axis that lie below lengths[b]:
each [block_k, D] K and V block is brought into shared memory by TMA,
double-buffered (block j + 1 is in flight while block j is computed), then
S = Q K^T and P V run on the tensor cores (WGMMA) with the online softmax in
registers; P is staged through shared memory (see ``_kernel``). Each program writes its chunk's normalised partial output and
log-sum-exp; the same jnp log-sum-exp combine as the Triton kernel merges the
chunks.

Requirements (checked): bf16 or f16; D a multiple of 64; G <= 64; block_k a
multiple of 64. If S is not a multiple of block_k the cache is padded (a copy):
allocate caches in multiples of block_k.

Verification status: the sm90 lowering (Pallas -> Mosaic GPU custom call) is
tested without a GPU on jax >= 0.12 (tests/kernel_tests/test_kernels_mgpu.py), and the
numerics against ``decode_attention_reference`` under jax's Mosaic GPU
interpreter on CPU (``interpret=True`` here). Not yet compiled or run on an
H100/H200; the defaults are untuned. Forward only (inference). Not wired into
``dispatch.decode``.

Needs jax >= 0.12 (``plgpu.kernel(out_type=...)``, ``plgpu.InterpretGPUParams``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .decode_attention import _combine

__all__ = ["decode_attention_mgpu", "default_decode_mgpu_params", "MGPU_DTYPES"]

MGPU_DTYPES = (jnp.bfloat16, jnp.float16)
_ROWS = 64  # WGMMA M: the query group is padded to one warpgroup's 64 rows
_NEG_INF = -1e30  # finite: masked logits must not make exp2(m_prev - m_new) NaN
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def default_decode_mgpu_params() -> dict[str, int]:
    """(num_splits, block_k): untuned guesses for an H100/H200."""
    return dict(num_splits=16, block_k=64)


def _kernel(*refs, scale_log2: float, block_k: int, blocks_per_split: int, n_blocks: int,
            head_dim: int, has_segments: bool):
    """One (split, kv head, batch) program; one warpgroup. Logits are in the log2 domain (exp2).

    Simpler than jax's attention_mgpu on purpose (decode is bound by reading the cache, not by
    the tensor cores): no warp specialisation, WGMMAs awaited where issued, P V summed into the
    running output in registers. Each of those keeps the kernel inside what jax's Mosaic GPU
    interpreter supports (no ``pl.run_state``, shared-memory WGMMA operands only), so the CPU
    test runs the very code that lowers for the GPU.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if has_segments:
        (len_ref, qseg_ref, q_ref, k_ref, v_ref, kseg_ref, o_ref, lse_ref,
         q_smem, k_smem, v_smem, p_smem, kseg_smem, o_smem, lse_smem, q_bar, k_bars, v_bars,
         s_bars) = refs
    else:
        (len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
         q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, q_bar, k_bars, v_bars) = refs
        qseg_ref = kseg_ref = kseg_smem = s_bars = None
    split = lax.axis_index("split")
    head = lax.axis_index("head")
    batch = lax.axis_index("batch")
    length = len_ref[batch]  # scalar int32, already clipped to [0, S]

    # This split owns k blocks [first, last); stop at the sequence length.
    first = split * blocks_per_split
    last = jnp.minimum((split + 1) * blocks_per_split, n_blocks)
    last = jnp.minimum(last, lax.div(length + (block_k - 1), jnp.int32(block_k)))
    steps = jnp.maximum(last - first, 0)

    def fetch(step, slot):
        rows = pl.ds((first + step) * block_k, block_k)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, head], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, head], v_smem.at[slot], v_bars.at[slot])
        if has_segments:
            plgpu.copy_gmem_to_smem(kseg_ref.at[batch, rows], kseg_smem.at[slot], s_bars.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem, q_bar.at[0])

    @pl.when(steps > 0)
    def _():
        fetch(0, 0)

    plgpu.barrier_wait(q_bar.at[0])
    q_seg = qseg_ref[batch] if has_segments else None

    def step_fn(step, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(step, 2)

        @pl.when(step + 1 < steps)
        def _():  # the other slot's previous block was consumed by the last step
            fetch(step + 1, 1 - slot)

        plgpu.barrier_wait(k_bars.at[slot])

        def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_k), jnp.float32)) * scale_log2
        kv_ids = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
        valid = kv_ids + (first + step) * block_k < length
        if has_segments:
            plgpu.barrier_wait(s_bars.at[slot])
            kseg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            valid = valid & (lax.broadcast_in_dim(kseg, (_ROWS, block_k), [1]) == q_seg)
        s = jnp.where(valid, s, _NEG_INF)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_bars.at[slot])

        # P goes through shared memory: WGMMA could read it from registers, but jax's Mosaic GPU
        # interpreter only takes shared-memory operands, and one code path is what the tests check.
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()  # make the register -> smem stores visible to the tensor cores

        def pv_scope(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        # P V into a fresh accumulator (rather than `pl.run_state` on `ACC.init(acc)`, which
        # saves this add but which jax's Mosaic GPU interpreter does not support yet).
        acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((_ROWS, head_dim), jnp.float32))
        return acc, m_new, l_i

    init = (
        plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((_ROWS,), _NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m_i, l_i = lax.fori_loop(0, steps, step_fn, init)

    empty = l_i == 0.0  # nothing visible in this chunk: weight 0 in the combine
    l_safe = jnp.where(empty, 1.0, l_i)
    o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * _LN2)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[batch, head, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, split])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("num_splits", "block_k", "sm_scale", "interpret"))
def decode_attention_mgpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    num_splits: int | None = None,
    block_k: int | None = None,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Split-KV decode attention (flash-decoding) with GQA on Mosaic GPU (Hopper).

    Args: as ``decode_attention.decode_attention`` (q [B, Hq, D]; caches
    [B, S, Hkv, D]; lengths [B]; optional segment ids), except:
      interpret: run jax's Mosaic GPU interpreter (CPU, slow; for tests) instead
        of lowering to a Mosaic GPU kernel. There is no automatic choice: on CPU
        use the Triton kernel's interpret mode or the reference for speed.

    Returns:
      [B, Hq, D] in q.dtype.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, hq, d = q.shape
    b2, s_len, hkv, d2 = k_cache.shape
    if v_cache.shape != k_cache.shape or b2 != b or d2 != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in MGPU_DTYPES:
        raise ValueError(f"q/k/v dtypes must match and be bf16/f16, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    g = hq // hkv
    if g > _ROWS:
        raise ValueError(f"query group {g} (Hq / Hkv) above {_ROWS} is not supported")
    if d % 64:
        raise ValueError(f"head_dim={d} must be a multiple of 64")
    has_segments = q_segment_ids is not None
    if has_segments != (kv_segment_ids is not None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if has_segments and (q_segment_ids.shape != (b,) or kv_segment_ids.shape != (b, s_len)):
        raise ValueError(f"segment ids must be q [B]={(b,)} and kv [B, S]={(b, s_len)}, got "
                         f"{q_segment_ids.shape}, {kv_segment_ids.shape}")
    defaults = default_decode_mgpu_params()
    block_k = defaults["block_k"] if block_k is None else block_k
    num_splits = defaults["num_splits"] if num_splits is None else num_splits
    if block_k < 64 or block_k % 64:
        raise ValueError(f"block_k={block_k} must be a positive multiple of 64")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")

    s_p = -(-s_len // block_k) * block_k
    n_blocks = s_p // block_k
    num_splits = min(num_splits, n_blocks)
    blocks_per_split = -(-n_blocks // num_splits)
    scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)

    # [B, Hq, D] -> [B, Hkv, G, D] is a free reshape (head h = kv_head * G + g).
    qg = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, _ROWS - g), (0, 0)))
    kc, vc = k_cache, v_cache
    if s_p != s_len:
        pad = ((0, 0), (0, s_p - s_len), (0, 0), (0, 0))
        kc, vc = jnp.pad(kc, pad), jnp.pad(vc, pad)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, s_len)

    # 128-byte swizzled tiles, as WGMMA reads its shared-memory operands.
    elems = 128 // jnp.dtype(q.dtype).itemsize
    tiles = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))
    f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((_ROWS, d), q.dtype, transforms=tiles),  # q tile
        plgpu.SMEM((2, block_k, d), q.dtype, transforms=tiles),  # k double buffer
        plgpu.SMEM((2, block_k, d), q.dtype, transforms=tiles),  # v double buffer
        plgpu.SMEM((_ROWS, block_k), q.dtype, transforms=tiles),  # probabilities P
    ]
    if has_segments:
        scratch.append(plgpu.SMEM((2, block_k), jnp.int32))  # kv segment ids
    scratch += [
        plgpu.SMEM((_ROWS, d), jnp.float32, transforms=f32_tiles),  # partial output
        plgpu.SMEM((_ROWS,), jnp.float32),  # partial log-sum-exp
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
    ]
    if has_segments:
        scratch.append(plgpu.Barrier(num_barriers=2))

    args = [lengths]
    if has_segments:
        args.append(q_segment_ids.astype(jnp.int32))
    args += [qg, kc, vc]
    if has_segments:
        kseg = kv_segment_ids.astype(jnp.int32)
        if s_p != s_len:
            kseg = jnp.pad(kseg, ((0, 0), (0, s_p - s_len)))  # past every length anyway
        args.append(kseg)

    kernel = functools.partial(
        _kernel, scale_log2=scale * _LOG2E, block_k=block_k, blocks_per_split=blocks_per_split,
        n_blocks=n_blocks, head_dim=d, has_segments=has_segments)
    o_part, lse_part = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((b, hkv, num_splits, _ROWS, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, num_splits, _ROWS), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(num_splits, hkv, b),
        grid_names=("split", "head", "batch"),
        compiler_params=plgpu.CompilerParams(),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="decode_attention_mgpu",
    )(*args)

    o = _combine(o_part, lse_part)  # [B, Hkv, 64, D] f32
    return o[:, :, :g, :].reshape(b, hq, d).astype(q.dtype)
