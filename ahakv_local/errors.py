"""Errors meant for the user: the CLI prints them as one line and exits non-zero."""


class AhakvError(Exception):
    """A user-facing failure with a message that says what to do."""


class EngineNotPatched(AhakvError):
    """The llama-cpp-python in this environment lacks the ahakv patches (or has other ones)."""
