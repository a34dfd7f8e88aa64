"""The one exception type that reaches the user as a one-line message (CLI exit code 2)."""


class LlmemError(ValueError):
    """Bad input or an impossible request. The message names the problem and what to do."""
