"""A setting's facts in one place: every field of a stage's settings dataclass is declared with `setting(...)`:
its type (the annotation), a one-line description, the values it may take, and the value that runs saved
before the field existed had. settings.py reads these to check a run config field by field and to load an
older config.json; configs/*.py set the values.
"""

import dataclasses

from flax_transformer.errors import ConfigError

NEW = object()  # `before` of a field every saved config.json has


def setting(doc: str, *, choices: tuple | None = None, minimum: float | None = None, greater: float | None = None,
            low: float | None = None, high: float | None = None, check=None, before=NEW, derived: bool = False,
            read: bool = False, given: tuple = (), default=dataclasses.MISSING):
  """A settings field. `choices`: the values allowed. `minimum` (inclusive) or `greater` (exclusive): a bound;
  `low`, `high`: the half-open range [low, high). `check(value)`: raises a one-line ConfigError itself.
  `before`: the value of runs saved before the field existed. `derived`: made by settings.py from other
  fields (not a config field of this name). `read`: the value names a file (or storage URL) a program reads,
  which nothing the program writes may be, hold or sit inside (`files_read`). `given`: where else than the
  config a value may be given, each defined from this declaration: 'flag' (translate.py's and the server's
  flags), 'request' (a field of the server's /translate requests)."""
  return dataclasses.field(default=default, metadata={
      'doc': doc, 'choices': choices, 'minimum': minimum, 'greater': greater, 'low': low, 'high': high,
      'check': check, 'before': before, 'derived': derived, 'read': read, 'given': given})


def files_read(*stages) -> dict[str, str]:
  """{'config.NAME': path} of every field declared `read` of these settings objects, where a path is given."""
  return {f'config.{field.name}': getattr(stage, field.name) for stage in stages
          for field in dataclasses.fields(stage) if field.metadata.get('read') and getattr(stage, field.name)}


def problem(field: dataclasses.Field, value) -> str | None:
  """What is wrong with `value` for `field`, in the words of a one-line error (after 'config.NAME=VALUE: '), or
  None."""
  kind, meta = field.type, field.metadata
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind is tuple and isinstance(value, list):
    value = tuple(value)
  typed = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
  if kind is int and meta.get('minimum') is not None:
    if not typed or value < meta['minimum']:
      return 'must be a positive integer' if meta['minimum'] >= 1 else 'must be a non-negative integer'
    return None
  if not typed:
    return f'must be {"an" if kind is int else "a"} {kind.__name__}'
  if meta.get('minimum') is not None and not value >= meta['minimum']:
    return 'must be 0 (off) or positive'
  if meta.get('greater') is not None and not value > meta['greater']:
    return 'must be positive'
  if meta.get('greater') is not None and value == float('inf'):
    return 'must be finite'
  if meta.get('low') is not None and not meta['low'] <= value < meta['high']:
    return f'must be in [{meta["low"]:g}, {meta["high"]:g})'
  if meta.get('choices') is not None and value not in meta['choices']:
    return f'must be one of {", ".join(map(str, meta["choices"]))}'
  return None


def typed(field: dataclasses.Field, value):
  """`value` as the field's type holds it (an int for a float field as a float, a list as a tuple)."""
  if field.type is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if field.type is tuple and isinstance(value, list):
    return tuple(value)
  return value


def check_values(cls, values: dict, spelled=lambda name: name) -> None:
  """Each of `values` ({field name: value}; None: left to its default) against its declaration in the settings
  dataclass `cls`, wherever the value comes from (a config, a flag, a keyword argument): a one-line ConfigError
  naming the value as the caller wrote it (`spelled(name)`: '--alpha', 'length_penalty_alpha', ...)."""
  declared = {f.name: f for f in dataclasses.fields(cls)}
  for name, value in values.items():
    if value is None:
      continue
    why = problem(declared[name], value)
    if why:
      raise ConfigError(f'{spelled(name)}={value!r}: {why} ({declared[name].metadata["doc"].rstrip(".")})')
