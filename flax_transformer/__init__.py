"""The Transformer of Attention Is All You Need in JAX/Flax. `flax_transformer.Translator` loads a trained model."""


def __getattr__(name):  # imported on first use: `import flax_transformer.platforms` must not load TensorFlow
  if name == 'Translator':
    from flax_transformer.translator import Translator
    return Translator
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
