"""`ulorl serve` end to end: a subprocess on a free loopback port, JetStream's own gRPC client stub.

Bounded: a fixed number of requests, the server stops itself (--max-requests, with
--shutdown-after as a backstop), and the test kills it only if it outlives that.
"""

import os
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ulorl_jax.decode import jetstream_backend as jb

pytestmark = pytest.mark.slow
needs_jetstream = pytest.mark.skipif(not jb.jetstream_available(), reason="google-jetstream is not installed "
                                     "(pip install -e '.[jetstream]'); CI installs it")

VOCAB, EOS, MAX_PREFILL, CACHE = 97, 0, 16, 32
WORDS = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Our orbax folder plus a tiny word-level tokenizer (no downloads)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.models.native import save_native

    path = tmp_path_factory.mktemp("serve") / "tiny"
    save_native(init_model(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2), seed=3),
                path)
    tok = Tokenizer(models.WordLevel(WORDS, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                         unk_token="<unk>").save_pretrained(path)
    return path


def reference_greedy(fwd, prompt, n):
    """Full forward (no KV cache) + argmax; stops after EOS as the engine does (EOS is returned)."""
    seq = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, CACHE), np.int32)
        tokens[0, :len(seq)] = seq  # right padding: causal attention never looks at it
        seq.append(int(jnp.argmax(fwd(jnp.asarray(tokens))[0, len(seq) - 1])))
        if seq[-1] == EOS:
            break
    return seq[len(prompt):]


def _start(model_dir, n_requests):
    from ulorl_jax.bench.serve import launch

    return launch(["serve", "--api", "jetstream", "--model", str(model_dir), "--port", "0",
                   "--max-concurrent-decodes", "2", "--max-prefill-length", str(MAX_PREFILL), "--max-cache-len",
                   str(CACHE), "--temperature", "0", "--top-k", "0", "--top-p", "1", "--eos-token-id", str(EOS),
                   "--max-requests", str(n_requests), "--shutdown-after", "300"],
                  env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))


def _wait_for(lines, proc, needle, timeout):
    from ulorl_jax.bench.serve import wait_for_line

    return wait_for_line(lines, proc, needle, timeout)


@needs_jetstream
def test_serve_grpc_roundtrip(model_dir):
    import grpc

    from ulorl_jax.models.native import load_native

    js = jb.import_jetstream()
    pb, pb_grpc = js.jetstream_pb2, js.jetstream_pb2_grpc
    rng = np.random.default_rng(1)
    good = [rng.integers(1, VOCAB, n).tolist() for n in (5, 11, 3, 7)]
    text_ids = [WORDS["w3"], WORDS["w4"], WORDS["w5"]]
    model = load_native(model_dir)
    fwd = jax.jit(lambda t: model(t))
    expected = [reference_greedy(fwd, p, 6) for p in good + [text_ids]]

    proc, lines = _start(model_dir, n_requests=8)
    try:
        line, _ = _wait_for(lines, proc, "listening on", timeout=240)
        address = line.split("listening on ")[1].split()[0]
        assert address.startswith("127.0.0.1:"), line  # loopback by default
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).is_live

            def decode(req):
                out = []
                for resp in stub.Decode(req, timeout=120):
                    out += list(resp.stream_content.samples[0].token_ids)
                return out

            def tokens(ids, max_tokens):
                return pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=ids),
                                        max_tokens=max_tokens)

            # Three at once on two slots: JetStream's generate thread refills the freed slot.
            with futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda p: decode(tokens(p, 6)), good[:3]))
            assert got == expected[:3]
            text = list(stub.Decode(pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text="w3 w4 w5"),
                                                     max_tokens=6), timeout=120))
            assert [t for r in text for t in r.stream_content.samples[0].token_ids] == expected[4]
            assert "".join(r.stream_content.samples[0].text for r in text).startswith("w")
            bad = {
                "max_prefill_length": tokens([5] * (MAX_PREFILL + 4), 4),  # over-long prompt
                "max_tokens=0": tokens(good[3], 0),
                "unknown token ids": tokens([5, VOCAB + 7], 4),
            }
            for needle, req in bad.items():
                with pytest.raises(grpc.RpcError) as err:
                    decode(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert needle in err.value.details()
            assert decode(tokens(good[3], 6)) == expected[3]  # still serving after the errors
        _wait_for(lines, proc, "stopped (answered 8 requests", timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_bad_options_are_clear(model_dir, capsys):
    """Bad options and a missing model are named before JetStream is imported: with or without the extra."""
    from ulorl_jax.cli import main

    assert main(["serve", "--model", str(model_dir), "--max-prefill-length", "64", "--max-cache-len", "32"]) == 2
    assert "--max-prefill-length 64 > --max-cache-len 32" in capsys.readouterr().err
    assert main(["serve", "--model", str(model_dir / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
