"""The engine behind the HTTP server: every client's requests decoded together by one `PolicyEngine.run`.

One thread owns the engine. It keeps a run open (`run(..., feed=, on_update=)`): requests submitted
by the event loop are fed into it between decode calls, so a new client joins the batch being decoded
(continuous batching, the paged KV cache and its preemption included) instead of waiting for it.
Tokens go back to each request's asyncio queue as they come. A request whose client has gone (or whose
stop string the host saw) is cancelled: its slot and pages are freed at the next decode call, or it is
dropped before it is admitted.

Sampling options (temperature, top-k, top-p) are static in the engine's compiled steps, so one run
decodes requests of one `SamplingParams`; a request with other options waits at the head of the queue,
the run stops admitting, finishes what it holds and the next run starts with the waiting request's
options (first come, first served). Seeds, budgets and prompts are per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections import deque
from typing import Any

from ulorl_jax.decode.engine import Completion, PolicyEngine, Request, RunStats
from ulorl_jax.decode.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Update:
    """New tokens of a request and, once it has ended, why: "eos", "budget" or "cancelled"; `error`: the
    engine failed (a server fault, never a bad request: requests are checked before they are submitted)."""

    tokens: list[int]
    stop: str = ""
    error: BaseException | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One sample (one choice) in the engine, and the asyncio queue its updates go to."""

    request: Request
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the event loop; read by the engine thread at its next update
    sent: int = 0  # tokens already put on `updates`

    def cancel(self) -> None:
        self.cancelled = True

    def _put(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop has closed (server shutting down)
            self.cancelled = True

    def on_update(self, c: Completion) -> bool:
        """Called on the engine thread (`PolicyEngine.run`'s on_update); False: end it now."""
        if self.cancelled:
            return False
        new, self.sent = c.tokens[self.sent:], len(c.tokens)
        self._put(Update(list(new), c.stop))
        return True

    def fail(self, err: BaseException) -> None:
        self._put(Update([], "error", err))


class EngineDriver:
    """Owns `engine` on a thread; `submit(jobs)` from any thread, `stop()` to end it."""

    def __init__(self, engine: PolicyEngine, params: Any, *, steps_per_call: int = 8):
        self.engine, self.params, self.steps_per_call = engine, params, int(steps_per_call)
        self._inbox: queue.Queue = queue.Queue()
        self._held: deque[Job] = deque()  # submitted, not yet fed to a run (in submission order)
        self._stop = threading.Event()
        self.runs = 0  # engine runs started (one per change of sampling options)
        self.requests = 0  # jobs fed to the engine
        self.run_stats: deque[RunStats] = deque(maxlen=64)  # the engine's figures of the latest runs
        self._thread = threading.Thread(target=self._loop, name="ulorl-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue `jobs` (a request's choices, together). Check each request first (`engine.check_request`)."""
        self._inbox.put(list(jobs))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _drain(self, wait: float) -> None:
        """Move submitted jobs to `_held`, waiting up to `wait` seconds for the first."""
        try:
            self._held.extend(self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait())
            while True:
                self._held.extend(self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(0.1)
            while self._held and self._held[0].cancelled:
                self._held.popleft()
            if self._held:
                self._run(self._held[0].sampling)

    def _run(self, sampling: SamplingParams) -> None:
        """One engine run: queued jobs with these sampling options, fed in as they come (`_feed`)."""
        jobs: list[Job] = []  # request i of the run is jobs[i]
        self.runs += 1
        try:
            _, stats = self.engine.run(self.params, [], sampling=sampling, steps_per_call=self.steps_per_call,
                                       feed=lambda idle: self._feed(idle, sampling, jobs),
                                       on_update=lambda i, c: jobs[i].on_update(c))
            self.run_stats.append(stats)
        except Exception as err:  # a server fault: fail what this run holds, keep serving the rest
            log.exception("engine run failed")
            for job in jobs:
                job.fail(err)

    def _feed(self, idle: bool, sampling: SamplingParams, jobs: list[Job]) -> list[Request] | None:
        """The run's `feed`: queued jobs with this run's sampling options, in order; None (the run ends
        when its requests are done) once the server stops or a job with other options heads the queue."""
        if self._stop.is_set():
            for job in self._held:
                job.fail(RuntimeError("the server is shutting down"))
            self._held.clear()
            return None
        self._drain(0.05 if idle else 0.0)
        take = []
        while self._held and (self._held[0].cancelled or self._held[0].sampling == sampling):
            job = self._held.popleft()
            if not job.cancelled:
                take.append(job)
        if not take and self._held:
            return None
        jobs.extend(take)
        self.requests += len(take)
        return [job.request for job in take]
