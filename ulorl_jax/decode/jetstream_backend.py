"""JetStream as a rollout backend: its orchestrator (`Driver`) drives our PolicyEngine.

Optional extra `jetstream` (google-jetstream==0.2.2, the last release). Nothing
imports jetstream until `import_jetstream()` is called, and that call contains
its import-time hazards:
- it calls the removed `jax.tree_map`: aliased to `jax.tree_util.tree_map` first;
- it sets the root logger to DEBUG and adds a stdout handler: both undone;
- its `JetThread` SIGKILLs the whole process when a driver thread raises: our
  `Driver` subclass builds its threads from a class that records the error
  instead (`driver.failure`), and callers turn it into a `JetStreamThreadError`.

How a request flows (JetStream 0.2.2's own path, unchanged): LLMOrchestrator.Decode
-> prefill thread -> transfer -> generate thread (insert / generate) -> detokenize
thread -> the request's return channel. Three adaptations, all in this file:
1. `_process_prefill_content` (Driver subclass): token ids go in as they are (no
   BOS; Qwen3 has none), padded to the engine's prefill bucket, never truncated.
2. JetStream 0.2.2's `prefill` returns only a prefix and emits no token, while our
   engine samples the first token in prefill. The adapter's `generate` therefore
   emits, for each slot, the token that is the *input* of the step (the previous
   step's output; the prefill token after `insert`), and marks a slot invalid
   once its final token was emitted, which ends the request in JetStream's
   detokenizer. Each request's `max_tokens` becomes the engine's budget.
3. EOS is handled by the engine (the slot stops after emitting it); the EOS token
   is part of the returned tokens, as in our engine's own loop.

Per-token log-probs are RECOMPUTED, not carried: JetStream's return channel only
carries token ids, so after the orchestrator returns a segment, one teacher-forced
forward pass of prompt + response under the same params gives each token's
`logprob` (the sampling.py convention: log softmax(logits / T), T = 1 for greedy).
They equal the engine's decode-time log-probs up to float rounding (tested).

`rollout_backend`: `rollout.backends.make_segment_rollout(engine, config, rollout_backend="jetstream")`
is SegmentRollout (rollout/segment.py, unchanged) over `JetStreamRunner(engine)`, whose
`run` has PolicyEngine.run's contract. A fresh Driver is built per `run`, i.e.
per RL step = per weight version, with requests of `max_tokens = budget`
(`segment_len`, or less near `global_max_len`). Each request's PRNG key rides
with it (requests reach JetStream's single prefill queue in list order), and the
engine's tokens depend only on prompt, key, params and sampling, so rollouts equal
the engine backend token for token, greedy and sampled alike (tested). Stop
sequences: JetStream decodes to the budget and the tokens are cut afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import logging
import os
import threading
import time
import types
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulorl_jax.decode.engine import Completion, PolicyEngine, Request, RunStats, register_as_jetstream_engine
from ulorl_jax.decode.sampling import SamplingParams, filter_logits
from ulorl_jax.models.logprobs import chunked_logprobs_and_entropy

JETSTREAM_REQUIREMENT = "google-jetstream==0.2.2"
_OFFLINE_WARNING = "LLM orchestrator is being used in offline test mode"


class JetStreamUnavailable(ImportError):
    """google-jetstream is not installed (pip install -e '.[jetstream]')."""


class JetStreamThreadError(RuntimeError):
    """A JetStream driver thread raised; JetStream itself would have killed the process."""


def jetstream_available() -> bool:
    return importlib.util.find_spec("jetstream") is not None


_import_lock = threading.Lock()


@functools.cache
def import_jetstream() -> types.SimpleNamespace:
    """Import the JetStream modules we use, with its import-time hazards contained (module doc)."""
    if not jetstream_available():
        raise JetStreamUnavailable(f"JetStream is not installed: pip install '{JETSTREAM_REQUIREMENT}' "
                                   "(or pip install -e '.[jetstream]'); never the unrelated 'jetstream-pt'")
    with _import_lock:
        if not hasattr(jax, "tree_map"):
            jax.tree_map = jax.tree_util.tree_map  # removed in jax 0.6; jetstream 0.2.2 still calls it
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # seqio -> TensorFlow start-up chatter
        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        try:
            from jetstream.core import orchestrator
            from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
            from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
        finally:  # orchestrator.py sets root to DEBUG and adds a stdout handler at import
            root.setLevel(level)
            for h in list(root.handlers):
                if h not in handlers:
                    root.removeHandler(h)
        root.addFilter(lambda record: not str(record.msg).startswith(_OFFLINE_WARNING))
        register_as_jetstream_engine(engine_api)
        return types.SimpleNamespace(orchestrator=orchestrator, engine_api=engine_api,
                                     tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2,
                                     jetstream_pb2=jetstream_pb2, jetstream_pb2_grpc=jetstream_pb2_grpc)


# --------------------------------------------------------------------------------------
# Request validation (before anything reaches a driver thread).


def request_prompt_ids(engine: PolicyEngine, request: Any, tokenizer: Any = None) -> list[int]:
    """A JetStream `DecodeRequest` -> checked prompt ids. ValueError names the bad field."""
    if request.session_cache:
        raise ValueError("session_cache is not supported by ulorl serve (send the whole prompt)")
    which = request.WhichOneof("content")
    if which == "text_content":
        if tokenizer is None:
            raise ValueError("text_content needs a tokenizer, and the model folder has none; send token_content")
        ids = list(tokenizer.encode(request.text_content.text, add_special_tokens=False))
    elif which == "token_content":
        ids = list(request.token_content.token_ids)
    else:
        raise ValueError("DecodeRequest has no content (set text_content or token_content)")
    ids = engine.check_prompt(ids, what="prompt").tolist()
    room = engine.max_cache_len - len(ids) + 1
    if not 1 <= request.max_tokens <= room:
        raise ValueError(f"max_tokens={request.max_tokens} must be in [1, {room}] for a prompt of {len(ids)} "
                         f"tokens (max_cache_len={engine.max_cache_len})")
    return ids


# --------------------------------------------------------------------------------------
# The JetStream-side classes (built once jetstream is imported).


class AdapterState(NamedTuple):
    engine: Any  # engine.DecodeState
    final_emitted: jnp.ndarray  # [B] bool: the slot's last token already went out (or the slot is empty)


@jax.jit
def _emit(tokens, lengths, done, final_emitted):
    """The step's input token per slot -> ResultTokens data [B, 3] = (token, valid, length)."""
    data = jnp.stack([tokens, (~final_emitted).astype(jnp.int32), lengths], axis=1).astype(jnp.int32)
    return data, final_emitted | done


