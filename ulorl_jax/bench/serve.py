"""`ulorl serve` under N concurrent clients: tokens/s and latency side by side (issue 44).

    ulorl bench serve [--clients 1,8,32] [--requests 128] [--max-tokens 64] [--model DIR] [--json]

Starts `ulorl serve` (the OpenAI API) on a free loopback port, with a tiny random Qwen3 built here (no EOS,
so every request generates exactly --max-tokens) unless --model names one, and `--slots` decode slots. For
each concurrency N, N client threads send --requests greedy /v1/completions requests in all (plain HTTP, a
random token-id prompt of --prompt-len each), each client one request at a time. Reported per N: wall
seconds, completion tokens/s, request latency percentiles (p50 / p90 / p99), and tokens/s relative to one
client: the median of --repeats timed rounds, run interleaved so that each concurrency meets the same load. An untimed round of N requests at each N first compiles the shapes the timed rounds meet. The
server is a child process: the CPU line counts its share under "other processes". `--json` prints
one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from ulorl_jax.bench import harness


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("load")
    g.add_argument("--clients", default="1,8,32", help="concurrent clients per round, comma-separated (default 1,8,32)")
    g.add_argument("--requests", type=int, default=128, help="requests per round (default 128)")
    g.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default 64)")
    g.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    g.add_argument("--seed", type=int, default=0, help="prompts (default 0)")
    g.add_argument("--repeats", type=int, default=3,
                   help="timed rounds per concurrency, interleaved (1, 8, 32, 1, 8, 32, ...); the median is "
                        "reported (default 3)")
    g = parser.add_argument_group("server")
    g.add_argument("--model", default=None, help="model folder (default: a tiny random Qwen3 built here)")
    g.add_argument("--slots", type=int, default=32, help="the server's decode slots (default 32)")
    g.add_argument("--steps-per-call", type=int, default=8, help="decode steps per jitted call (default 8)")
    g.add_argument("--kv-cache", choices=["dense", "paged"], default="paged", help="default paged")
    g = parser.add_argument_group("tiny model (without --model)")
    g.add_argument("--hidden-size", type=int, default=64, help="default 64")
    g.add_argument("--layers", type=int, default=2, help="default 2")
    g.add_argument("--vocab", type=int, default=512, help="default 512")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line (last line)")
    return parser


def launch(cli_args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, queue.Queue]:
    """`ulorl CLI_ARGS` in a subprocess, and a queue of its output lines (stdout and stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "ulorl_jax.cli", *cli_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env or dict(os.environ))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def wait_for_line(lines: queue.Queue, proc: subprocess.Popen, needle: str, timeout: float) -> tuple[str, list[str]]:
    """The first output line holding `needle`, and the lines so far; RuntimeError (with the output) if none
    comes within `timeout` seconds or the process ends first."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return line, seen
    raise RuntimeError(f"no {needle!r} from `ulorl serve` within {timeout}s; its output:\n" + "".join(seen[-40:]))


def start_server(cli_args: list[str], timeout: float = 300.0, env: dict | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`ulorl serve CLI_ARGS` (OpenAI API); (process, base URL http://HOST:PORT) once it says it listens."""
    proc, lines = launch(["serve", *cli_args], env)
    try:
        line, _ = wait_for_line(lines, proc, "listening on http://", timeout)
    except RuntimeError:
        proc.kill()
        raise
    return proc, line.split("listening on ", 1)[1].split()[0].removesuffix("/v1")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _tiny_model(folder: Path, s: dict) -> Path:
    from ulorl_jax.models import init_model, tiny_config
    from ulorl_jax.models.native import save_native

    path = folder / "tiny"
    config = tiny_config("qwen3", vocab_size=s["vocab"], hidden_size=s["hidden_size"],
                         intermediate_size=2 * s["hidden_size"], num_hidden_layers=s["layers"],
                         num_attention_heads=max(1, s["hidden_size"] // 16), num_key_value_heads=1, head_dim=16,
                         eos_token_id=None)
    save_native(init_model(config, seed=s["seed"]), path)
    return path


def _complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - start, int(out["usage"]["completion_tokens"])


def _round(url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """`clients` threads share `prompts` (each sends one request at a time): wall time, tokens, latencies."""
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    latencies, tokens, errors = [], [0], []
    lock = threading.Lock()

    def client():
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            try:
                seconds, n = _complete(url, p, max_tokens)
            except Exception as err:  # noqa: BLE001  (reported below)
                errors.append(err)
                return
            with lock:
                latencies.append(seconds)
                tokens[0] += n

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed at {clients} clients: {errors[0]!r}")
    lat = np.asarray(latencies)
    return {"clients": clients, "requests": len(prompts), "tokens": tokens[0], "seconds": wall,
            "tokens_per_s": tokens[0] / wall, "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p90_s": float(np.percentile(lat, 90)), "latency_p99_s": float(np.percentile(lat, 99))}


def run(args) -> dict:
    s = {k: v for k, v in vars(args).items() if k not in ("json", "func", "command", "bench")}
    for name in ("requests", "max_tokens", "prompt_len", "repeats", "slots", "steps_per_call", "hidden_size",
                 "layers", "vocab"):
        if not isinstance(s[name], int) or s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {s[name]!r}")
    try:
        levels = [int(x) for x in str(s["clients"]).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--clients must be comma-separated integers, got {s['clients']!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--clients must be positive integers, got {s['clients']!r}")
    rng = np.random.default_rng(s["seed"])
    vocab = s["vocab"]
    with tempfile.TemporaryDirectory() as tmp:
        model = s["model"] or _tiny_model(Path(tmp), s)
        if s["model"]:
            from ulorl_jax.model_source import load, resolve

            vocab = load(resolve(model)).model.config.vocab_size
        prompts = rng.integers(0, vocab, size=(s["requests"], s["prompt_len"])).tolist()
        proc, url = start_server(["--model", str(model), "--port", "0", "--max-concurrent-decodes", str(s["slots"]),
                                  "--max-prefill-length", str(s["prompt_len"]), "--max-cache-len",
                                  str(s["prompt_len"] + s["max_tokens"]), "--steps-per-call",
                                  str(s["steps_per_call"]), "--kv-cache", s["kv_cache"]])
        try:
            for n in levels:  # compiles the prefill shapes each concurrency meets
                _round(url, prompts[:n], n, s["max_tokens"])
            load_before, cpu_before = harness.loadavg(), harness.cpu_sample()
            timed = [[_round(url, prompts, n, s["max_tokens"]) for n in levels] for _ in range(s["repeats"])]
            background = harness.background_load(cpu_before, harness.cpu_sample())
        finally:
            stop_server(proc)
    rounds = []
    for i in range(len(levels)):  # the median round of each concurrency, with the spread of its tokens/s
        runs = sorted((t[i] for t in timed), key=lambda x: x["tokens_per_s"])
        rounds.append({**runs[len(runs) // 2], "tokens_per_s_all": [x["tokens_per_s"] for x in runs]})
    base = rounds[0]["tokens_per_s"]
    for r in rounds:
        r["vs_first"] = r["tokens_per_s"] / base
    machine = harness.machine_info()
    machine.update(loadavg_before=load_before, loadavg_after=harness.loadavg(), cpu_during_timing=background)
    return {"bench": "serve", "settings": s, "rounds": rounds, "machine": machine}


def format_table(r: dict) -> str:
    s = r["settings"]
    model = s["model"] or f"tiny Qwen3 (hidden {s['hidden_size']}, {s['layers']} layers, vocab {s['vocab']})"
    lines = [f"ulorl serve (OpenAI API, {s['slots']} slots, {s['kv_cache']} KV): {s['requests']} greedy requests "
             f"per round, prompt {s['prompt_len']}, max_tokens {s['max_tokens']}; {model}",
             f"{'clients':>7} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
             f"{'vs ' + str(r['rounds'][0]['clients']):>6}"]
    for x in r["rounds"]:
        lines.append(f"{x['clients']:>7} {x['seconds']:>8.2f} {x['tokens']:>7} {x['tokens_per_s']:>9.0f} "
                     f"{x['latency_p50_s']:>7.3f} {x['latency_p90_s']:>7.3f} {x['latency_p99_s']:>7.3f} "
                     f"{x['vs_first']:>5.1f}x   (tokens/s of the {len(x['tokens_per_s_all'])} rounds: "
                     f"{', '.join(f'{v:.0f}' for v in x['tokens_per_s_all'])})")
    lines += [line for line in (harness.cpu_load_line(r["machine"]),) if line]
    return "\n".join(lines)


def _cli(args) -> int:
    result = run(args)
    return harness.print_result(result, format_table(result), args.json)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    return harness.add_bench_parser(bench_subparsers, "serve", "OpenAI API server under 1 / 8 / 32 concurrent "
                                    "clients: tokens/s and latency percentiles", __doc__, add_arguments, _cli)


def main(argv: list[str] | None = None) -> int:
    return harness.standalone_main("ulorl_jax.bench.serve", __doc__, add_arguments, _cli, argv)


if __name__ == "__main__":
    sys.exit(main())
