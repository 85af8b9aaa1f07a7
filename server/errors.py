"""The moeflash exception hierarchy.

MoeflashError
 ├── ConfigError            bad settings or command-line input
 ├── ModelGenError          the synthetic-model generator refused (unknown architecture,
 │                          impossible shape, no disk room, ...)
 ├── ModelLoadError         a model file could not be loaded (missing, truncated, unsupported)
 ├── ContextLengthExceeded  a prompt does not fit the context window
 └── ExpertReadError        reading expert weights from flash failed during a request

Each is mapped once to a CLI exit status and, in the server, to one HTTP status and an
OpenAI-shaped error body.
"""

from __future__ import annotations


class MoeflashError(Exception):
    """Base of every error moeflash raises on purpose."""


class ConfigError(MoeflashError):
    """Bad settings or command-line input."""


class ModelGenError(MoeflashError):
    """The synthetic-model generator refused its input or could not write the file."""


class ModelLoadError(MoeflashError):
    """A model file could not be loaded."""


class ContextLengthExceeded(MoeflashError):
    """A prompt (plus the requested completion) does not fit the context window."""


class ExpertReadError(MoeflashError):
    """Reading expert weights from storage failed."""