@jax.jit
def _reset_slot(final_emitted, slot):
    return final_emitted.at[slot].set(False)


@functools.cache
def jetstream_classes() -> types.SimpleNamespace:
    js = import_jetstream()
    import grpc  # a jetstream dependency

    engine_api, orchestrator = js.engine_api, js.orchestrator

    class TokenizerAdapter(js.tokenizer_api.Tokenizer):
        """JetStream's Tokenizer over an optional HF tokenizer. No stop tokens: the engine stops
        at EOS and the EOS token is returned, as in PolicyEngine.run."""

        def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]):
            self.tokenizer, self._eos = tokenizer, tuple(eos_token_ids)

        def encode(self, s: str, **kwargs):
            if self.tokenizer is None:
                raise ValueError("text needs a tokenizer, and the model folder has none")
            ids = np.asarray(self.tokenizer.encode(s, add_special_tokens=False), np.int32)
            return ids, ids.size

        def decode(self, token_ids: list[int], **kwargs) -> str:
            if self.tokenizer is None:
                return "".join(f"<{t}>" for t in token_ids)
            return self.tokenizer.decode(token_ids)

        @property
        def pad_id(self) -> int:
            return 0

        @property
        def eos_id(self) -> int:
            return self._eos[0] if self._eos else -1

        @property
        def bos_id(self) -> int:
            return -1

        @property
        def stop_tokens(self) -> set[int]:
            return set()

    class JetStreamEngine(engine_api.Engine):
        """PolicyEngine behind JetStream 0.2.2's Engine API (see the module doc, point 2)."""

        def __init__(self, engine: PolicyEngine, *, sampling: SamplingParams | None = None, seed: int = 0,
                     request_keys: Sequence[Any] | None = None,
                     request_prompts: Sequence[Sequence[int]] | None = None):
            """`request_keys[k]` is the PRNG key of the k-th prefill (else fold_in(seed, k));
            `request_prompts[k]`, when given, is checked against the k-th prefill's prompt."""
            self.engine = engine
            self.sampling = sampling or engine.sampling
            self._base_key = jax.random.PRNGKey(seed)
            self._request_keys = list(request_keys) if request_keys is not None else None
            self._request_prompts = [list(map(int, p)) for p in request_prompts] if request_prompts else None
            self._staged = threading.local()
            self.prefills = 0
            self.generate_calls = 0
            self.prefill_seconds = 0.0

        def stage(self, max_tokens: int) -> None:
            """Called by the driver's prefill thread right before `prefill` (same thread)."""
            self._staged.max_tokens = int(max_tokens)

        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
            budget = getattr(self._staged, "max_tokens", None)
            self._staged.max_tokens = None
            k = self.prefills
            if self._request_keys is None:
                key = jax.random.fold_in(self._base_key, k)
            elif k < len(self._request_keys):
                key = self._request_keys[k]
            else:
                raise RuntimeError(f"prefill #{k} but only {len(self._request_keys)} request keys were given")
            if self._request_prompts is not None:
                got = np.asarray(padded_tokens).reshape(-1)[:int(true_length)].tolist()
                if k >= len(self._request_prompts) or got != self._request_prompts[k]:
                    raise RuntimeError(f"prefill #{k} is not the expected request (out-of-order prefill)")
            t0 = time.perf_counter()
            prefix, _ = self.engine.prefill(params=params, existing_prefix=existing_prefix,
                                            padded_tokens=padded_tokens, true_length=true_length, rng=key,
                                            max_new_tokens=budget, sampling=self.sampling)
            jax.block_until_ready(prefix)
            self.prefill_seconds += time.perf_counter() - t0
            self.prefills += 1
            return prefix

        def insert(self, prefix, decode_state: AdapterState, slot: int) -> AdapterState:
            return AdapterState(self.engine.insert(prefix, decode_state.engine, slot),
                                _reset_slot(decode_state.final_emitted, jnp.int32(slot)))

        def generate(self, params, decode_state: AdapterState):
            st = decode_state.engine
            data, final = _emit(st.tokens, st.lengths, st.done, decode_state.final_emitted)
            new, _ = self.engine.generate(params, st, sampling=self.sampling)
            self.generate_calls += 1
            return AdapterState(new, final), engine_api.ResultTokens(data, (0, 1), (1, 2), (2, 3), 1)

        def load_params(self, *args, **kwargs):
            return self.engine.load_params()

        def init_decode_state(self, *args, **kwargs) -> AdapterState:
            return AdapterState(self.engine.init_decode_state(),
                                jnp.ones((self.engine.max_concurrent_decodes,), bool))

        def get_prefix_destination_sharding(self):
            return self.engine.get_prefix_destination_sharding()

        def get_tokenizer(self):
            return js.tokenizer_pb2.TokenizerParameters(path="ulorl", extra_ids=0)

        def build_tokenizer(self, metadata):
            return TokenizerAdapter(self.engine.get_tokenizer(), self.engine.eos_token_ids)

        @property
        def max_concurrent_decodes(self) -> int:
            return self.engine.max_concurrent_decodes

        @property
        def samples_per_slot(self) -> int:
            return 1

        @property
        def max_prefill_length(self) -> int:
            return self.engine.max_prefill_length

        @property
        def mesh(self):
            return self.engine.mesh

        @property
        def colocated_cpus(self):
            return self.engine.colocated_cpus

    _construct_lock = threading.Lock()

    class Driver(orchestrator.Driver):
        """JetStream's Driver over one JetStreamEngine (interleaved: prefill and generate share it),
        with contained threads and our prompt handling (module doc, point 1)."""

        def __init__(self, adapter: JetStreamEngine, params: Any):
            self.adapter = adapter
            self.failure: BaseException | None = None
            self.failed = threading.Event()
            driver = self

            class ContainedThread(threading.Thread):  # replaces JetThread's SIGKILL
                def run(self):
                    try:
                        super().run()
                    except BaseException as err:  # noqa: BLE001  (recorded, re-raised by the caller)
                        logging.getLogger("ulorl.jetstream").error("JetStream thread %s failed: %r",
                                                                   self.name, err)
                        if driver.failure is None:
                            driver.failure = err
                        driver.failed.set()

            with _construct_lock:  # the Driver builds its threads from the module-level JetThread
                saved, orchestrator.JetThread = orchestrator.JetThread, ContainedThread
                try:
                    super().__init__(prefill_engines=[adapter], generate_engines=[adapter], prefill_params=[params],
                                     generate_params=[params], interleaved_mode=True, jax_padding=False)
                finally:
                    orchestrator.JetThread = saved

        def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
            content = request.prefill_content
            ids = tokenizer.encode(content)[0] if isinstance(content, str) else np.asarray(content, np.int32)
            ids = self.adapter.engine.check_prompt(ids)
            padded = np.zeros((self.adapter.engine.bucket_for(ids.size),), np.int32)
            padded[:ids.size] = ids
            self.adapter.stage(request.max_tokens)
            return padded, int(ids.size)

        def raise_if_failed(self) -> None:
            if self.failure is not None:
                raise JetStreamThreadError(f"a JetStream driver thread failed: {self.failure!r}") from self.failure

    class Orchestrator(orchestrator.LLMOrchestrator):
        """LLMOrchestrator that rejects bad requests up front (INVALID_ARGUMENT over gRPC, ValueError
        offline) so nothing invalid reaches a driver thread."""

        def __init__(self, driver: Driver, on_done: Callable[[], None] | None = None):
            super().__init__(driver=driver)
            self._on_done = on_done

        async def Decode(self, request, context=None):  # noqa: N802  (gRPC method name)
            try:
                try:
                    request_prompt_ids(self._driver.adapter.engine, request,
                                       self._driver.adapter.engine.get_tokenizer())
                except ValueError as err:
                    if context is None:
                        raise
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                if self._driver.failed.is_set():
                    msg = f"the JetStream driver failed: {self._driver.failure!r}"
                    if context is None:
                        raise JetStreamThreadError(msg)
                    await context.abort(grpc.StatusCode.INTERNAL, msg)
                async for response in super().Decode(request, context):
                    yield response
            finally:
                if self._on_done is not None:
                    self._on_done()

    return types.SimpleNamespace(TokenizerAdapter=TokenizerAdapter, JetStreamEngine=JetStreamEngine,
                                 Driver=Driver, Orchestrator=Orchestrator)


