"""`ulorl serve`: the OpenAI HTTP API (default), or with `--api jetstream` JetStream's gRPC service.

The OpenAI-compatible server (`ulorl_jax/serving/`, README "Serving") speaks /v1/completions,
/v1/chat/completions, /v1/models, /tokenize, /detokenize and /health on http://127.0.0.1:8000
(--host / --port), every client decoded together by the engine's continuous batching.

`--api jetstream`: JetStream's orchestrator and gRPC service running our PolicyEngine
(JetStream's repository is read-only since 2026-02-01; kept as an option). Needs the `jetstream` extra (pip install -e '.[jetstream]'). Clients use
JetStream's own proto (`jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub`):
`Decode` streams tokens for a `DecodeRequest` (token_content, or text_content when
the model folder has a tokenizer; `max_tokens` >= 1), `HealthCheck` says whether the
driver is live. Binds 127.0.0.1 unless --host says otherwise; --port 0 picks a free
port. A line `ulorl serve: listening on HOST:PORT` on stdout says it is ready.

Bad requests (empty or over-long prompts, unknown token ids, max_tokens out of
range, text without a tokenizer) get INVALID_ARGUMENT and the server keeps
serving. A failing JetStream thread does not kill the process (as JetStream's
JetThread would): the server stops cleanly and exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from concurrent import futures
from typing import Any


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI HTTP API (or JetStream's gRPC: --api jetstream)",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="HF folder (config.json + safetensors), ulorl folder, run folder or RUN/checkpoints/STEP")
    p.add_argument("--api", choices=["openai", "jetstream"], default="openai",
                   help="openai: the OpenAI HTTP API (default); jetstream: JetStream's gRPC (extra: jetstream)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=None,
                   help="port; 0 = any free port (default 8000 for openai, 9000 for jetstream)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="openai: the model name clients send (default: --model as given)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="openai: require `Authorization: Bearer KEY` on every route but /health (default: none)")
    p.add_argument("--kv-cache", choices=["dense", "paged"], default="paged",
                   help="openai: KV cache layout (default paged)")
    p.add_argument("--page-size", type=int, default=64, help="openai, paged: positions per KV page (default 64)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="openai, paged: KV pages in the pool (default: slots x pages of a full context)")
    p.add_argument("--steps-per-call", type=int, default=8, help="openai: decode steps per jitted call (default 8)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="openai: uvicorn's log level (default warning)")
    p.add_argument("--max-concurrent-decodes", type=int, default=8, help="decode slots (default 8)")
    p.add_argument("--max-prefill-length", type=int, default=1024, help="longest prompt in tokens (default 1024)")
    p.add_argument("--max-cache-len", type=int, default=2048,
                   help="KV cache per slot: prompt + generated tokens (default 2048)")
    p.add_argument("--temperature", type=float, default=0.85,
                   help="jetstream: 0 = greedy (default 0.85); openai requests set their own")
    p.add_argument("--top-k", type=int, default=20, help="jetstream: 0 = off (default 20, the eval setting)")
    p.add_argument("--top-p", type=float, default=0.95, help="jetstream: 1.0 = off (default 0.95, the eval setting)")
    p.add_argument("--seed", type=int, default=0, help="jetstream: sampling seed (default 0)")
    p.add_argument("--eos-token-id", type=int, action="append", default=None,
                   help="EOS id (repeatable; default: from config.json / the tokenizer)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameter / compute dtype (default: float32 for HF folders, as stored for ulorl)")
    p.add_argument("--threads", type=int, default=None,
                   help="jetstream: gRPC worker threads (default: max(slots, 16))")
    p.add_argument("--max-requests", type=int, default=0,
                   help="stop after answering this many requests (Decode calls; openai: POSTs to /v1/), errors "
                        "included (default 0 = never)")
    p.add_argument("--shutdown-after", type=float, default=0.0,
                   help="stop after this many seconds (default 0 = never)")
    p.set_defaults(func=run_cli)
    return p


class Server:
    """JetStream's LLMOrchestrator servicer (ours rejects bad requests) on a grpc.aio server,
    as jetstream.core.server_lib.JetStreamServer does, but bound to `host` (it binds [::])."""

    def __init__(self, driver: Any, *, host: str, port: int, threads: int):
        import grpc

        from ulorl_jax.decode.jetstream_backend import (
            import_jetstream,
            jetstream_classes,
        )

        js = import_jetstream()
        self.driver = driver
        self.answered = 0
        self._count_lock = threading.Lock()
        self._executor = futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="ulorl-serve-loop", daemon=True)
        self._thread.start()

        async def build():
            server = grpc.aio.server(self._executor)
            servicer = jetstream_classes().Orchestrator(driver, on_done=self._count)
            js.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
            address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"  # IPv6
            bound = server.add_insecure_port(address)
            await server.start()
            return server, bound

        try:
            self._server, self.port = asyncio.run_coroutine_threadsafe(build(), self._loop).result()
        except Exception as err:
            self._shutdown_loop()
            raise ValueError(f"cannot serve on {host}:{port}: {err}") from err
        if not self.port:
            self._shutdown_loop()
            raise ValueError(f"cannot bind {host}:{port}")

    def _count(self) -> None:
        with self._count_lock:
            self.answered += 1

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._executor.shutdown(wait=False)

    def stop(self, grace: float = 2.0) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result(timeout=grace + 10)
        self.driver.stop()
        self._shutdown_loop()


def _check_options(args):
    """The options' own errors and the model source, before the slow JetStream import and model load."""
    from ulorl_jax import model_source

    for name in ("max_concurrent_decodes", "max_prefill_length", "max_cache_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prefill_length > args.max_cache_len:
        raise ValueError(f"--max-prefill-length {args.max_prefill_length} > --max-cache-len {args.max_cache_len}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_requests < 0 or args.shutdown_after < 0:
        raise ValueError("--max-requests and --shutdown-after must be >= 0")
    return model_source.resolve(args.model)


def _build_engine(args, source):
    from ulorl_jax import model_source
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.decode.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    loaded = model_source.load(source, dtype=args.dtype)
    tokenizer, model = loaded.tokenizer, loaded.model
    eos = tuple(args.eos_token_id) if args.eos_token_id else model_source.eos_token_ids(model.config, tokenizer)
    return PolicyEngine(model, max_concurrent_decodes=args.max_concurrent_decodes,
                        max_prefill_length=args.max_prefill_length, max_cache_len=args.max_cache_len,
                        sampling=sampling, eos_token_ids=eos, tokenizer=tokenizer)


def run_cli(args) -> int:
    if args.api == "openai":
        from ulorl_jax.serving.server import run_openai

        args.port = 8000 if args.port is None else args.port
        _check_options(args)
        return run_openai(args)
    from ulorl_jax.decode.jetstream_backend import (
        JetStreamUnavailable,
        import_jetstream,
        make_driver,
    )

    args.port = 9000 if args.port is None else args.port
    source = _check_options(args)
    try:
        import_jetstream()
    except JetStreamUnavailable as err:
        raise ValueError(str(err)) from None
    engine = _build_engine(args, source)
    driver = make_driver(engine, engine.load_params(), seed=args.seed)
    try:
        server = Server(driver, host=args.host, port=args.port,
                        threads=args.threads or max(engine.max_concurrent_decodes, 16))
    except BaseException:
        driver.stop()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ulorl serve: listening on {args.host}:{server.port} ({engine.max_concurrent_decodes} slots, "
          f"max prefill {engine.max_prefill_length}, cache {engine.max_cache_len}, sampling {engine.sampling})",
          flush=True)
    deadline = time.monotonic() + args.shutdown_after if args.shutdown_after else None
    reason, status = "signal", 0
    while not stop.wait(0.1):
        if driver.failed.is_set():
            reason, status = f"a JetStream thread failed: {driver.failure!r}", 1
            break
        if args.max_requests and server.answered >= args.max_requests:
            reason = f"answered {server.answered} requests (--max-requests)"
            break
        if deadline is not None and time.monotonic() >= deadline:
            reason = f"--shutdown-after {args.shutdown_after:g}s"
            break
    server.stop()
    print(f"ulorl serve: stopped ({reason})", flush=True)
    return status
