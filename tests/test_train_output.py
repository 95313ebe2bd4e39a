"""What `ulorl train` prints: memory figures in a unit that shows them (memory.format_bytes). The resume line
and the step count in words: tests/test_run_folder.py (a real run, resumed from another directory)."""

from __future__ import annotations

import re

import pytest

from ulorl_jax.memory import TrainMemory, check_train_memory, format_bytes


@pytest.mark.parametrize("n, text", [(0, "0 B"), (640, "640 B"), (1536, "1.50 KiB"), (5 * 2**20 // 2, "2.50 MiB"),
                                     (3 * 2**30, "3.00 GiB"), (2**41, "2.00 TiB")])
def test_format_bytes_picks_the_unit_that_shows_the_figure(n, text):
    assert format_bytes(n) == text


def test_a_toy_run_that_does_not_fit_shows_nonzero_figures():
    need = TrainMemory(learner=300 * 2**10, rollout_weights=0, kv_cache=2 * 2**20)
    with pytest.raises(ValueError) as err:
        check_train_memory(need, 2**20, "--max-memory", slots=8, max_len=44)
    message = str(err.value)
    assert re.search(r"(?<![\d.])0\.00", message) is None  # no figure rounds to zero
    assert ("needs 2.29 MiB before activations (learner weights, gradients and AdamW moments 300.00 KiB, rollout "
            "weights 0 B, decode KV cache 2.00 MiB for 8 slots x 44 positions) but --max-memory allows 1.00 MiB"
            in message)