# --------------------------------------------------------------------------------------
# Log-probs, recomputed by a teacher-forced forward (module doc).


def _pad_len(n: int, multiple: int = 16) -> int:
    """Length bucket for recomputation: powers of two from 16 (few compiles)."""
    b = multiple
    while b < n:
        b *= 2
    return b


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _score(graphdef, rest, params, tokens, mask, *, sampling: SamplingParams):
    """tokens/mask [B, L] right-padded -> (logprob, sampling_logprob) [B, L-1] of tokens[:, 1:].
    `logprob` is chunked along L (models/logprobs.py, as the learner), so long responses never build
    [B, L, V]; only top-k / top-p `sampling_logprob`s need the full logits."""
    model = nnx.merge(graphdef, params, rest)
    hidden = model.forward(tokens, attention_mask=mask, compute_logits=False).hidden[:, :-1]  # [B, L-1, D]
    targets = tokens[:, 1:]  # [B, L-1]
    temperature = 1.0 if sampling.greedy else sampling.temperature
    lp, _ = chunked_logprobs_and_entropy(hidden, model.lm_head_weight(), targets, chunk_size=512,
                                         temperature=temperature)
    if sampling.greedy:
        return lp, jnp.zeros_like(lp)
    if not sampling.filtered:
        return lp, lp
    logits = jnp.einsum("btd,dv->btv", hidden, model.lm_head_weight().astype(hidden.dtype),
                        preferred_element_type=jnp.float32) / temperature  # [B, L-1, V]
    kept = filter_logits(logits, sampling.top_k, sampling.top_p)
    return lp, jnp.take_along_axis(jax.nn.log_softmax(kept, -1), targets[..., None], -1)[..., 0]


