"""The expected errors: what every layer raises for a problem a user can fix, and `step_main` prints as one
line (the problem and its fix, exit 2) instead of a traceback. A leaf: it imports nothing, so the config,
the store, the formats and the checks can all raise them without importing each other."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and the fix."""


class InputError(ValueError):
    """A user's input that cannot be used (a dataset file, a model or draft directory): the message names
    the file, the line or field, and the fix. Like ConfigError, an expected error: one line, exit 2."""


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or does not match its manifest."""
