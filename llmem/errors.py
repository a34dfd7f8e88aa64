"""The one exception type that reaches the user as a one-line message (CLI exit code 2)."""


class LlmemError(ValueError):
    """Bad input or an impossible request. The message names the problem and what to do."""


class UnknownModel(LlmemError):
    """A MODEL no catalog, local file or hub lookup could find (its refusals read "unknown model ..."): what a
    fallback to another name of the same model (llmem.model.catalog.variants) or a --from file's hint answers."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its type's name when the message is empty): what a one-line
    LlmemError quotes of an error raised by transformers, peft or torch. A first line that only introduces the next
    ("Validation error for field 'hidden_size':") is joined with it, so that the line says what is wrong; the
    result is cut to `limit` characters."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."
