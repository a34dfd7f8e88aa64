"""The one exception type that reaches the user as a one-line message (CLI exit code 2)."""


class LlmemError(ValueError):
    """Bad input or an impossible request. The message names the problem and what to do."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty): what a one-line
    LlmemError quotes of an error raised by transformers, peft or torch."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