def recompute_logprobs(engine: PolicyEngine, params: Any, prompts: Sequence[Sequence[int]],
                       responses: Sequence[Sequence[int]], sampling: SamplingParams
                       ) -> tuple[list[list[float]], list[list[float]]]:
    """Per response token: (logprob, sampling_logprob) under `params`, in batches of the engine's
    slot count (sequence lengths padded to powers of two: few compiles)."""
    graphdef, _, rest = nnx.split(engine._model, nnx.Param, ...)  # noqa: SLF001  (structure only)
    out_lp: list[list[float]] = [[] for _ in prompts]
    out_slp: list[list[float]] = [[] for _ in prompts]
    rows = [i for i, r in enumerate(responses) if len(r)]
    b = engine.max_concurrent_decodes
    for start in range(0, len(rows), b):
        chunk = rows[start:start + b]
        seqs = [list(prompts[i]) + list(responses[i]) for i in chunk]
        length = _pad_len(max(map(len, seqs)))
        tokens = np.zeros((b, length), np.int32)
        mask = np.zeros((b, length), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, :len(s)], mask[r, :len(s)] = s, 1
        lp, slp = jax.device_get(_score(graphdef, rest, params, jnp.asarray(tokens), jnp.asarray(mask),
                                        sampling=sampling))
        for r, i in enumerate(chunk):
            p, n = len(prompts[i]), len(responses[i])
            out_lp[i] = lp[r, p - 1:p - 1 + n].tolist()
            out_slp[i] = slp[r, p - 1:p - 1 + n].tolist()
    return out_lp, out_slp


