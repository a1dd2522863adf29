"""The one user-facing error type, shared by the CLI, ``leantune.train`` and ``leantune.bench``."""


class LeantuneError(Exception):
    """A user-facing error: the CLI prints ``leantune: error: <message>`` on one line and exits non-zero."""
