"""One command for the kernel table: `python benchmarks/attention.py [extra options]`.

On a GPU it runs the issue's full table (attention at 4k-128k, decode at 128k,
Qwen3-30B-A3B grouped matmul; a few minutes) and writes
benchmarks/results/attention.md with machine, date and command. On CPU it runs
small shapes (Pallas interpret mode untimed) and writes
benchmarks/results/attention_cpu.md instead, so the GPU file is never
overwritten by CPU figures. Options are those of `ulorl bench attention --help`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from ulorl_jax.bench import attention  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--markdown" not in argv:
        name = "attention.md" if jax.default_backend() == "gpu" else "attention_cpu.md"
        argv += ["--markdown", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)]
    sys.exit(attention.main(argv))
