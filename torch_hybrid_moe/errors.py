"""The one exception type for bad user input, so front ends (the CLI) can print it as one line."""


class InputError(ValueError):
    """Input that cannot be used as given (a malformed file, an out-of-range option); the message says what
    is wrong and where. Raised before anything is changed or computed."""
