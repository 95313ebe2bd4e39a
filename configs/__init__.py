"""Shipped run configurations (YAML), imported as ulorl_jax.configs."""
