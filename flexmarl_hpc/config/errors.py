"""The config's one error type, below every section of it (schema.py, tools.py)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config field or file is wrong; the message names it and what was expected."""
