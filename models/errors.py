"""Errors a user can cause while building or loading an engine.

Each message is one paragraph: what was wrong (with the offending value), and what to do.
The CLI prints the message and exits non-zero without a traceback.
"""


class BuildError(Exception):
    """A checkpoint, a build option or an engine directory the builder cannot accept."""


class EngineLoadError(BuildError):
    """An engine directory that cannot be loaded as it is (schema, version, checksum)."""
