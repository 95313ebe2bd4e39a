"""PolicyEngine: our Qwen3 policy behind JetStream's Engine API.

Method and argument names follow `jetstream.engine.engine_api.Engine`
(prefill / insert / generate / load_params / init_decode_state / ...), and
`ResultTokens` has JetStream's fields and methods, so JetStream's orchestrator
can drive this engine (`register_as_jetstream_engine`). Nothing here imports
jetstream.

- Slots: one pre-allocated KV cache [max_concurrent_decodes, max_cache_len];
  `insert` writes a prefilled prompt into one slot row, so a finished slot is
  refilled without waiting for the others (continuous batching, `run`).
- Params are an explicit argument of every jitted function: a new params
  pytree of the same structure (new weights every RL step) never recompiles.
- Prefill pads prompts to a length bucket (one compile per bucket); prompts
  longer than `max_prefill_length`, empty prompts and unknown token ids raise.
- Batched prefill (`prefill_many`, used by `run`): many requests per jitted call, padded to
  the bucket of the call's longest, rows (a power of four, or the most that fit) x bucket <=
  prefill_token_budget tokens per call, split where a second call saves more padding than it
  costs (`plan_prefill`), written
  straight into their slots in the same call (no per-request insert). Requests with equal prompts
  (a group's n samples) share one prefill row: its KV is copied to each sample's slot and each
  samples its first token with its own key. JetStream's one-request `prefill` / `insert` stay as
  they are for its orchestrator and `ulorl serve`.
- The KV cache layout (slot rows today) is reached only through `decode/cache_layout.py`.
- Per-slot RNG keys, generated counts, budgets and done flags live in the
  decode state, so a request's tokens do not depend on which slot it got.
- `generate_steps` runs several decode steps in one jit (`lax.scan`): on small
  models per-token Python dispatch would dominate.
- `mesh` (a `sharding.make_mesh` mesh): every jitted function is traced under it
  (`sharding.mesh_context`), so the MoE runs expert-parallel and Pallas attention
  one kernel call per (slot, head) block, as in the learner; the decode state is
  kept with its slots over the data axes and the KV cache's heads over `tensor`.
  Pass params sharded on the same mesh (`decode/placement.py` builds both). `run` spreads
  its requests over the slot shards (devices), least busy first.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ulorl_jax.buckets import pow2_ceil
from ulorl_jax.choices import KV_CACHES, PREEMPTIONS
from ulorl_jax.decode import cache_layout
from ulorl_jax.decode.page_pool import PagePool, pages_for
from ulorl_jax.decode.sampling import SamplingParams, sample_tokens
from ulorl_jax.models.qwen3 import KVCache, Qwen3ForCausalLM
from ulorl_jax.sharding import (
    MESH_AXES,
    axis_size,
    batch_axes_for,
    mesh_context,
)

# --------------------------------------------------------------------------------------
# JetStream-shaped result containers (same fields / methods as jetstream's engine_api).


@struct.dataclass
class SlotData:
    tokens: Any  # [samples_per_slot, 1]
    valid: Any  # [samples_per_slot, 1]
    lengths: Any  # [samples_per_slot]


@struct.dataclass
class ResultTokens:
    """As JetStream's: one array [B, 3] = (token, valid, length) so one host copy fetches all."""

    data: Any
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
    valid_idx: tuple[int, int] = struct.field(pytree_node=False)
    length_idx: tuple[int, int] = struct.field(pytree_node=False)
    samples_per_slot: int = struct.field(pytree_node=False)

    def copy_to_host_async(self) -> None:
        if not isinstance(self.data, np.ndarray):
            self.data.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return ResultTokens(np.array(self.data), self.tokens_idx, self.valid_idx, self.length_idx,
                            self.samples_per_slot)

    def get_result_at_slot(self, slot: int) -> SlotData:
        a, b = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        return SlotData(tokens=self.data[a:b, self.tokens_idx[0]:self.tokens_idx[1]],
                        valid=self.data[a:b, self.valid_idx[0]:self.valid_idx[1]],
                        lengths=self.data[a:b, self.length_idx[0]:self.length_idx[1]][:, 0])


def _result_tokens(tokens, valid, lengths) -> ResultTokens:
    data = jnp.stack([tokens.astype(jnp.int32), valid.astype(jnp.int32), lengths.astype(jnp.int32)], axis=1)
    return ResultTokens(data, (0, 1), (1, 2), (2, 3), 1)  # [B, 3]


# --------------------------------------------------------------------------------------
# Engine state.


class Prefix(NamedTuple):
    """A prefilled request (batch 1), ready to `insert` into a slot."""

    cache: KVCache  # [1, L] with index = true length
    token: jnp.ndarray  # [] int32: first generated token
    logprob: jnp.ndarray  # [] f32 (convention in sampling.py)
    sampling_logprob: jnp.ndarray  # [] f32
    key: jnp.ndarray  # [2] uint32: the request's RNG after sampling `token`
    budget: jnp.ndarray  # [] int32: max tokens this request may generate (>= 1)
    done: jnp.ndarray  # [] bool: `token` already ends the request (EOS or budget 1)


class DecodeState(NamedTuple):
    cache: KVCache  # [B, S]
    tokens: jnp.ndarray  # [B] int32: last generated token = next input
    keys: jnp.ndarray  # [B, 2] uint32 per-slot RNG
    lengths: jnp.ndarray  # [B] int32: tokens generated in the slot (incl. the prefill one)
    budget: jnp.ndarray  # [B] int32: the slot stops at lengths == budget
    done: jnp.ndarray  # [B] bool: empty or finished slot (generates nothing)
    logprobs: jnp.ndarray  # [B] f32 of the last generated token
    sampling_logprobs: jnp.ndarray  # [B] f32


class Resume(NamedTuple):
    """Per batched-prefill entry [R, F]: where `flag` is set, the entry continues a preempted sample (its
    row is the prompt plus every generated token but the last) instead of sampling a first token: it
    takes back its last token, log-probs, count of generated tokens and RNG key (passed as the entry's
    key), so it goes on exactly where it stopped."""

    flag: jnp.ndarray  # bool
    token: jnp.ndarray  # int32
    length: jnp.ndarray  # int32: tokens generated so far
    logprob: jnp.ndarray  # f32
    sampling_logprob: jnp.ndarray  # f32


class SlotRow(NamedTuple):
    """One slot's decode state besides its KV pages: what a swapped-out sample takes with it (host numpy)."""

    token: Any
    key: Any
    length: Any
    budget: Any
    logprob: Any
    sampling_logprob: Any
    index: Any  # cached positions
    position: Any  # RoPE position of the next token


class Swapped(NamedTuple):
    """A sample preempted with preemption="swap": its cached positions' pages (per layer, [n, page, K, Dh],
    host numpy) and its slot's row. Swapped back in, its slot holds exactly what it held."""

    k: tuple
    v: tuple
    row: SlotRow


class StepsOutput(NamedTuple):
    tokens: jnp.ndarray  # [B, N] int32
    logprobs: jnp.ndarray  # [B, N] f32
    sampling_logprobs: jnp.ndarray  # [B, N] f32
    valid: jnp.ndarray  # [B, N] bool: slot was generating at this step


