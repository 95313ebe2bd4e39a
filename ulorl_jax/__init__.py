"""ulorl-jax: UloRL (arXiv 2507.19766) on a sharded Qwen3 / Qwen3-MoE policy in JAX."""

__version__ = "0.1.0"
