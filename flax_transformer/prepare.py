"""`python -m flax_transformer.prepare`: the vocabulary and the token cache ahead of a run (commands/prepare.py)."""

if __name__ == '__main__':
  from flax_transformer.commands.prepare import console
  console()