# --------------------------------------------------------------------------------------
# Driving requests through JetStream.


def make_driver(engine: PolicyEngine, params: Any, *, sampling: SamplingParams | None = None, seed: int = 0,
                request_keys: Sequence[Any] | None = None, request_prompts: Sequence[Sequence[int]] | None = None):
    """A running JetStream Driver over `engine` with `params` (one weight version). Call `.stop()`."""
    classes = jetstream_classes()
    adapter = classes.JetStreamEngine(engine, sampling=sampling, seed=seed, request_keys=request_keys,
                                      request_prompts=request_prompts)
    return classes.Driver(adapter, params)


async def _decode_all(driver, requests: Sequence[Any], on_tokens: Callable[[int], None] | None,
                      poll_seconds: float = 0.05) -> list[list[int]]:
    """Send DecodeRequests through JetStream's LLMOrchestrator (offline mode: no port); tokens per request."""
    orch = jetstream_classes().Orchestrator(driver)

    async def one(req) -> list[int]:
        tokens: list[int] = []
        async for response in orch.Decode(req):
            new = list(response.stream_content.samples[0].token_ids)
            tokens += new
            if on_tokens and new:
                on_tokens(len(new))
        return tokens

    # Tasks start in order, so requests reach the prefill queue in list order.
    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=poll_seconds, return_when=asyncio.FIRST_EXCEPTION)
        if driver.failed.is_set() or any(t.done() and t.exception() for t in tasks):
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            driver.raise_if_failed()
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()
    return [t.result() for t in tasks]


def _run_driver(driver, requests: Sequence[Any], on_tokens: Callable[[int], None] | None) -> list[list[int]]:
    """Decode `requests` on `driver`, then stop it. The event loop stays open until the driver has
    stopped: JetStream's detokenizer may still post to a finished request's channel."""
    loop = asyncio.new_event_loop()
    try:
        try:
            tokens = loop.run_until_complete(_decode_all(driver, requests, on_tokens)) if requests else []
        finally:
            driver.stop()
        driver.raise_if_failed()
        return tokens
    finally:
        loop.close()


