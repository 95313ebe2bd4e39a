"""The supervised warm start as `ulorl train` and `ulorl demo` run it: a progress bar while it runs (on a
terminal, process 0 only) and one summary line after."""

from __future__ import annotations

import sys


def run_warm_start(trainer, cfg) -> list[dict]:
    """`trainer.warm_start` for `cfg.trainer.sft_steps` steps; returns its per-step metrics."""
    from rich.progress import Progress

    t = cfg.trainer
    batch = t.sft_batch_size or t.train_batch_size * cfg.rollout.n
    with Progress(transient=True, disable=not (sys.stdout.isatty() and trainer.is_primary)) as bar:
        task = bar.add_task("supervised warm start", total=t.sft_steps)
        history = trainer.warm_start(t.sft_steps, batch, t.sft_lr,
                                     progress=lambda i, m: bar.update(task, completed=i))
    last = history[-1] if history else {}
    if trainer.is_primary:
        print(f"warm start: {t.sft_steps} supervised steps on noisy traces (batch {batch}, lr {t.sft_lr:g}), "
              f"final loss {last.get('loss', float('nan')):.3f}")
    return history
