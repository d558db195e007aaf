"""Typed exceptions, defined in the bottom layer so every layer can raise them. Every message is
one line: what is wrong and what to do about it.

The CLI turns any `EngineError` into that line on stderr and exit code 2.
"""


class EngineError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(EngineError, ValueError):
    """A config.json is missing a key, holds a bad value, or names an unsupported model."""


class CheckpointError(EngineError, ValueError):
    """A weights file is missing, truncated, corrupt, or does not fit the config."""


class InvalidArgumentError(EngineError, ValueError):
    """An argument is out of range or unknown (attention path, feature map, sampler setting...)."""


class ContextFullError(EngineError, RuntimeError):
    """A step would write past the end of a preallocated KV cache."""


class StateMismatchError(EngineError, ValueError):
    """Tokens and state disagree (batch size, device, model)."""


class SessionBusyError(EngineError, RuntimeError):
    """A chat session got a message while another thread was still reading its last reply."""
