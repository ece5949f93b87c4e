"""User-facing errors: each message is one line that names the problem and the fix.

The entry points (train.py, translate.py, ...) print these as `error: ...` and exit with status 1.
"""


class UserError(ValueError):
  """Bad input from the user (configuration, data, workdir); never a bug in this package."""


class ConfigError(UserError):
  """A configuration value that cannot work."""


class WorkdirError(UserError):
  """A workdir that cannot be used as asked (unwritable, or holding another model)."""


class ArgumentError(UserError, TypeError):
  """A library call given a value of the wrong type (a string where a list of strings is asked, say)."""
