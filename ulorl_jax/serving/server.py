"""`ulorl serve` (the default `--api openai`): load the model, start the engine driver, run uvicorn.

A line `ulorl serve: listening on http://HOST:PORT/v1 ...` on stdout says it is ready (after a warm-up
request has compiled the first decode shapes). `--port 0` picks a free port (printed in that line).
`--max-requests` / `--shutdown-after` bound a run (tests, benches); SIGINT / SIGTERM stop it.
"""

from __future__ import annotations

import asyncio
import socket
import time


def check_options(args) -> None:
    for name in ("max_concurrent_decodes", "max_prefill_length", "max_cache_len", "steps_per_call"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_pages is not None and args.num_pages < 1:
        raise ValueError(f"--num-pages must be >= 1, got {args.num_pages}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key is empty")


def build_state(args):
    """The engine, its driver, the scorer and the app's state for `args` (the model loaded)."""
    from ulorl_jax import model_source
    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.serving.driver import EngineDriver
    from ulorl_jax.serving.protocol import MAX_LOGPROBS, Limits
    from ulorl_jax.serving.scoring import Scorer
    from ulorl_jax.serving.state import ServingState

    source = model_source.resolve(args.model)
    loaded = model_source.load(source, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = tuple(args.eos_token_id) if args.eos_token_id else model_source.eos_token_ids(model.config, tokenizer)
    max_len = min(args.max_cache_len, model.config.max_position_embeddings)
    max_prompt = min(args.max_prefill_length, max_len - 1)
    if max_prompt < 1:
        raise ValueError(f"--max-cache-len {args.max_cache_len} leaves no room for a prompt and a token")
    engine = PolicyEngine(model, max_concurrent_decodes=args.max_concurrent_decodes, max_prefill_length=max_prompt,
                          max_cache_len=max_len, eos_token_ids=eos, tokenizer=tokenizer, kv_cache=args.kv_cache,
                          page_size=args.page_size, num_pages=args.num_pages)
    params = engine.load_params()
    driver = EngineDriver(engine, params, steps_per_call=args.steps_per_call)
    limits = Limits(max_prompt=max_prompt, max_model_len=max_len, vocab_size=model.config.vocab_size)
    name = args.served_model_name or str(args.model).rstrip("/")
    return ServingState(engine, driver, Scorer(model, max_len, MAX_LOGPROBS), tokenizer, limits, name,
                        str(source.path), args.api_key)


def warm_up(state) -> None:
    """One greedy token and one scoring call: compiles the first shapes before clients come."""
    from ulorl_jax.decode.engine import Request
    from ulorl_jax.decode.sampling import GREEDY

    state.engine.run(state.driver.params, [Request([0], 2, 0)], sampling=GREEDY,
                     steps_per_call=state.driver.steps_per_call)
    state.scorer.score([0, 0])


def run_openai(args) -> int:
    import uvicorn

    from ulorl_jax.serving.app import build_app

    check_options(args)
    start = time.perf_counter()
    state = build_state(args)
    try:
        warm_up(state)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as err:
            raise ValueError(f"cannot serve on {args.host}:{args.port}: {err}") from None
        port = sock.getsockname()[1]
        app = build_app(state)
        answered = [0]

        @app.middleware("http")
        async def count(request, call_next):
            try:
                return await call_next(request)
            finally:
                if request.url.path.startswith("/v1/") and request.method == "POST":
                    answered[0] += 1

        config = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5)
        server = _make_server(config, f"ulorl serve: listening on http://{args.host}:{port}/v1 (model "
                                 f"{state.served_name!r}, {state.engine.max_concurrent_decodes} slots, "
                                 f"{state.engine.kv_cache} KV cache, context {state.limits.max_model_len}; "
                                 f"loaded in {time.perf_counter() - start:.1f}s)",
                              args.max_requests, args.shutdown_after, answered)
        server.run(sockets=[sock])
    finally:
        state.driver.stop()
    print(f"ulorl serve: stopped ({server.reason})", flush=True)
    return 0


def _make_server(config, ready_line: str, max_requests: int, shutdown_after: float, answered: list[int]):
    """A uvicorn.Server that prints `ready_line` once it listens and stops itself at --max-requests (POSTs
    to /v1/ answered) or --shutdown-after seconds."""
    import uvicorn

    class Server(uvicorn.Server):
        reason = "signal"

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            print(ready_line, flush=True)
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

        async def _watch(self):
            deadline = time.monotonic() + shutdown_after if shutdown_after else None
            while not self.should_exit:
                await asyncio.sleep(0.1)
                if max_requests and answered[0] >= max_requests:
                    self.reason, self.should_exit = f"answered {answered[0]} requests (--max-requests)", True
                elif deadline is not None and time.monotonic() >= deadline:
                    self.reason, self.should_exit = f"--shutdown-after {shutdown_after:g}s", True

    return Server(config)