def _as_raw_key(key) -> jnp.ndarray:
    if isinstance(key, int):
        return jax.random.PRNGKey(key)
    key = jnp.asarray(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return key.astype(jnp.uint32)


DEFAULT_PAGE_SIZE = 64  # positions per KV page (paged cache)
# Paged cache: a request is admitted only if the samples in flight keep pages to grow into for this many
# decode calls (bench kv, 16 slots: 49 preemptions with none kept, 8 with 4 calls, 2 with 16 calls but
# fewer samples in flight).
ADMIT_LOOKAHEAD_CALLS = 4
# preemption="swap": at most this much KV (bytes, all layers) copied per call between the pool and host memory,
# the copy's transient device memory (Qwen3-30B-A3B, 96 KiB per position: 256 MiB is 42 pages of 64)
SWAP_CHUNK_BYTES = 256 << 20
DEFAULT_PREFILL_TOKEN_BUDGET = 4096  # padded tokens per batched prefill call (see PolicyEngine.prefill_many)
# A prefill call's fixed cost in padded tokens (plan_prefill): dispatch, and reading every weight once,
# which for bf16 weights costs about as long as computing a ridge-point's worth of tokens (~200 on an
# H200: 989 TFLOP/s over 4.8 TB/s, 2 FLOPs per weight per token); measured on the CPU's tiny bench model,
# a call costs about as much as 200 padded tokens too.
PREFILL_CALL_COST_TOKENS = 256


def _pow4_ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 4
    return p


def _host_key(key) -> np.ndarray:
    """A request's key as raw uint32 [2] on the host (batched prefill ships keys in one array).

    An int seed in [0, 2^31) under the default threefry2x32 keys is `[0, seed]`, as `jax.random.PRNGKey`
    makes it (tested bit for bit), written here without its two eager dispatches and device round trip:
    0.17 ms per request on a CPU, 11 ms of every `ulorl bench kv` run. Anything else goes through jax."""
    if isinstance(key, np.ndarray) and key.dtype == np.uint32 and key.shape == (2,):
        return key
    if (isinstance(key, (int, np.integer)) and not isinstance(key, bool) and 0 <= key < 2**31
            and jax.config.jax_default_prng_impl == "threefry2x32"):
        return np.array([0, key], np.uint32)
    if isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == (2,):
        return np.asarray(key)
    return np.asarray(_as_raw_key(key))


def default_prefill_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest`, capped by (and ending at) max_prefill_length."""
    buckets, b = [], smallest
    while b < max_prefill_length:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_prefill_length,)


# --------------------------------------------------------------------------------------
# Pure step functions (jitted by the engine; `model` is merged from params inside).


def _eos_hit(tokens: jnp.ndarray, eos_ids: tuple[int, ...]) -> jnp.ndarray:
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit = hit | (tokens == e)
    return hit


def _prefill_impl(graphdef, rest, params, tokens, true_length, cache, key, budget, *, sampling, eos_ids):
    """tokens [1, L] (right-padded), cache [1, S >= index + L]. Returns a Prefix."""
    model = nnx.merge(graphdef, params, rest)
    start = cache.index  # [1]
    mask = (jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] < true_length).astype(jnp.int32)  # [1, L]
    logits, cache = model.decode_step(tokens, cache, attention_mask=mask)  # [1, L, V]
    last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, axis=0, keepdims=True)  # [1, V]
    key, sub = jax.random.split(key)
    tok, lp, slp = sample_tokens(last, sub[None], sampling)
    # Padding took cache slots past the prompt: rewind so decoding overwrites them.
    cache = cache._replace(index=start + true_length)
    done = _eos_hit(tok, eos_ids)[0] | (budget <= 1)
    return Prefix(cache, tok[0], lp[0], slp[0], key, budget, done)


def _prefill_rows_impl(graphdef, rest, params, state: DecodeState, tokens, lengths, slots, keys, budgets,
                       resume: Resume, *, sampling, eos_ids):
    """Batched prefill + insert in one call. tokens [R, L] (right-padded), lengths [R]; every row is a
    distinct prompt and feeds up to F slots (a group's samples share one prefill): slots [R, F] (>= B:
    unused), keys [R, F, 2], budgets [R, F]. Each entry samples its first token from its row's last
    logits with its own key, exactly as `_prefill_impl` does for one request, unless `resume` says it
    continues a preempted sample.
    Returns (state, (tokens, logprobs, sampling_logprobs, done), each [R, F])."""
    model = nnx.merge(graphdef, params, rest)
    r, length = tokens.shape
    f = slots.shape[1]
    mask = (jnp.arange(length, dtype=jnp.int32)[None, :] < lengths[:, None]).astype(jnp.int32)  # [R, L]
    logits, rows = model.decode_step(tokens, cache_layout.prefill_cache(model, r, length), attention_mask=mask)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [R, V]
    # Rewind past the padding, as `_prefill_impl` does: decoding overwrites it.
    rows = rows._replace(index=lengths, position=lengths)
    split = jax.vmap(jax.random.split)(keys.reshape(r * f, 2))  # [R*F, 2, 2]
    tok, lp, slp = sample_tokens(jnp.repeat(last, f, axis=0), split[:, 1], sampling)  # each [R*F]
    flat = slots.reshape(-1)
    budget = budgets.reshape(-1)
    done = _eos_hit(tok, eos_ids) | (budget <= 1)
    again = resume.flag.reshape(-1)
    tok = jnp.where(again, resume.token.reshape(-1), tok)
    lp = jnp.where(again, resume.logprob.reshape(-1), lp)
    slp = jnp.where(again, resume.sampling_logprob.reshape(-1), slp)
    done = done & ~again
    generated = jnp.where(again, resume.length.reshape(-1), 1)
    next_keys = jnp.where(again[:, None], keys.reshape(r * f, 2), split[:, 0])
    cache = state.cache
    for j in range(f):  # F scatters of the rows' size; unused entries (slot >= B) drop
        cache = cache_layout.insert_rows(cache, rows, slots[:, j])
    put = lambda a, v: a.at[flat].set(v.astype(a.dtype), mode="drop")  # noqa: E731
    new = DecodeState(cache=cache, tokens=put(state.tokens, tok), keys=put(state.keys, next_keys),
                      lengths=put(state.lengths, generated), budget=put(state.budget, budget),
                      done=put(state.done, done), logprobs=put(state.logprobs, lp),
                      sampling_logprobs=put(state.sampling_logprobs, slp))
    shape = slots.shape
    return _laid_out(new), (tok.reshape(shape), lp.reshape(shape), slp.reshape(shape), done.reshape(shape))


def decode_state_specs(state: DecodeState, mesh) -> DecodeState:
    """PartitionSpecs of a decode state on `mesh`: slots over the data axes that divide them, the KV
    cache as `cache_layout.cache_specs` lays it out, everything else replicated."""
    rows = batch_axes_for(state.tokens.shape[0], mesh) or None
    per_slot = lambda x: P(rows, *([None] * (x.ndim - 1)))  # noqa: E731
    specs = jax.tree.map(per_slot, state)
    return specs._replace(cache=cache_layout.cache_specs(state.cache, mesh, rows))


def _laid_out(state: DecodeState) -> DecodeState:
    """Under a mesh context (one device included), pin the state to `decode_state_specs`: a stable layout,
    so no resharding and no recompile between calls (left to propagation, a one-device mesh's state came
    back laid out as whichever parameter it met, a new signature, and a compile, call after call);
    otherwise unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return state
    return jax.tree.map(lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)),
                        state, decode_state_specs(state, mesh))


def _with_slot(state: DecodeState, slot, cache, token, key, length, budget, done, logprob,
               sampling_logprob) -> DecodeState:
    """`state` with `cache` and slot `slot`'s per-slot fields set, in the engine's layout."""
    put = lambda x, value: x.at[slot].set(value)  # noqa: E731
    return _laid_out(DecodeState(cache=cache, tokens=put(state.tokens, token), keys=put(state.keys, key),
                                 lengths=put(state.lengths, length), budget=put(state.budget, budget),
                                 done=put(state.done, done), logprobs=put(state.logprobs, logprob),
                                 sampling_logprobs=put(state.sampling_logprobs, sampling_logprob)))


def _insert_impl(prefix: Prefix, state: DecodeState, slot) -> DecodeState:
    return _with_slot(state, slot, cache_layout.insert_prefix(state.cache, prefix.cache, slot), prefix.token,
                      prefix.key, 1, prefix.budget, prefix.done, prefix.logprob, prefix.sampling_logprob)


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` with zero rows appended up to `rows` along its first axis."""
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


def _swap_out_impl(state: DecodeState, slot, pages):
    """Slot `slot`'s row and pool pages `pages` [C] of every layer (ids past the pool read its last page; the
    caller drops them)."""
    take = lambda pool: jnp.take(pool, pages, axis=0, mode="clip")  # noqa: E731
    row = SlotRow(state.tokens[slot], state.keys[slot], state.lengths[slot], state.budget[slot],
                  state.logprobs[slot], state.sampling_logprobs[slot], state.cache.index[slot],
                  state.cache.position[slot])
    return tuple(map(take, state.cache.k)), tuple(map(take, state.cache.v)), row


def _swap_in_impl(state: DecodeState, slot, pages, k, v, row: SlotRow) -> DecodeState:
    """`k` / `v` (per layer [C, page, K, Dh]) into pool pages `pages` [C] (ids past the pool are dropped), and
    slot `slot` generating again from `row` (its pages in the page table)."""
    put = lambda pool, x: pool.at[pages].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
    cache = state.cache
    cache = cache._replace(k=tuple(map(put, cache.k, k)), v=tuple(map(put, cache.v, v)),
                           index=cache.index.at[slot].set(row.index),
                           position=cache.position.at[slot].set(row.position))
    return _with_slot(state, slot, cache, row.token, row.key, row.length, row.budget, False, row.logprob,
                      row.sampling_logprob)


def _generate_impl(graphdef, rest, params, state: DecodeState, *, sampling, eos_ids):
    """One decode step for every slot; finished slots compute but change nothing."""
    model = nnx.merge(graphdef, params, rest)
    active = ~state.done  # [B]
    old = state.cache
    logits, cache = model.decode_step(state.tokens[:, None], old, attention_mask=active[:, None])  # [B, 1, V]
    cache = cache._replace(index=jnp.where(active, cache.index, old.index))  # idle slots keep their place
    if sampling.greedy:  # draws nothing: the keys stay (splitting them is a rolled threefry loop on CPU)
        tok, lp, slp = sample_tokens(logits[:, 0], state.keys, sampling)
        keys = state.keys
    else:
        split = jax.vmap(jax.random.split)(state.keys)  # [B, 2, 2]
        tok, lp, slp = sample_tokens(logits[:, 0], split[:, 1], sampling)
        keys = jnp.where(active[:, None], split[:, 0], state.keys)
    lengths = state.lengths + active.astype(jnp.int32)
    done = state.done | (active & (_eos_hit(tok, eos_ids) | (lengths >= state.budget)))
    new = DecodeState(cache, jnp.where(active, tok, state.tokens), keys, lengths, state.budget, done,
                      jnp.where(active, lp, state.logprobs), jnp.where(active, slp, state.sampling_logprobs))
    return _laid_out(new), (tok, lp, slp, active)


def _generate_steps_impl(graphdef, rest, params, state, *, num_steps, sampling, eos_ids):
    def body(st, _):
        return _generate_impl(graphdef, rest, params, st, sampling=sampling, eos_ids=eos_ids)

    state, (tok, lp, slp, valid) = jax.lax.scan(body, state, None, length=num_steps)  # each [N, B]
    return state, StepsOutput(tok.T, lp.T, slp.T, valid.T)


# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    """One prompt to continue for at most `max_new_tokens` tokens (host side of `run`)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    key: Any  # PRNG key (int seed, raw [2] uint32 or typed)


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    stop: str  # "eos" (EOS id), "stop" (stop sequence) or "budget" (max_new_tokens used)


