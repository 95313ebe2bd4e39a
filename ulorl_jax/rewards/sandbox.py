"""Crash- and hang-proof calls: a small pool of long-lived worker processes.

A reward function (math-verify on adversarial LaTeX, a user's custom code)
may hang, raise, or kill its process. Each call here runs in a worker with a
per-call deadline; the parent never blocks past it:
- raise            -> Outcome("error"), the worker lives on;
- past the deadline -> the worker is SIGKILLed and replaced, Outcome("timeout");
- worker dies       -> Outcome("crash"), the worker is replaced.

Workers start once (a fresh interpreter each, safe next to JAX's threads,
which plain fork is not) and serve many calls, so a batch of hundreds of
short calls costs pipe round trips, not process starts. The
timer of a call starts when it is handed to a ready worker (imports done).
Functions are named by import path "package.module:function" so that
workers can import them; the parent's sys.path is passed on.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

_START_TIMEOUT_S = 120.0  # a worker that has not imported its modules by then is broken


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Result of one sandboxed call. status: "ok" | "error" | "timeout" | "crash"."""

    status: str
    value: Any = None
    detail: str = ""


def resolve_function(path: str) -> Callable:
    """Import "package.module:function" (dots after ':' walk attributes). ValueError names what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"function path {path!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of function path {path!r}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (function path {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable (got {type(obj).__name__})")
    return obj


def _worker_entry(fd: int, preload: Sequence[str]) -> None:
    """Worker process main: serve (task_id, fn_path, args) -> (task_id, status, value) until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    _die_with_parent()
    conn = multiprocessing.connection.Connection(fd)
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001  (a failing preload shows up at call time instead)
            pass
    functions: dict[str, Callable] = {}
    conn.send(("ready", os.getpid(), None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, fn_path, args = message
        try:
            fn = functions.get(fn_path)
            if fn is None:
                fn = functions[fn_path] = resolve_function(fn_path)
            reply = (task_id, "ok", fn(*args))
        except BaseException as err:  # noqa: BLE001  (SystemExit from user code too)
            reply = (task_id, "error", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except Exception as err:  # noqa: BLE001  (unpicklable return value)
            conn.send((task_id, "error", f"cannot send result back: {type(err).__name__}: {err}"))


def _die_with_parent() -> None:
    """Exit when the parent dies, even mid-call: a daemon thread polls the parent pid.

    (Not PR_SET_PDEATHSIG: it fires when the parent *thread* that started the
    worker exits, which would kill workers started from a short-lived thread.)
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


_BOOTSTRAP = (
    "import json, os, sys; "
    "sys.path[:0] = [p for p in json.loads(os.environ['ULORL_SANDBOX_SYS_PATH']) if p not in sys.path]; "
    "from ulorl_jax.rewards.sandbox import _worker_entry; "
    "_worker_entry(int(sys.argv[1]), json.loads(sys.argv[2]))"
)


class _Worker:
    """One worker: a fresh `python -c` process (not multiprocessing: that re-runs the parent's __main__
    in spawn/forkserver children, and plain fork is unsafe next to JAX's threads), talking
    multiprocessing.connection over a socketpair, in its own session so a kill takes its children too."""

    def __init__(self, preload: Sequence[str]):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, ULORL_SANDBOX_SYS_PATH=json.dumps(sys.path))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(child_sock.fileno()), json.dumps(list(preload))],
            pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno()
            if _has_fileno(sys.stderr) else None, start_new_session=True)
        child_sock.close()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        self.started = time.monotonic()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (index in batch, deadline)

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    for w in workers:
        w.kill()
    workers.clear()


class SandboxPool:
    """`workers` long-lived processes running named functions with per-call timeouts.

    Use as a context manager or call `close()`; leftover workers are also
    killed when the pool is garbage-collected or the interpreter exits.
    `restarts` counts workers replaced after a timeout or crash.
    """

    def __init__(self, workers: int = 2, *, preload: Sequence[str] = ()):
        if workers < 1:
            raise ValueError(f"SandboxPool needs workers >= 1, got {workers}")
        self._preload = tuple(preload)
        self.num_workers = workers
        self.restarts = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._preload)
        self._workers.append(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self.restarts += 1
        self._spawn()

    def map(self, fn_path: str, calls: Sequence[tuple], timeout_s: float) -> list[Outcome]:
        """Run fn(*args) for every args in `calls`; one Outcome per call, in order."""
        if self._finalizer.alive is False:
            raise ValueError("SandboxPool is closed")
        while len(self._workers) < self.num_workers:
            self._spawn()
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        while pending or any(w.task for w in self._workers):
            now = time.monotonic()
            for worker in list(self._workers):  # hand out work
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    try:
                        worker.conn.send((index, fn_path, tuple(calls[index])))
                    except (OSError, ValueError):  # died while idle: replace, retry the call
                        pending.appendleft(index)
                        self._replace(worker)
                        continue
                    worker.task = (index, now + timeout_s)
            deadlines = [w.task[1] for w in self._workers if w.task]
            deadlines += [w.started + _START_TIMEOUT_S for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0
            ready = multiprocessing.connection.wait([w.conn for w in self._workers], timeout=wait_s)
            by_conn = {w.conn: w for w in self._workers}
            for conn in ready:
                worker = by_conn[conn]
                try:
                    task_id, status, value = conn.recv()
                except (EOFError, OSError) as err:  # the process died
                    if worker.task is not None:
                        code = worker.process.poll()
                        outcomes[worker.task[0]] = Outcome("crash", detail=f"worker died (exit code {code}): {err}")
                    elif not worker.ready:
                        raise RuntimeError(f"sandbox worker failed to start (exit code {worker.process.poll()})")
                    self._replace(worker)
                    continue
                if task_id == "ready":
                    worker.ready = True
                    continue
                outcomes[task_id] = Outcome(status, value if status == "ok" else None,
                                            "" if status == "ok" else str(value))
                worker.task = None
            now = time.monotonic()
            for worker in list(self._workers):  # enforce deadlines
                if worker.task is not None and now >= worker.task[1]:
                    outcomes[worker.task[0]] = Outcome("timeout", detail=f"no result after {timeout_s:g}s")
                    self._replace(worker)
                elif not worker.ready and now >= worker.started + _START_TIMEOUT_S:
                    raise RuntimeError(f"sandbox worker did not start within {_START_TIMEOUT_S:g}s")
        return outcomes  # type: ignore[return-value]

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the missing workers and block until every worker has imported its modules.

        (`map` does not need this; it hands calls to workers as they become
        ready. Use it to pay the start-up before a timed batch.)
        """
        if self._finalizer.alive is False:
            raise ValueError("SandboxPool is closed")
        while len(self._workers) < self.num_workers:
            self._spawn()
        deadline = time.monotonic() + timeout_s
        while True:
            starting = [w for w in self._workers if not w.ready]
            if not starting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"sandbox workers did not start within {timeout_s:g}s")
            for conn in multiprocessing.connection.wait([w.conn for w in starting], timeout=left):
                worker = next(w for w in starting if w.conn is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"sandbox worker failed to start (exit code {worker.process.poll()})") \
                        from None
                worker.ready = message[0] == "ready"

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
