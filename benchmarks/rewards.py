"""Rewards per second for one batch of 1,024 responses: `python benchmarks/rewards.py [--workers N] [--extraction E]`.

Half the batch is decidable in-process (the reference itself, a wrong integer), half goes to math-verify in the
sandbox workers (a fraction against its decimal, a polynomial against its expansion); every response carries
~2 KB of reasoning before its boxed answer. Worker start-up is paid before the clock starts.
Measured (CPU, 2-core VM shared with other work, load ~9; 2026-12-03; README "Rewards and data"):
default workers (2): 112 rewards/s; --workers 1: 57/s; --extraction math_verify: 79/s.
"""

import argparse
import os
import random
import time

from ulorl_jax.rewards import RewardConfig, RewardScorer


def batch(n: int = 1024, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    think = "Let me work through this step by step. " * 50
    items = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(2, 99)
        kind = i % 4
        if kind == 0:  # fast path: the reference itself
            items.append((f"{think} so \\boxed{{{a * b}}}", str(a * b), False, {}))
        elif kind == 1:  # fast path: a wrong integer
            items.append((f"{think} so \\boxed{{{a * b + 1}}}", str(a * b), False, {}))
        elif kind == 2:  # math-verify: a fraction against its decimal
            items.append((f"{think} so \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:.6f}", False, {}))
        else:  # math-verify: a polynomial against its expansion (every other one wrong)
            items.append((f"{think} so \\boxed{{(x+{a})^2}}", f"x^2+{2 * a}x+{a * a + (i % 8 == 7)}", False, {}))
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="sandbox workers (default: the machine's cores, >= 2)")
    parser.add_argument("--extraction", choices=["boxed", "math_verify"], default="boxed")
    parser.add_argument("--n", type=int, default=1024, help="responses in the batch")
    args = parser.parse_args()
    items = batch(args.n)
    with RewardScorer(RewardConfig(workers=args.workers, timeout_s=10, extraction=args.extraction)) as scorer:
        scorer.score(batch(8, seed=1))  # starts the pool
        scorer.wait_ready()
        warm = scorer.stats.sandboxed
        start = time.perf_counter()
        rewards = scorer.score(items)
        elapsed = time.perf_counter() - start
        s = scorer.stats
        print(f"extraction={args.extraction} workers={scorer.config.num_workers} cores={os.cpu_count()} "
              f"load={os.getloadavg()[0]:.1f} batch={len(items)}: {elapsed:.2f} s -> {len(items) / elapsed:.0f} "
              f"rewards/s; sent to math-verify {s.sandboxed - warm}, timeouts {s.timeouts}, "
              f"mean reward {sum(rewards) / len(rewards):.3f}")


if __name__ == "__main__":
    main()