@dataclasses.dataclass
class PrefillResult:
    """Host copy of what `prefill_many` did: per request (in the order given) its first token, log-probs
    and whether that token already ends it; and what it cost."""

    tokens: np.ndarray  # [N] int32
    logprobs: np.ndarray  # [N] f32
    sampling_logprobs: np.ndarray  # [N] f32
    done: np.ndarray  # [N] bool
    calls: int  # jitted calls
    rows: int  # distinct prompts prefilled
    tokens_prefilled: int  # real tokens of those rows
    padded_tokens: int  # sum over calls of rows x length (what the calls computed)


@dataclasses.dataclass
class RunStats:
    tokens_decoded: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefills: int = 0  # requests prefilled
    prefill_calls: int = 0  # jitted prefill calls (batched: many requests per call)
    prefill_rows: int = 0  # distinct prompts prefilled (a group's samples share one row)
    prefill_tokens: int = 0  # real prompt tokens run through prefill (shared rows counted once)
    generate_calls: int = 0
    slot_steps_used: int = 0  # sum over decode steps of generating slots
    slot_steps_total: int = 0  # decode steps x slots
    decode_devices: int = 0  # devices that held distinct slots of the decode state
    decode_steps: int = 0  # decode steps run (calls x steps per call)
    preemptions: int = 0  # samples preempted for want of KV pages (paged cache)
    swap_seconds: float = 0.0  # preemption="swap": copying preempted samples' pages out and back in
    kv_pages: int = 0  # the paged cache's pool (0: dense cache)
    peak_pages: int = 0  # most pages in use at once

    @property
    def in_flight(self) -> float:
        """Mean samples decoding per decode step."""
        return self.slot_steps_used / self.decode_steps if self.decode_steps else 0.0

    @property
    def slot_occupancy(self) -> float:
        return self.slot_steps_used / self.slot_steps_total if self.slot_steps_total else 0.0


def _ends_with_stop(tokens: list[int], stop_sequences) -> bool:
    return any(len(s) and len(tokens) >= len(s) and tokens[-len(s):] == list(s) for s in stop_sequences)


