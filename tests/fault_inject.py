"""Run the `ulorl` CLI with one fault injected at a chosen point (used by tests/rl/test_reliability.py).

    python tests/fault_inject.py KIND:N -- train --config tiny_cpu --run-dir DIR [...]

KIND (N counts calls within this process, from 1):
  kill-rollout      SIGKILL before the N-th batched prefill of the engine (mid rollout: some samples of the
                    step prefilled and decoding, others not yet admitted)
  kill-learner      SIGKILL right after the N-th learner update (new weights in memory, not yet saved)
  kill-ckpt-write   SIGKILL when the N-th checkpoint has written some items but not `params` (half written)
  kill-ckpt-commit  SIGKILL when the N-th checkpoint is fully written, just before its atomic rename
  enospc            from the N-th checkpoint on, the background commit fails with OSError(ENOSPC)
  eacces            from the N-th checkpoint on, creating the step directory fails with PermissionError(EACCES)

The patches wrap the real functions (orbax's atomic-rename path, the engine, the learner), so the
fault lands inside the real code path; SIGKILL gives the process no chance to clean up.
"""

from __future__ import annotations

import errno
import os
import signal
import sys


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(kind: str, n: int) -> None:
    from orbax.checkpoint._src.path import atomicity

    from ulorl_jax.decode.engine import PolicyEngine
    from ulorl_jax.rl.learner import Learner

    calls = {"count": 0}

    def nth() -> bool:
        calls["count"] += 1
        return calls["count"] == n

    def from_nth() -> bool:
        calls["count"] += 1
        return calls["count"] >= n

    if kind == "kill-rollout":
        prefill_many = PolicyEngine._prefill_many  # what run() and prefill_many() both go through

        def patched_prefill_many(self, *args, **kwargs):
            if nth():
                _die()
            return prefill_many(self, *args, **kwargs)

        PolicyEngine._prefill_many = patched_prefill_many
    elif kind == "kill-learner":
        apply = Learner.apply

        def patched_apply(self, *args, **kwargs):
            out = apply(self, *args, **kwargs)
            if nth():
                _die()
            return out

        Learner.apply = patched_apply
    elif kind in ("kill-ckpt-write", "kill-ckpt-commit", "enospc", "eacces"):
        cls = atomicity.AtomicRenameTemporaryPath
        finalize, create = cls.finalize, cls.create

        def is_step(path) -> bool:  # the step directory itself, not one of its items
            return path.name.isdigit()

        async def patched_finalize(self, *args, **kwargs):
            final = self.get_final()
            if kind == "kill-ckpt-write" and final.name == "params" and nth():
                _die()
            if kind == "kill-ckpt-commit" and is_step(final) and nth():
                _die()
            if kind == "enospc" and is_step(final) and from_nth():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))
            return await finalize(self, *args, **kwargs)

        async def patched_create(self, *args, **kwargs):
            if kind == "eacces" and is_step(self.get_final()) and from_nth():
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.get_final().parent))
            return await create(self, *args, **kwargs)

        cls.finalize, cls.create = patched_finalize, patched_create
    else:
        raise SystemExit(f"fault_inject: unknown fault kind {kind!r}")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    kind, _, n = argv[0].partition(":")
    install(kind, int(n or 1))
    from ulorl_jax.cli import main as ulorl_main

    return ulorl_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
