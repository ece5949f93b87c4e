"""flax-transformer: the Transformer of Attention Is All You Need in JAX/Flax."""