class PolicyEngine:
    """JetStream-style engine over a `Qwen3ForCausalLM` (see module doc)."""

    def __init__(self, model: Qwen3ForCausalLM, *, max_concurrent_decodes: int, max_prefill_length: int,
                 max_cache_len: int, prefill_buckets: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Sequence[int] = (),
                 mesh: jax.sharding.Mesh | None = None, tokenizer: Any = None,
                 prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET, kv_cache: str = "dense",
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 prefill_fanout: int | None = None, preemption: str = "recompute"):
        """`prefill_fanout`: slots one batched prefill row serves (requests with equal prompts, a group's n
        samples, share a row; a larger group takes several rows). Give the rollout's n: each width is its
        own set of compiled prefill shapes. None: as wide as the largest group seen so far.

        `preemption` (paged cache, `run`): what happens to a sample preempted when the pool runs out.
        "recompute": its pages are freed and it is prefilled again from its prompt + tokens so far when
        pages free up (costs a prefill of that length). "swap": its cached pages are copied to host memory
        and back into fresh pages when it is readmitted (costs host memory, a sample's KV size, while it
        waits; and two copies, no model compute). Tokens equal a run with enough pages either way."""
        for name, v in (("max_concurrent_decodes", max_concurrent_decodes),
                        ("max_prefill_length", max_prefill_length), ("max_cache_len", max_cache_len),
                        ("prefill_token_budget", prefill_token_budget), ("page_size", page_size),
                        ("num_pages", 1 if num_pages is None else num_pages),
                        ("prefill_fanout", 1 if prefill_fanout is None else prefill_fanout)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={kv_cache!r}: expected one of {KV_CACHES}")
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption={preemption!r}: expected one of {PREEMPTIONS}")
        if max_prefill_length > max_cache_len:
            raise ValueError(f"max_prefill_length={max_prefill_length} > max_cache_len={max_cache_len}")
        buckets = tuple(sorted(set(prefill_buckets))) if prefill_buckets else \
            default_prefill_buckets(max_prefill_length)
        if buckets[0] < 1 or buckets[-1] < max_prefill_length:
            raise ValueError(f"prefill_buckets {buckets} must be >= 1 and cover max_prefill_length="
                             f"{max_prefill_length}")
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        bad = [e for e in eos_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad} outside the vocabulary [0, {self.vocab_size})")
        self._graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._model = model
        self._slots = int(max_concurrent_decodes)
        self._max_prefill = int(max_prefill_length)
        self.max_cache_len = int(max_cache_len)
        self.prefill_buckets = tuple(b for b in buckets if b <= max_prefill_length)
        self.sampling = sampling
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self._mesh = mesh
        self._tokenizer = tokenizer
        self.prefill_token_budget = int(prefill_token_budget)
        self.kv_cache = kv_cache
        self.preemption = preemption
        self.page_size = int(page_size)
        self.max_pages_per_slot = pages_for(self.max_cache_len, self.page_size)
        # Default pool: the dense cache's memory (every slot can reach max_cache_len at once, nothing is
        # ever preempted); fewer pages, or more slots, trade that guarantee for samples in flight.
        self.num_pages = int(num_pages) if num_pages is not None else self._slots * self.max_pages_per_slot
        self._prefill_calls = 0
        # Slots per prefill row in `run`, a power of two; None: grows with the largest group seen.
        self.prefill_fanout = None if prefill_fanout is None else pow2_ceil(min(prefill_fanout, self._slots))
        self._fanout = self.prefill_fanout or 1
        g, r = self._graphdef, self._rest
        # Under a mesh of several devices, trace everything under it (see module doc).
        # The state is laid out on the mesh, even a one-device one (`_laid_out`); only a sharded engine
        # splits work (`context_mesh`).
        self._pinned = mesh is not None and set(MESH_AXES) <= set(mesh.axis_names)
        self._sharded = self._pinned and mesh.size > 1
        rows = batch_axes_for(self._slots, mesh) if self._sharded else ()
        self._slot_shards = axis_size(mesh, rows) if rows else 1  # devices holding distinct slots
        traced = (lambda f: mesh_context(f, mesh)) if self._pinned else (lambda f: f)
        # One device: the state comes back as P() on the mesh whatever layout it met (an output left to
        # propagation took the spelling of a weight's spec, P('tensor', 'fsdp'), in some calls and not
        # others: a new signature, so a compile, each time).
        self._state_out = NamedSharding(mesh, P()) if self._pinned and not self._sharded else None
        with_state = {"out_shardings": (self._state_out, None)} if self._state_out else {}
        state_only = {"out_shardings": self._state_out} if self._state_out else {}
        self._prefill_jit = jax.jit(traced(lambda p, t, n, c, k, b, *, sampling, eos_ids:
                                           _prefill_impl(g, r, p, t, n, c, k, b, sampling=sampling,
                                                         eos_ids=eos_ids)),
                                    static_argnames=("sampling", "eos_ids"))
        self._insert_jit = jax.jit(traced(_insert_impl), donate_argnums=(1,), **state_only)
        self._prefill_rows_jit = jax.jit(traced(lambda p, s, t, n, sl, k, b, res, *, sampling, eos_ids:
                                                _prefill_rows_impl(g, r, p, s, t, n, sl, k, b, res,
                                                                   sampling=sampling, eos_ids=eos_ids)),
                                         static_argnames=("sampling", "eos_ids"), donate_argnums=(1,), **with_state)
        self._generate_jit = jax.jit(traced(lambda p, s, *, sampling, eos_ids:
                                            _generate_impl(g, r, p, s, sampling=sampling, eos_ids=eos_ids)),
                                     static_argnames=("sampling", "eos_ids"), donate_argnums=(1,), **with_state)
        self._steps_jit = jax.jit(traced(lambda p, s, *, num_steps, sampling, eos_ids:
                                         _generate_steps_impl(g, r, p, s, num_steps=num_steps, sampling=sampling,
                                                              eos_ids=eos_ids)),
                                  static_argnames=("num_steps", "sampling", "eos_ids"), donate_argnums=(1,),
                                  **with_state)
        self._free_jit = jax.jit(traced(lambda s, slot: _laid_out(s._replace(done=s.done.at[slot].set(True)))),
                                 donate_argnums=(0,), **state_only)
        # preemption="swap": a slot's pages and row out to the host, and back into (other) pages
        self._swap_out_jit = jax.jit(traced(_swap_out_impl))
        self._swap_in_jit = jax.jit(traced(_swap_in_impl), donate_argnums=(0,), **state_only)
        self._init_state_jit = None  # built at the first `init_decode_state`

    # -- JetStream Engine properties ------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:
            self._mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        return self._mesh

    @property
    def colocated_cpus(self):
        return None

    def get_prefix_destination_sharding(self) -> Any:
        return None  # prefixes stay where prefill put them (same devices as decode)

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def build_tokenizer(self, metadata: Any = None) -> Any:
        return self._tokenizer

    def free_resource(self, slot: int) -> Any:
        return None

    # -- JetStream Engine methods ---------------------------------------------------------

    def load_params(self, *args, **kwargs) -> nnx.State:
        """The model's parameter pytree. Any pytree of the same structure / shardings may be passed later."""
        return self._params

    @property
    def paged(self) -> bool:
        return self.kv_cache == "paged"

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """Every slot idle, laid out as every jitted function keeps it (`decode_state_specs`); each leaf its
        own buffer (the state is donated leaf by leaf). One compiled call (`run` starts every call from a
        fresh state; built eagerly, zeros and a copy per leaf cost 2.7 ms per rollout step on the CPU bench)."""
        if self._init_state_jit is None:
            out = self._state_out
            if self._sharded:  # as the jitted steps lay it out
                shapes = jax.eval_shape(self._zero_state)
                out = jax.tree.map(lambda x, spec: NamedSharding(self._mesh, spec), shapes,
                                   decode_state_specs(shapes, self._mesh))
            self._init_state_jit = jax.jit(self._zero_state, out_shardings=out)
        return self._init_state_jit()

    def _zero_state(self) -> DecodeState:
        b = self._slots
        zf = jnp.zeros((b,), jnp.float32)
        pages = cache_layout.Pages(self.num_pages, self.page_size) if self.paged else None
        return DecodeState(cache_layout.init_slots(self._model, b, self.max_cache_len, pages),
                           jnp.zeros((b,), jnp.int32),
                           jnp.zeros((b, 2), jnp.uint32), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32),
                           jnp.ones((b,), bool), zf, zf)

    def check_prompt(self, tokens: Sequence[int], what: str = "prompt") -> np.ndarray:
        """Host-side validation: non-empty, within max_prefill_length, ids in the vocabulary."""
        ids = np.asarray(tokens)
        if ids.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D list of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError(f"{what} is empty (0 tokens); at least one token is needed")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
        if ids.size > self._max_prefill:
            raise ValueError(f"{what} has {ids.size} tokens, more than max_prefill_length={self._max_prefill} "
                             "(prompts are never truncated; raise the engine's max_prefill_length)")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"{what} holds unknown token ids {sorted(set(bad.tolist()))[:8]} "
                             f"(vocabulary is [0, {self.vocab_size}))")
        return ids.astype(np.int32)

    def bucket_for(self, length: int) -> int:
        for b in self.prefill_buckets:
            if b >= length:
                return b
        if self.paged and length <= self.max_cache_len:  # a preempted sample's prompt + tokens so far
            return min(pow2_ceil(length), self.max_cache_len)
        raise ValueError(f"prompt of {length} tokens exceeds max_prefill_length={self._max_prefill}")

    def prefill(self, *, params: Any, existing_prefix: Prefix | None = None, padded_tokens: Any,
                true_length: int, sampler: Callable | None = None, rng: Any = None,
                max_new_tokens: int | None = None, sampling: SamplingParams | None = None
                ) -> tuple[Prefix, ResultTokens]:
        """Run the prompt `padded_tokens[:true_length]` (appended to `existing_prefix` if given) and
        sample its first token. Extra keywords (not in JetStream's API, all optional): `rng`
        (the request's key; default: a counter), `max_new_tokens` (default: until the cache is
        full), `sampling` (default: the engine's)."""
        if sampler is not None:
            raise ValueError("PolicyEngine samples with SamplingParams; a custom `sampler` is not supported")
        true_length = int(true_length)
        flat = np.asarray(padded_tokens).reshape(-1)
        if not 0 <= true_length <= flat.size:
            raise ValueError(f"true_length={true_length} must be in [0, len(padded_tokens)={flat.size}]")
        ids = self.check_prompt(flat[:true_length])
        bucket = self.bucket_for(true_length)
        start = 0 if existing_prefix is None else int(existing_prefix.cache.index[0])
        if start + true_length > self.max_cache_len:
            raise ValueError(f"prefix of {start} + {true_length} tokens exceeds max_cache_len={self.max_cache_len}")
        budget = self._check_budget(start + true_length, max_new_tokens)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :true_length] = ids
        if existing_prefix is None:
            cache = cache_layout.prefill_cache(self._model, 1, bucket)
        else:  # grow the existing cache so the new chunk fits after its index
            c = existing_prefix.cache
            pad = start + bucket - c.max_len
            grow = (lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))) if pad > 0 else (lambda a: a)
            cache = KVCache(tuple(map(grow, c.k)), tuple(map(grow, c.v)), grow(c.segment_ids), c.index, c.position)
        if rng is None:
            rng = jax.random.fold_in(jax.random.PRNGKey(0), self._prefill_calls)
        self._prefill_calls += 1
        prefix = self._prefill_jit(params, jnp.asarray(tokens), jnp.int32(true_length), cache, _as_raw_key(rng),
                                   jnp.int32(budget), sampling=sampling or self.sampling,
                                   eos_ids=self.eos_token_ids)
        first = _result_tokens(prefix.token[None], jnp.ones((1,), bool), jnp.ones((1,), jnp.int32))
        return prefix, first

    def prefill_rows_cap(self, length: int) -> int:
        """Most rows a prefill call of padded length `length` holds: the largest power of two within
        `prefill_token_budget` (1 when one row alone exceeds it), and no more than the slots need."""
        return min(1 << max(0, (self.prefill_token_budget // int(length)).bit_length() - 1),
                   pow2_ceil(self._slots))

    def prefill_rows(self, n: int, length: int) -> int:
        """Rows a call of `n` (<= the cap, or 1) requests padded to `length` computes: a power of four, or
        the cap. Every new [rows, length] shape is a compile (seconds on a CPU, minutes for a large model
        on a GPU) in the middle of a run: powers of four, not of two, halve the shapes per length bucket
        for at most 4x padded rows, which the plan weighs in its cost."""
        return max(min(_pow4_ceil(n), self.prefill_rows_cap(length)), int(n))

    def plan_prefill(self, lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Split prefill rows of these token lengths into calls: [(padded length L, row indices)], each
        call computing `prefill_rows(rows, L)` x L <= prefill_token_budget padded tokens (a row longer
        than the budget gets a call alone). Rows sorted longest first are cut into consecutive calls that
        minimise padded tokens + PREFILL_CALL_COST_TOKENS per call (a small dynamic program): one call
        for rows of similar length, a second one when it saves more padding than a call costs (a
        step's few long continued samples no longer pad its many short ones to their length). Shapes
        come from a small fixed set: L in `prefill_buckets`, rows a power of four or the cap."""
        order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
        bucket = [self.bucket_for(int(lengths[i])) for i in order]
        n = len(order)
        best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * n  # best[j]: rows [0, j) -> (cost, cut)
        for j in range(1, n + 1):
            for i in range(j - 1, -1, -1):  # the call holds rows [i, j), padded to bucket[i]
                if j - i > self.prefill_rows_cap(bucket[i]) and j - i > 1:
                    break  # more rows (smaller i) only grow the call
                cost = best[i][0] + PREFILL_CALL_COST_TOKENS + self.prefill_rows(j - i, bucket[i]) * bucket[i]
                if cost < best[j][0]:
                    best[j] = (cost, i)
        calls: list[tuple[int, list[int]]] = []
        j = n
        while j:
            i = best[j][1]
            calls.append((bucket[i], order[i:j]))
            j = i
        return calls[::-1]

    def prefill_many(self, params: Any, decode_state: DecodeState, requests: Sequence[Request],
                     slots: Sequence[int], *, sampling: SamplingParams | None = None
                     ) -> tuple[DecodeState, PrefillResult]:
        """Prefill `requests` and insert request i into slot `slots[i]`, in as few jitted calls as
        `prefill_token_budget` allows (`plan_prefill`). Requests with the same prompt (a group's n
        samples) share one prefill row and start from copies of its KV cache; each still samples its
        first token with its own key, so its tokens equal a one-request `prefill` + `insert`.
        Not in JetStream's API (its orchestrator keeps using `prefill` / `insert`)."""
        prompts, budgets = [], []
        for i, r in enumerate(requests):
            prompts.append(self.check_prompt(r.prompt_ids, what=f"request {i} prompt"))
            budgets.append(self._check_budget(len(prompts[-1]), r.max_new_tokens))
        if len(slots) != len(requests) or len(set(int(x) for x in slots)) != len(slots):
            raise ValueError(f"prefill_many: need one distinct slot per request, got {len(slots)} slots for "
                             f"{len(requests)} requests")
        for x in slots:
            if not 0 <= int(x) < self._slots:
                raise ValueError(f"slot={x} outside [0, {self._slots})")
        if self.paged:
            raise ValueError("prefill_many needs kv_cache='dense': with a paged cache, `run` owns the pages")
        keys = [_host_key(r.key) for r in requests]
        return self._prefill_many(params, decode_state, prompts, budgets, keys, list(slots),
                                  sampling or self.sampling)

    def _check_budget(self, length: int, max_new_tokens: int | None) -> int:
        room = self.max_cache_len - length + 1  # tokens that still fit (the last one is never cached)
        budget = room if max_new_tokens is None else int(max_new_tokens)
        if budget < 1 or budget > room:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be in [1, {room}] for a prompt of "
                             f"{length} tokens and max_cache_len={self.max_cache_len}")
        return budget

    def _prefill_many(self, params, state, prompts: list[np.ndarray], budgets: list[int], keys: list[np.ndarray],
                      slots: list[int], sampling: SamplingParams, fanout: int | None = None,
                      resumes: Sequence[tuple | None] | None = None) -> tuple[DecodeState, PrefillResult]:
        """`prefill_many` on checked inputs. `fanout` (a power of two >= the largest group here) fixes the
        slots-per-row dimension so that every call of a run uses the same shapes. `resumes[i]` (token,
        generated count, logprob, sampling logprob), when given, continues preempted request i (`Resume`)."""
        n = len(prompts)
        if n == 0:
            empty = np.zeros(0, np.float32)
            return state, PrefillResult(np.zeros(0, np.int32), empty, empty, np.zeros(0, bool), 0, 0, 0, 0)
        rows: dict[bytes, list[int]] = {}  # distinct prompt -> its requests
        for i, ids in enumerate(prompts):
            rows.setdefault(ids.tobytes(), []).append(i)
        f = fanout or pow2_ceil(max(len(g) for g in rows.values()))
        groups = [g[j:j + f] for g in rows.values() for j in range(0, len(g), f)]  # rows of <= F requests
        outs, plan_rows, tokens_real, padded = [], [], 0, 0
        for length, members in self.plan_prefill([len(prompts[g[0]]) for g in groups]):
            r = self.prefill_rows(len(members), length)
            tok = np.zeros((r, length), np.int32)
            lens = np.ones((r,), np.int32)
            sl = np.full((r, f), self._slots, np.int32)  # >= slots: unused, dropped
            ks = np.zeros((r, f, 2), np.uint32)
            bud = np.ones((r, f), np.int32)
            res = Resume(np.zeros((r, f), bool), np.zeros((r, f), np.int32), np.zeros((r, f), np.int32),
                         np.zeros((r, f), np.float32), np.zeros((r, f), np.float32))
            for row, gi in enumerate(members):
                ids = prompts[groups[gi][0]]
                tok[row, :ids.size], lens[row] = ids, ids.size
                tokens_real += ids.size
                for j, i in enumerate(groups[gi]):
                    sl[row, j], ks[row, j], bud[row, j] = slots[i], keys[i], budgets[i]
                    if resumes is not None and resumes[i] is not None:
                        res.flag[row, j] = True
                        res.token[row, j], res.length[row, j], res.logprob[row, j], \
                            res.sampling_logprob[row, j] = resumes[i]
            state, out = self._prefill_rows_jit(params, state, tok, lens, sl, ks, bud, res, sampling=sampling,
                                                eos_ids=self.eos_token_ids)
            outs.append(out)
            plan_rows.append([groups[gi] for gi in members])
            padded += r * length
        res = PrefillResult(np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.float32),
                            np.zeros(n, bool), len(outs), len(groups), tokens_real, padded)
        for (tok, lp, slp, done), members in zip(jax.device_get(outs), plan_rows):  # one host copy
            for row, group in enumerate(members):
                for j, i in enumerate(group):
                    res.tokens[i], res.logprobs[i] = tok[row, j], lp[row, j]
                    res.sampling_logprobs[i], res.done[i] = slp[row, j], done[row, j]
        return state, res

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        if not 0 <= int(slot) < self._slots:
            raise ValueError(f"slot={slot} outside [0, {self._slots})")
        if prefix.cache.max_len > self.max_cache_len:
            raise ValueError(f"prefix cache of length {prefix.cache.max_len} exceeds max_cache_len="
                             f"{self.max_cache_len}")
        return self._insert_jit(prefix, decode_state, jnp.int32(slot))

    def generate(self, params: Any, decode_state: DecodeState, sampler: Callable | None = None,
                 sampling: SamplingParams | None = None) -> tuple[DecodeState, ResultTokens]:
        """One token for every generating slot. ResultTokens.valid is 0 for idle / finished slots;
        lengths count the slot's generated tokens. The last token's log-probs are in the state."""
        if sampler is not None:
            raise ValueError("PolicyEngine samples with SamplingParams; a custom `sampler` is not supported")
        state, (tok, _, _, valid) = self._generate_jit(params, decode_state, sampling=sampling or self.sampling,
                                                       eos_ids=self.eos_token_ids)
        return state, _result_tokens(tok, valid, state.lengths)

    # -- our fast path --------------------------------------------------------------------

    def generate_steps(self, params: Any, decode_state: DecodeState, num_steps: int,
                       sampling: SamplingParams | None = None) -> tuple[DecodeState, StepsOutput]:
        """`num_steps` generate steps inside one jit (lax.scan)."""
        return self._steps_jit(params, decode_state, num_steps=int(num_steps), sampling=sampling or self.sampling,
                               eos_ids=self.eos_token_ids)

    def lower_generate_steps(self, params: Any, decode_state: Any, num_steps: int = 1,
                             sampling: SamplingParams | None = None):
        """`generate_steps` lowered (not run) for these (abstract) params and state: for `ulorl plan`'s
        memory and FLOP figures. `abstract_decode_state` gives the state as the engine lays it out."""
        return self._steps_jit.lower(params, decode_state, num_steps=int(num_steps),
                                     sampling=sampling or self.sampling, eos_ids=self.eos_token_ids)

    def abstract_decode_state(self) -> DecodeState:
        """The decode state's shapes, dtypes and (on a mesh) shardings, without allocating it."""
        state = jax.eval_shape(self.init_decode_state)
        if not self._sharded:
            return state
        return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=NamedSharding(self._mesh, spec)),
                            state, decode_state_specs(state, self._mesh))

    def _swap_chunks(self, pages: list[int], pools: Sequence[Any]):
        """`pages` as fixed-size id chunks padded past the pool (one compiled shape, at most
        `SWAP_CHUNK_BYTES` of K and V over the layers `pools`), with each chunk's real count."""
        page_bytes = 2 * sum(x.size // x.shape[0] * x.dtype.itemsize for x in pools)
        size = max(1, min(SWAP_CHUNK_BYTES // page_bytes, self.max_pages_per_slot))
        for start in range(0, len(pages), size):
            ids = np.full((size,), self.num_pages, np.int32)
            part = pages[start:start + size]
            ids[:len(part)] = part
            yield ids, len(part)

    def swap_out(self, decode_state: DecodeState, slot: int, pages: Sequence[int]) -> Swapped:
        """Slot `slot`'s row and the pages (`pages`: the slot's, in order) that hold its cached positions,
        copied to host memory. The slot and its pages are the caller's to free."""
        index = int(jax.device_get(decode_state.cache.index[slot]))
        held = list(pages)[:pages_for(index, self.page_size)]
        chunks = [(jax.device_get(self._swap_out_jit(decode_state, np.int32(slot), ids)), n)
                  for ids, n in self._swap_chunks(held, decode_state.cache.k)]
        k = tuple(np.concatenate([c[0][layer][:n] for c, n in chunks]) for layer in range(len(decode_state.cache.k)))
        v = tuple(np.concatenate([c[1][layer][:n] for c, n in chunks]) for layer in range(len(decode_state.cache.v)))
        return Swapped(k, v, SlotRow(*chunks[0][0][2]))

    def swap_in(self, decode_state: DecodeState, slot: int, pages: Sequence[int], swapped: Swapped) -> DecodeState:
        """A swapped-out sample back into slot `slot`, its KV written into the first of `pages` (the slot's
        pages now, in order, at least as many as it took out): it goes on exactly where it stopped."""
        held = swapped.k[0].shape[0]
        if len(pages) < held:
            raise ValueError(f"swap_in: slot {slot} has {len(pages)} pages for a sample that holds {held}")
        start = 0
        for ids, n in self._swap_chunks(list(pages)[:held], decode_state.cache.k):  # each chunk writes the row too
            chunk = tuple(tuple(_padded(x[start:start + n], ids.size) for x in kv) for kv in (swapped.k, swapped.v))
            decode_state = self._swap_in_jit(decode_state, np.int32(slot), ids, *chunk, swapped.row)
            start += n
        return decode_state

    def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Mark a slot finished (e.g. a stop sequence seen on the host)."""
        return self._free_jit(decode_state, jnp.int32(slot))

    def compile_count(self) -> int:
        """Executables compiled so far, over all jitted entry points (tests: no recompiles)."""
        fns = (self._prefill_jit, self._insert_jit, self._prefill_rows_jit, self._generate_jit, self._steps_jit,
               self._free_jit, self._swap_out_jit, self._swap_in_jit)
        return sum(f._cache_size() for f in fns)

    def _spread(self, free: list[int], slot_req: list) -> list[int]:
        """`free` reordered so that the next requests go to the least busy slot shards (devices) first:
        with the slots split over devices, a half-full batch then keeps every device decoding."""
        if self._slot_shards == 1:
            return free
        per = self._slots // self._slot_shards
        busy = [0] * self._slot_shards
        for slot, r in enumerate(slot_req):
            busy[slot // per] += r is not None
        queues = [deque(x for x in free if x // per == d) for d in range(self._slot_shards)]
        order = []
        while len(order) < len(free):
            d = min((d for d in range(self._slot_shards) if queues[d]), key=lambda d: (busy[d], d))
            order.append(queues[d].popleft())
            busy[d] += 1
        return order

    def run(self, params: Any, requests: Sequence[Request], *, sampling: SamplingParams | None = None,
            stop_sequences: Sequence[Sequence[int]] = (), steps_per_call: int = 8,
            on_tokens: Callable[[int], None] | None = None,
            feed: Callable[[bool], Sequence[Request] | None] | None = None,
            on_update: Callable[[int, Completion], bool] | None = None) -> tuple[list[Completion], RunStats]:
        """Continuous batching: decode every request, refilling a slot as soon as it frees.

        Free slots are refilled together by `prefill_many` (batched, one prefill row per distinct
        prompt). Tokens of a request depend only on its prompt, key, params and sampling, never on
        the slot or on its neighbours; its log-probs too, up to float rounding (last ulp) of the
        prefill batch's shape. `on_tokens(n)` reports progress.

        With the paged cache a request is admitted while free pages last (its prompt plus one call's
        tokens), and before each decode call every sample in flight gets the pages that call may fill.
        When the pool runs out, the most recently admitted samples are preempted: their pages are freed
        and they wait at the head of the queue to be prefilled again with their tokens so far, and then
        go on with their own RNG key (`Resume`), so their tokens equal a run with enough pages. With
        `preemption="swap"` their cached pages go to host memory instead and come back into fresh pages
        when they are readmitted (`swap_out` / `swap_in`): the same K/V, and no second prefill.

        Serving (`serving/driver.py`) keeps one run open while clients come and go: `feed(idle)` is called
        before each admission round and returns more requests (numbered after `requests`, in the order
        fed; check them first with `check_request`, a bad one raises here), or None once none will come
        (the run then ends when the rest are done); `idle` says nothing is queued or decoding, so `feed`
        may wait. `on_update(i, completion)` is called whenever request i got tokens or ended
        (`completion.stop` set); answering False ends it at once (stop "cancelled"), freeing its slot and
        pages (a client gone, a stop string seen on the host)."""
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        sampling = sampling or self.sampling
        stops = [list(s) for s in stop_sequences if len(s)]
        prompts, budgets = [], []
        for i, r in enumerate(requests):
            prompts.append(self.check_prompt(r.prompt_ids, what=f"request {i} prompt"))
            budgets.append(self._check_budget(len(prompts[-1]), r.max_new_tokens))
        keys = [_host_key(r.key) for r in requests]
        pool = self._page_pool(prompts, budgets) if self.paged else None
        feeding = feed is not None
        # One slots-per-row width (same shapes every call): `prefill_fanout`, or the largest group of equal
        # prompts so far, capped by the slots (never narrower than an earlier run's: a new width would
        # compile every prefill shape again).
        if self.prefill_fanout is None:
            counts: dict[bytes, int] = {}
            for ids in prompts:
                counts[ids.tobytes()] = counts.get(ids.tobytes(), 0) + 1
            self._fanout = max(self._fanout, pow2_ceil(min(max(counts.values(), default=1), self._slots)))
        fanout = self._fanout
        out: list[Completion | None] = [None] * len(requests)
        stats = RunStats(kv_pages=pool.num_pages if pool else 0)
        pending = deque(range(len(requests)))
        slot_req: list[int | None] = [None] * self._slots
        rows = list(prompts)  # what request i prefills: its prompt, or its prompt + tokens so far (preempted)
        resume: list[tuple | None] = [None] * len(requests)
        swapped: dict[int, Swapped] = {}  # preemption="swap": request -> its pages and row in host memory
        admitted = [0] * self._slots  # admission order of each slot's request: preemption takes the latest
        clock = 0
        state = self.init_decode_state()
        stats.decode_devices = len({tuple((i.start, i.stop) for i in s.index)
                                    for s in state.tokens.addressable_shards})

        def finish(slot, stop):
            out[slot_req[slot]].stop = stop
            slot_req[slot] = None
            if pool:
                pool.release(slot)

        def positions_after_call(i, prefill: bool) -> int:
            """KV positions request i may hold after its next call (prefill + decode, or decode only); a
            request never caches more than its prompt + budget - 1 (its last token is never cached)."""
            if i in swapped:
                cached = int(swapped[i].row.index)
            else:
                cached = rows[i].size if prefill else prompts[i].size + len(out[i].tokens) - 1
            return min(cached + steps_per_call, prompts[i].size + budgets[i] - 1)

        def preempt(state):
            slot = max((s for s in range(self._slots) if slot_req[s] is not None), key=lambda s: admitted[s])
            i, c = slot_req[slot], out[slot_req[slot]]
            if self.preemption == "swap":
                t0 = time.perf_counter()
                swapped[i] = self.swap_out(state, slot, pool.owned(slot))
                stats.swap_seconds += time.perf_counter() - t0
            else:
                keys[i] = np.asarray(jax.device_get(state.keys[slot]))
                rows[i] = np.concatenate([prompts[i], np.asarray(c.tokens[:-1], np.int32)])
                resume[i] = (c.tokens[-1], len(c.tokens), c.logprobs[-1], c.sampling_logprobs[-1])
            slot_req[slot] = None
            pool.release(slot)
            pending.appendleft(i)
            stats.preemptions += 1
            return self.free_slot(state, slot), slot

        def take_fed(idle: bool) -> bool:
            """Requests from `feed` queued behind the others; False once it has closed."""
            fed = feed(idle)
            if fed is None:
                return False
            for r in fed:
                i = len(prompts)
                ids, budget = self.check_request(r.prompt_ids, r.max_new_tokens, what=f"request {i} prompt")
                prompts.append(ids)
                rows.append(ids)
                budgets.append(budget)
                keys.append(_host_key(r.key))
                resume.append(None)
                out.append(None)
                pending.append(i)
            return True

        def report(slot, i, state):
            """`on_update` for request i (still in `slot`, or finished): a False answer ends it now."""
            if on_update is None or on_update(i, out[i]) or out[i].stop:
                return state
            state = self.free_slot(state, slot)
            finish(slot, "cancelled")
            return state

        while pending or any(r is not None for r in slot_req) or feeding:
            if feeding:
                feeding = take_fed(not pending and all(r is None for r in slot_req))
                if not pending and all(r is None for r in slot_req):
                    continue  # nothing to admit or decode (yet)
            if pool:  # pages for the next decode call of every sample in flight, earliest admitted first
                for slot in sorted((s for s in range(self._slots) if slot_req[s] is not None),
                                   key=lambda s: admitted[s]):
                    while slot_req[slot] is not None and not pool.grow(slot, positions_after_call(slot_req[slot],
                                                                                                  False)):
                        state, _ = preempt(state)
            free = self._spread([slot for slot in range(self._slots) if slot_req[slot] is None], slot_req)
            take, into = [], []
            # Pages kept free for the samples in flight to grow into over the next few calls: admitting into
            # them would only preempt (and prefill again) the newcomers a call or two later.
            reserve = sum(r is not None for r in slot_req) * pages_for(ADMIT_LOOKAHEAD_CALLS * steps_per_call,
                                                                       self.page_size) if pool else 0
            for slot in free:  # admit in queue order while slots (and pages) last
                if not pending or (pool and (pool.free_pages - pool.shortfall(slot, positions_after_call(
                        pending[0], True)) < reserve or not pool.grow(slot, positions_after_call(pending[0], True)))):
                    break
                reserve += pages_for(ADMIT_LOOKAHEAD_CALLS * steps_per_call, self.page_size) if pool else 0
                take.append(pending.popleft())
                into.append(slot)
                admitted[slot], clock = clock, clock + 1
            if pool:
                state = self._with_page_table(state, pool.table())
                stats.peak_pages = pool.peak_used
            if swapped and take:  # swapped-out samples readmitted: their pages back, no prefill
                back = [(i, slot) for i, slot in zip(take, into) if i in swapped]
                rest = [(i, slot) for i, slot in zip(take, into) if i not in swapped]
                t0 = time.perf_counter()
                for i, slot in back:
                    state = self.swap_in(state, slot, pool.owned(slot), swapped.pop(i))
                    slot_req[slot] = i
                stats.swap_seconds += time.perf_counter() - t0
                take, into = [i for i, _ in rest], [slot for _, slot in rest]
            if take:  # refill the free slots in as few batched prefill calls as the budget allows
                t0 = time.perf_counter()
                state, first = self._prefill_many(params, state, [rows[i] for i in take],
                                                  [budgets[i] for i in take], [keys[i] for i in take],
                                                  into, sampling, fanout, [resume[i] for i in take])
                stats.prefill_seconds += time.perf_counter() - t0
                stats.prefills += len(take)
                stats.prefill_calls += first.calls
                stats.prefill_rows += first.rows
                stats.prefill_tokens += first.tokens_prefilled
                fresh = 0
                for n, (i, slot) in enumerate(zip(take, into)):
                    slot_req[slot] = i
                    if resume[i] is not None:  # a preempted sample goes on where it stopped
                        resume[i] = None
                        continue
                    fresh += 1
                    tok = int(first.tokens[n])
                    out[i] = Completion([tok], [float(first.logprobs[n])], [float(first.sampling_logprobs[n])], "")
                    if first.done[n]:
                        finish(slot, "eos" if tok in self.eos_token_ids else "budget")
                    elif _ends_with_stop(out[i].tokens, stops):
                        state = self.free_slot(state, slot)
                        finish(slot, "stop")
                    state = report(slot, i, state)
                stats.tokens_decoded += fresh
                if on_tokens and fresh:
                    on_tokens(fresh)
            if all(r is None for r in slot_req):
                continue
            t0 = time.perf_counter()
            state, steps = self.generate_steps(params, state, steps_per_call, sampling=sampling)
            steps, done = jax.device_get((steps, state.done))
            stats.decode_seconds += time.perf_counter() - t0
            stats.generate_calls += 1
            stats.decode_steps += steps_per_call
            stats.slot_steps_used += int(steps.valid.sum())
            stats.slot_steps_total += steps.valid.size
            new_tokens = 0
            # A slot generates from the call's first step until it finishes, so its valid steps are a prefix:
            # copied as list slices (one tolist per array per call, not fancy-indexed copies per slot).
            counts = steps.valid.sum(axis=1)
            if not (steps.valid == (np.arange(steps.valid.shape[1])[None, :] < counts[:, None])).all():
                raise RuntimeError(f"decode call: a slot's generated steps are not a prefix of the call "
                                   f"(valid per slot: {steps.valid.astype(int).tolist()})")
            toks, lps, slps = steps.tokens.tolist(), steps.logprobs.tolist(), steps.sampling_logprobs.tolist()
            for slot, i in enumerate(slot_req):
                if i is None:
                    continue
                c = out[i]
                n = int(counts[slot])
                if stops:  # token by token: trim anything decoded past the stop sequence
                    for t in range(n):
                        c.tokens.append(toks[slot][t])
                        c.logprobs.append(lps[slot][t])
                        c.sampling_logprobs.append(slps[slot][t])
                        new_tokens += 1
                        if _ends_with_stop(c.tokens, stops):
                            break
                else:
                    c.tokens += toks[slot][:n]
                    c.logprobs += lps[slot][:n]
                    c.sampling_logprobs += slps[slot][:n]
                    new_tokens += n
                if stops and _ends_with_stop(c.tokens, stops) and not (
                        done[slot] and c.tokens[-1] in self.eos_token_ids):
                    state = self.free_slot(state, slot)
                    finish(slot, "stop")
                elif done[slot]:
                    finish(slot, "eos" if c.tokens[-1] in self.eos_token_ids else "budget")
                if n or c.stop:
                    state = report(slot, i, state)
            stats.tokens_decoded += new_tokens
            if on_tokens and new_tokens:
                on_tokens(new_tokens)
        return out, stats

    def _page_pool(self, prompts: list[np.ndarray], budgets: list[int]) -> PagePool:
        """A fresh pool for `run`; refuses, before any work, a request that could never fit in it alone."""
        for i, (ids, budget) in enumerate(zip(prompts, budgets)):
            self._check_pages(ids.size, budget, f"request {i}")
        return PagePool(self.num_pages, self.page_size, self._slots, self.max_pages_per_slot)

    def _check_pages(self, length: int, budget: int, what: str) -> None:
        need = pages_for(length + budget - 1, self.page_size)
        if self.paged and need > self.num_pages:
            raise ValueError(f"{what}: a prompt of {length} tokens + max_new_tokens={budget} needs "
                             f"{need} KV pages of {self.page_size} positions, more than the pool's "
                             f"num_pages={self.num_pages}; give the engine more pages or ask for fewer tokens")

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int | None,
                      what: str = "prompt") -> tuple[np.ndarray, int]:
        """(prompt ids as int32, token budget) of a request `run` accepts; a ValueError says why not (a
        prompt empty, too long or with unknown ids; max_new_tokens out of range; more KV pages than the pool)."""
        ids = self.check_prompt(prompt_ids, what=what)
        budget = self._check_budget(ids.size, max_new_tokens)
        self._check_pages(ids.size, budget, what)
        return ids, budget

    def _with_page_table(self, state: DecodeState, table: np.ndarray) -> DecodeState:
        """The state with this call's page table, placed exactly as the table it replaces (an equal layout
        written another way, e.g. P('data') vs P(('data', 'fsdp', 'expert'), None), is a new signature and
        a compile)."""
        table = jax.device_put(table, state.cache.page_table.sharding) if self._pinned else jnp.asarray(table)
        return state._replace(cache=state.cache._replace(page_table=table))


def register_as_jetstream_engine(engine_api: Any) -> None:
    """Make PolicyEngine a (virtual) subclass of `jetstream.engine.engine_api.Engine`.
    Call it with the module after importing jetstream in its isolated way."""
    engine_api.Engine.register(PolicyEngine)
