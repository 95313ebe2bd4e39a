"""Requests fed into an open `PolicyEngine.run` (what the server does), cancellation, and the driver that
batches concurrent clients' requests into one run."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ulorl_jax.decode.engine import PolicyEngine, Request
from ulorl_jax.decode.sampling import GREEDY, SamplingParams
from ulorl_jax.models import init_model, tiny_config
from ulorl_jax.serving.driver import EngineDriver, Job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen3"), seed=3)


def requests(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(1, 128, size=int(rng.integers(3, 12))).tolist(), int(rng.integers(5, 30)), i)
            for i in range(n)]


def paged_engine(model):  # few pages: samples get preempted while others are fed in
    return PolicyEngine(model, max_concurrent_decodes=6, max_prefill_length=16, max_cache_len=64, kv_cache="paged",
                        page_size=4, num_pages=16)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_fed_requests_equal_one_batch(model, sampling):
    """Requests fed a few at a time into an open run (paged cache, with preemption) get the tokens they get
    when they are all given at once; `on_update` sees every token and the end of each."""
    reqs = requests()
    eng = paged_engine(model)
    want, _ = eng.run(eng.load_params(), reqs, sampling=sampling, steps_per_call=2)
    batches = [reqs[:3], [], reqs[3:4], reqs[4:]]
    seen: dict[int, list[int]] = {}
    ended: dict[int, str] = {}

    def feed(idle):
        return batches.pop(0) if batches else None

    def on_update(i, c):
        seen[i] = list(c.tokens)
        if c.stop:
            ended[i] = c.stop
        return True

    got, stats = eng.run(eng.load_params(), [], sampling=sampling, steps_per_call=2, feed=feed, on_update=on_update)
    assert stats.preemptions > 0
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert seen == {i: c.tokens for i, c in enumerate(want)} and ended == {i: c.stop for i, c in enumerate(want)}


def test_on_update_false_cancels_and_frees_the_slot(model):
    """A request cancelled after its first tokens stops there (stop "cancelled"); the others are unchanged,
    and with one slot the next request is admitted into the freed one."""
    eng = PolicyEngine(model, max_concurrent_decodes=1, max_prefill_length=16, max_cache_len=64)
    reqs = [Request([5, 6, 7], 40, 0), Request([8, 9], 10, 1)]
    want, _ = eng.run(eng.load_params(), reqs, sampling=GREEDY, steps_per_call=4)
    got, _ = eng.run(eng.load_params(), reqs, sampling=GREEDY, steps_per_call=4,
                     on_update=lambda i, c: i != 0 or len(c.tokens) < 5)
    assert got[0].stop == "cancelled" and got[0].tokens == want[0].tokens[:len(got[0].tokens)]
    assert 5 <= len(got[0].tokens) < 40
    assert got[1].tokens == want[1].tokens and got[1].stop == want[1].stop


def test_driver_batches_concurrent_requests_and_switches_sampling(model):
    eng = paged_engine(model)
    reqs = requests(8)
    want, _ = eng.run(eng.load_params(), reqs, sampling=GREEDY)
    driver = EngineDriver(eng, eng.load_params(), steps_per_call=2)

    async def collect(job: Job) -> tuple[list[int], str]:
        tokens = []
        while True:
            update = await job.updates.get()
            assert update.error is None
            tokens += update.tokens
            if update.stop:
                return tokens, update.stop

    async def main():
        loop = asyncio.get_running_loop()
        greedy = [Job(r, GREEDY, loop) for r in reqs]
        sampled = [Job(Request(r.prompt_ids, r.max_new_tokens, 1), SamplingParams(temperature=1.0), loop)
                   for r in reqs[:2]]
        gone = Job(Request([3, 4], 30, 0), GREEDY, loop)
        driver.submit(greedy[:4] + [gone])  # clients at once: one run decodes them together
        driver.submit(greedy[4:])
        gone.cancel()  # its client left before it was admitted, or right after
        driver.submit(sampled)
        return await asyncio.gather(*(collect(j) for j in greedy + sampled))

    try:
        out = asyncio.run(main())
    finally:
        driver.stop()
    assert [t for t, _ in out[:8]] == [c.tokens for c in want]
    assert all(stop in ("eos", "budget") for _, stop in out)
    assert driver.runs == 2  # greedy requests in one run, then the sampled ones
    greedy_run = driver.run_stats[0]
    assert greedy_run.prefills >= 8 and greedy_run.in_flight > 2  # decoded together, not one at a time
    assert driver.requests <= 11
