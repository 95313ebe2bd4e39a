"""`RewardScorer`: score a batch of finished samples, never letting a reward kill the run.

ULORL.md §4: rewards are in {0, 1}; truncated samples (global max reached,
§1 termination 3) get 0. Every reward call is bounded by `timeout_s`; a
timeout, an exception, a dead worker, or a non-finite / non-number value
gives reward 0 and bumps a counter in `stats` (and logs a warning), and the
batch goes on.

kinds:
- "rule": extraction="boxed" (default, the paper's rule): extract the final
  answer (`answer_pattern` regex or last \\boxed{}, linear time), then
  equivalence. Only pairs whose math-verify verdict is certain (the same
  answer, two integers) are decided in-process; the rest go to math-verify in
  the sandbox. extraction="math_verify": the whole response (or the pattern's
  match) goes to math-verify's own extraction in the sandbox. math-verify's own
  options (`float_rounding`, `strict`, `extraction_config`, ...: `MathVerifyOptions`)
  reach every math-verify call, in the workers and in-process; the in-process
  rules abstain under non-default parse options.
- "custom": `custom_fn` = "package.module:function" with
  fn(prediction_text, reference, metadata) -> float, always sandboxed.
- "verifier": a generative judge model (rewards/verifier.py), built by the
  caller and passed as `verifier=` (any object with `judge(items) -> list[bool | None]`).
  Answers equal by the cheap rules skip the judge; a failing judge gives 0s
  for its batch, counted as crashes.
workers: sandbox processes, None = the machine's cores (at least 2); 0 runs
everything in this process (no hard kill: math-verify's own signal timeout,
and a SIGALRM timer for custom functions, on the main thread only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import numbers
import os
import signal
import threading
from typing import Any, Sequence

from ulorl_jax.choices import EXTRACTIONS, REWARD_KINDS  # noqa: F401  (re-exported)
from ulorl_jax.rewards.equivalence import MathVerifyOptions, math_verify_options
from ulorl_jax.rewards.extract import compile_answer_pattern, extract_answer
from ulorl_jax.rewards.rule import quick_rule_reward, reference_answer
from ulorl_jax.rewards.sandbox import Outcome, SandboxPool, resolve_function

logger = logging.getLogger(__name__)

_MATH_VERIFY_FN = "ulorl_jax.rewards.rule:math_verify_reward"
_MATH_VERIFY_RESPONSE_FN = "ulorl_jax.rewards.rule:math_verify_response_reward"
_MATH_VERIFY_FNS = {_MATH_VERIFY_FN: "math_verify_equivalence",
                    _MATH_VERIFY_RESPONSE_FN: "math_verify_response_equivalence"}
_BOXED_RESPONSE_FN = "ulorl_jax.rewards.rule:boxed_response_reward"
# Responses longer than this (characters; ~8k tokens) are scored whole in the sandbox, extraction included:
# in-process work per response stays at a few milliseconds whatever its length.
IN_PROCESS_CHARS = 32_768
_LOGGED_PER_KIND = 10
_VERDICT_CACHE_SIZE = 100_000  # warnings per event kind before going quiet (counters keep counting)

ScoreItem = tuple[str, str, bool, dict]  # (prediction_text, reference, truncated, metadata)


@dataclasses.dataclass
class RewardConfig:
    """How rewards are computed. See the module docstring for `kind`."""

    kind: str = "rule"
    answer_pattern: str | None = None  # regex; group 1 (or whole match) of the last match is the answer
    timeout_s: float = 5.0  # per reward call
    custom_fn: str | None = None  # "package.module:function" when kind == "custom"
    workers: int | None = None  # sandbox processes; None: the machine's cores (>= 2); 0: run in-process
    extraction: str = "boxed"  # kind "rule": "boxed" (last \\boxed{} / answer_pattern) | "math_verify"
    # math-verify's own options, its names and defaults (MathVerifyOptions documents them)
    float_rounding: int = 6
    numeric_precision: int = 15
    strict: bool = True
    allow_set_relation_comp: bool = False
    extraction_config: tuple[str, ...] = ("latex", "expr")
    boxed_match_priority: int = 50
    try_extract_without_anchor: bool = True
    fallback_mode: str = "first_match"
    extraction_mode: str = "any_match"

    @property
    def math_verify(self) -> MathVerifyOptions:
        """The math-verify options above as one picklable value (what the workers get with each call)."""
        return math_verify_options(self)

    def validate(self) -> None:
        if self.kind not in REWARD_KINDS:
            raise ValueError(f"reward kind {self.kind!r} is not one of {REWARD_KINDS}")
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"reward extraction {self.extraction!r} is not one of {EXTRACTIONS}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {self.timeout_s}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"reward workers must be >= 0, got {self.workers}")
        if self.kind == "custom" and not self.custom_fn:
            raise ValueError("reward kind 'custom' needs custom_fn='package.module:function'")
        if self.answer_pattern is not None:
            compile_answer_pattern(self.answer_pattern)
        math_verify_options(self)  # validated: a ValueError names reward.<option>

    @property
    def num_workers(self) -> int:
        """`workers`, with None resolved to the cores this process may use (at least 2)."""
        if self.workers is not None:
            return self.workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(2, cores)


@dataclasses.dataclass
class RewardStats:
    """Running counters since the scorer was built (or `reset()`)."""

    scored: int = 0  # samples scored
    truncated: int = 0  # reward 0 without a call (§1 termination 3)
    no_answer: int = 0  # rule kind: nothing to extract
    quick: int = 0  # rule kind: decided in-process without math-verify (cheap rules or a cached verdict)
    sandboxed: int = 0  # calls sent to the sandbox / the judge (or run in-process when workers == 0)
    timeouts: int = 0
    crashes: int = 0  # raised, or the worker process died
    bad_values: int = 0  # not a real number, NaN or inf
    unparsable: int = 0  # verifier: judge said neither yes nor no

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


def as_reward(value: Any) -> float | None:
    """A finite float from a number-like value (bool, int, float, numpy scalar), else None."""
    if isinstance(value, numbers.Real) or (hasattr(value, "dtype") and getattr(value, "shape", None) == ()):
        try:
            result = float(value)
        except (TypeError, ValueError):
            return None
        return result if math.isfinite(result) else None
    return None


def import_custom_fn(path: str):
    """`reward.custom_fn` ("package.module:function") imported; a ValueError names the option, the module and
    the fix (the `ulorl` command does not search the working directory; sandbox workers get this sys.path)."""
    import importlib

    module, sep, attr = path.partition(":")
    try:
        if sep and module and attr:  # else resolve_function names the expected form
            importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            top = module.split(".")[0]
            raise ValueError(
                f"reward.custom_fn={path!r}: module {module!r} is not importable ({err}): install the package "
                f"that provides it, or add the folder that holds {top!r} ({top}.py or {top}/) to PYTHONPATH, e.g. "
                f"`PYTHONPATH=/path/to/folder ulorl train ...` (the `ulorl` command does not search the working "
                f"directory)") from None
        raise ValueError(f"reward.custom_fn={path!r}: module {module!r} imports {err.name!r}, which is not "
                         f"installed ({err}): install it") from None
    except Exception as err:  # noqa: BLE001  (the user's module failed while importing)
        raise ValueError(f"reward.custom_fn={path!r}: importing module {module!r} failed: "
                         f"{type(err).__name__}: {err}") from None
    try:
        return resolve_function(path)
    except ValueError as err:
        raise ValueError(f"reward.custom_fn={path!r}: {err}") from None


class RewardScorer:
    """Scores batches of (prediction_text, reference, truncated, metadata); see module docstring.

    Holds a sandbox pool (started on first need); call `close()` or use it
    as a context manager when done.
    """

    def __init__(self, config: RewardConfig | None = None, *, verifier: Any = None):
        self.config = config or RewardConfig()
        self.config.validate()
        if self.config.kind == "verifier" and verifier is None:
            raise ValueError("reward kind 'verifier' needs verifier=GenerativeVerifier(...)")
        # resolved here too so that a bad path fails now, not as a crash per sample
        self._custom = import_custom_fn(self.config.custom_fn) if self.config.kind == "custom" else None
        self.verifier = verifier
        self.stats = RewardStats()
        self._options = self.config.math_verify  # fixed for the scorer's life, like its verdict cache
        self._pool: SandboxPool | None = None
        self._logged: dict[str, int] = {}
        # math-verify verdicts by (answer, reference): a group's samples often repeat an answer
        self._verdicts: dict[tuple[str, str], float] = {}

    # -- public ---------------------------------------------------------
    def score(self, batch: Sequence[ScoreItem]) -> list[float]:
        """One reward per item, in order. Never raises for a bad reward; see `stats`."""
        rewards = [0.0] * len(batch)
        todo: list[int] = []
        for i, (_, _, truncated, _) in enumerate(batch):
            self.stats.scored += 1
            if truncated:
                self.stats.truncated += 1
                continue
            todo.append(i)
        if self.config.kind == "rule":
            self._score_rule(batch, todo, rewards)
        elif self.config.kind == "custom":
            calls = [(batch[i][0], batch[i][1], dict(batch[i][3] or {})) for i in todo]
            self._run(self.config.custom_fn, calls, todo, rewards, batch)
        else:
            self._score_verifier(batch, todo, rewards)
        return rewards

    def wait_ready(self) -> None:
        """Block until the sandbox workers (once started by a first `score`) have imported their modules, e.g.
        a worker restarting after a timeout: pays start-up before a timed batch."""
        if self._pool is not None:
            self._pool.wait_ready()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- kinds ----------------------------------------------------------
    def _score_rule(self, batch, todo: list[int], rewards: list[float]) -> None:
        whole = self.config.extraction == "math_verify"  # math-verify extracts from the response itself
        pattern = self.config.answer_pattern
        hard: dict[tuple[str, ...], list[int]] = {}  # math-verify calls by verdict key, deduplicated
        long: dict[tuple[str, ...], list[int]] = {}  # long responses: the whole rule in the sandbox
        args: dict[tuple[str, ...], tuple] = {}  # each key's call
        for i in todo:
            text = batch[i][0]
            if not whole and len(text) > IN_PROCESS_CHARS:
                key = ("long", _digest(text), str(batch[i][1]))
                if not self._cached(key, i, rewards):
                    long.setdefault(key, []).append(i)
                    args[key] = (text, str(batch[i][1]), pattern, self._options)
                continue
            answer = text if whole and pattern is None else extract_answer(text, pattern)
            if answer is None:
                self.stats.no_answer += 1
                continue
            reference = reference_answer(batch[i][1])
            # a long answer (a whole response) is remembered by its digest: the verdict cache is kept
            key = (_digest(answer) if whole or len(answer) > 256 else answer, reference)
            quick = None if whole else quick_rule_reward(answer, reference, self._options)
            if quick is not None:
                self.stats.quick += 1
                rewards[i] = quick
            elif not self._cached(key, i, rewards):
                hard.setdefault(key, []).append(i)
                args[key] = (answer, reference, self._options)
        self._run_grouped(_MATH_VERIFY_RESPONSE_FN if whole else _MATH_VERIFY_FN, hard, args, rewards, batch)
        self._run_grouped(_BOXED_RESPONSE_FN, long, args, rewards, batch)

    def _cached(self, key, i: int, rewards: list[float]) -> bool:
        verdict = self._verdicts.get(key)
        if verdict is None:
            return False
        self.stats.quick += 1
        rewards[i] = verdict
        return True

    def _run_grouped(self, fn: str, groups: dict, args: dict, rewards: list[float], batch) -> None:
        """One sandboxed call per key; the samples sharing a key share its verdict, which is remembered
        when it is a real one (never a timeout's 0)."""
        keys = list(groups)
        firsts = [groups[key][0] for key in keys]
        statuses = self._run(fn, [args[key] for key in keys], firsts, rewards, batch)
        if len(self._verdicts) > _VERDICT_CACHE_SIZE:
            self._verdicts.clear()
        for key, first, status in zip(keys, firsts, statuses):
            for i in groups[key][1:]:
                rewards[i] = rewards[first]
            if status == "ok":
                self._verdicts[key] = rewards[first]

    def _score_verifier(self, batch, todo: list[int], rewards: list[float]) -> None:
        """Extract the final answer; equal by the cheap rules -> 1 without a judge call; else ask the judge."""
        asked: list[int] = []
        items: list[tuple[str, str, dict]] = []
        for i in todo:
            answer = extract_answer(batch[i][0], self.config.answer_pattern)
            if answer is None:
                self.stats.no_answer += 1
                continue
            reference = reference_answer(batch[i][1])
            if quick_rule_reward(answer, reference, self._options) == 1.0:
                self.stats.quick += 1
                rewards[i] = 1.0
                continue
            asked.append(i)
            items.append((answer, reference, dict(batch[i][3] or {})))
        if not items:
            return
        self.stats.sandboxed += len(items)
        try:
            verdicts = list(self.verifier.judge(items))
            if len(verdicts) != len(items):
                raise ValueError(f"verifier returned {len(verdicts)} verdicts for {len(items)} items")
        except Exception as err:  # noqa: BLE001  (a broken judge costs this batch's rewards, not the run)
            self.stats.crashes += len(items)
            self._event("crash", asked[0], batch, f"verifier failed: {type(err).__name__}: {err}")
            return
        for i, verdict in zip(asked, verdicts):
            if verdict is None:
                self.stats.unparsable += 1
                self._event("unparsable", i, batch, "verifier output is neither yes nor no")
            else:
                rewards[i] = float(verdict)

    # -- execution ------------------------------------------------------
    def _run(self, fn_path: str, calls: list[tuple], indices: list[int], rewards: list[float],
             batch) -> list[str]:
        """Run fn(*args) per call under the timeout; write rewards[indices]; return outcome statuses."""
        if not calls:
            return []
        self.stats.sandboxed += len(calls)
        if self.config.num_workers == 0:
            outcomes = [self._run_inline(fn_path, args) for args in calls]
        else:
            if self._pool is None:
                self._pool = SandboxPool(self.config.num_workers, preload=_preload_for(fn_path))
            outcomes = self._pool.map(fn_path, calls, self.config.timeout_s)
        for i, outcome in zip(indices, outcomes):
            rewards[i] = self._value(outcome, i, batch)
        return [o.status for o in outcomes]

    def _run_inline(self, fn_path: str, args: tuple) -> Outcome:
        try:
            if fn_path in _MATH_VERIFY_FNS:
                import ulorl_jax.rewards.equivalence as equivalence

                on_main = threading.current_thread() is threading.main_thread()
                seconds = max(1, math.ceil(self.config.timeout_s)) if on_main else None
                prediction, reference, options = args
                verdict = getattr(equivalence, _MATH_VERIFY_FNS[fn_path])(prediction, reference, timeout_s=seconds,
                                                                          options=options)
                return Outcome("ok", float(verdict))
            fn = self._custom if fn_path == self.config.custom_fn else resolve_function(fn_path)
            with _alarm(self.config.timeout_s):
                return Outcome("ok", fn(*args))
        except _InlineTimeout:
            return Outcome("timeout", detail=f"no result after {self.config.timeout_s:g}s")
        except Exception as err:  # noqa: BLE001
            return Outcome("error", detail=f"{type(err).__name__}: {err}")

    def _value(self, outcome: Outcome, i: int, batch) -> float:
        if outcome.status == "timeout":
            self.stats.timeouts += 1
            self._event("timeout", i, batch, outcome.detail)
            return 0.0
        if outcome.status in ("error", "crash"):
            self.stats.crashes += 1
            self._event(outcome.status, i, batch, outcome.detail)
            return 0.0
        value = as_reward(outcome.value)
        if value is None:
            self.stats.bad_values += 1
            self._event("bad_value", i, batch, f"reward function returned {outcome.value!r}")
            return 0.0
        return value

    def _event(self, kind: str, i: int, batch, detail: str) -> None:
        seen = self._logged.get(kind, 0)
        self._logged[kind] = seen + 1
        if seen < _LOGGED_PER_KIND:
            excerpt = batch[i][0][-80:].replace("\n", "\\n")
            logger.warning("reward %s for batch item %d (reward 0): %s; response tail: %r%s", kind, i, detail,
                           excerpt, " (further events of this kind are only counted)"
                           if seen + 1 == _LOGGED_PER_KIND else "")


def _digest(text: str) -> str:
    return "blake2b:" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _preload_for(fn_path: str) -> tuple[str, ...]:
    module = fn_path.partition(":")[0]
    return ("math_verify", module) if fn_path in _MATH_VERIFY_FNS else (module,)


class _InlineTimeout(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """SIGALRM timer on the main thread; no-op elsewhere (signals only reach the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _InlineTimeout()

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
