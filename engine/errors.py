"""The engine's typed exceptions (defined in `models.errors`, the bottom layer; re-exported here).

The CLI turns any `EngineError` into one line on stderr and exit code 2.
"""
from models.errors import (CheckpointError, ConfigError, ContextFullError, EngineError,
                           InvalidArgumentError, SessionBusyError, StateMismatchError)

__all__ = ["EngineError", "ConfigError", "CheckpointError", "InvalidArgumentError", "ContextFullError",
           "StateMismatchError", "SessionBusyError"]
