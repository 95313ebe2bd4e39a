"""`ulorl serve` under a bounded load: a fixed number of concurrent loopback requests, none lost or mixed up."""

from concurrent import futures

import jax
import numpy as np
import pytest
from test_serve import VOCAB, _start, _wait_for, model_dir, reference_greedy  # noqa: F401  (model_dir: fixture)

from ulorl_jax.decode import jetstream_backend as jb

pytestmark = [
    pytest.mark.skipif(not jb.jetstream_available(),
                       reason="google-jetstream is not installed (pip install -e '.[jetstream]'); CI installs it"),
    pytest.mark.slow,
]

REQUESTS, CLIENTS, MAX_TOKENS = 32, 8, 4  # 8 clients on 2 decode slots: requests queue inside the server


def test_bounded_load_loses_no_request(model_dir):  # noqa: F811
    import grpc

    from ulorl_jax.models.native import load_native

    js = jb.import_jetstream()
    pb, pb_grpc = js.jetstream_pb2, js.jetstream_pb2_grpc
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, VOCAB, int(rng.integers(2, 12))).tolist() for _ in range(REQUESTS)]
    model = load_native(model_dir)
    fwd = jax.jit(lambda t: model(t))
    expected = [reference_greedy(fwd, p, MAX_TOKENS) for p in prompts]

    proc, lines = _start(model_dir, n_requests=REQUESTS)
    try:
        line, _ = _wait_for(lines, proc, "listening on", timeout=240)
        address = line.split("listening on ")[1].split()[0]
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.OrchestratorStub(channel)

            def decode(ids):
                req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids),
                                       max_tokens=MAX_TOKENS)
                return [t for r in stub.Decode(req, timeout=180) for t in r.stream_content.samples[0].token_ids]

            with futures.ThreadPoolExecutor(CLIENTS) as pool:
                got = list(pool.map(decode, prompts))
        assert got == expected  # every request answered, each with its own prompt's tokens
        _wait_for(lines, proc, f"stopped (answered {REQUESTS} requests", timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
