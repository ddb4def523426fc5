"""The JAX engine: the MoE transformer of a spec in plain JAX + optax, with the pooled-wave expert-parallel all-to-all."""
