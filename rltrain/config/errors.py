"""The one error a config raises: its message names the key, what was seen and what to set."""


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says which and what to do."""