def decode_with_jetstream(engine: PolicyEngine, params: Any, prompts: Sequence[Sequence[int]],
                          max_tokens: Sequence[int] | int, *, sampling: SamplingParams | None = None,
                          keys: Sequence[Any] | None = None, seed: int = 0,
                          on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
    """Decode `prompts` through JetStream's Driver and request path; tokens per prompt (EOS included)."""
    js = import_jetstream()
    budgets = [int(max_tokens)] * len(prompts) if isinstance(max_tokens, int) else [int(m) for m in max_tokens]
    if len(budgets) != len(prompts):
        raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    pb = js.jetstream_pb2
    requests = [pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[int(t) for t in p]),
                                 max_tokens=m) for p, m in zip(prompts, budgets)]
    for i, r in enumerate(requests):
        try:
            request_prompt_ids(engine, r)
        except ValueError as err:
            raise ValueError(f"request {i}: {err}") from None
    driver = make_driver(engine, params, sampling=sampling, seed=seed, request_keys=keys,
                         request_prompts=prompts if keys is not None else None)
    return _run_driver(driver, requests, on_tokens)


def _stop_trim(tokens: list[int], stops: Sequence[Sequence[int]]) -> int | None:
    """Length of the shortest prefix ending with a stop sequence, or None."""
    for n in range(1, len(tokens) + 1):
        if any(n >= len(s) and tokens[n - len(s):n] == list(s) for s in stops):
            return n
    return None


@dataclasses.dataclass
class JetStreamRunner:
    """A PolicyEngine whose `run` goes through JetStream's orchestrator (rollout_backend="jetstream").
    Every other attribute is the engine's, so SegmentRollout takes it unchanged."""

    engine: PolicyEngine
    seed: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def run(self, params: Any, requests: Sequence[Request], *, sampling: SamplingParams | None = None,
            stop_sequences: Sequence[Sequence[int]] = (), steps_per_call: int = 8,
            on_tokens: Callable[[int], None] | None = None) -> tuple[list[Completion], RunStats]:
        """PolicyEngine.run's contract; `steps_per_call` is unused (JetStream steps one token at a time)."""
        del steps_per_call
        sampling = sampling or self.engine.sampling
        stops = [list(s) for s in stop_sequences if len(s)]
        t0 = time.perf_counter()
        prompts = [list(map(int, r.prompt_ids)) for r in requests]
        budgets = [int(r.max_new_tokens) for r in requests]
        keys = [jax.random.PRNGKey(r.key) if isinstance(r.key, int) else r.key for r in requests]
        js = import_jetstream()
        pb = js.jetstream_pb2
        msgs = [pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=p), max_tokens=m)
                for p, m in zip(prompts, budgets)]
        for i, m in enumerate(msgs):
            try:
                request_prompt_ids(self.engine, m)
            except ValueError as err:
                raise ValueError(f"request {i}: {err}") from None
        driver = make_driver(self.engine, params, sampling=sampling, seed=self.seed, request_keys=keys,
                             request_prompts=prompts)
        token_lists = _run_driver(driver, msgs, on_tokens)
        wall = time.perf_counter() - t0
        completions = []
        eos = set(self.engine.eos_token_ids)
        for toks, budget in zip(token_lists, budgets):
            cut = _stop_trim(toks, stops) if stops else None
            if toks and toks[-1] in eos and (cut is None or cut == len(toks)):
                stop = "eos"
            elif cut is not None:
                toks, stop = toks[:cut], "stop"
            else:
                stop = "budget"
                if len(toks) != budget:
                    raise JetStreamThreadError(f"JetStream returned {len(toks)} tokens for a budget of {budget} "
                                               "without EOS")
            completions.append(Completion(toks, [], [], stop))
        lps, slps = recompute_logprobs(self.engine, params, prompts, [c.tokens for c in completions], sampling)
        for c, lp, slp in zip(completions, lps, slps):
            c.logprobs, c.sampling_logprobs = lp, slp
        adapter = driver.adapter
        tokens = sum(len(c.tokens) for c in completions)
        slots = self.engine.max_concurrent_decodes
        stats = RunStats(tokens_decoded=tokens, prefill_seconds=adapter.prefill_seconds,
                         decode_seconds=max(wall - adapter.prefill_seconds, 0.0), prefills=adapter.prefills,
                         generate_calls=adapter.generate_calls,
                         slot_steps_used=max(tokens - adapter.prefills, 0),
                         slot_steps_total=adapter.generate_calls * slots)
        return completions, stats
