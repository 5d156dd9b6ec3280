"""Errors meant for the user: the CLI prints them as one line and exits non-zero."""


class AhakvError(ValueError):
    """A user-facing failure with a message that says what to do. A ValueError, as llama-cpp-python's refusals of
    bad arguments are: an app's ``except ValueError`` around ``Llama(...)`` or a completion catches both."""


class DecodeError(AhakvError, RuntimeError):
    """llama_decode failed. A RuntimeError too, as llama_cpp.Llama raises it: an app's ``except RuntimeError`` around a
    completion missed it under a budget."""


class EngineNotPatched(AhakvError):
    """The llama-cpp-python in this environment lacks the ahakv patches (or has other ones)."""
