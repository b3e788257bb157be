"""The one exception type for bad user input, so front ends (the CLI) can print it as one line."""


class InputError(ValueError):
    """Input that cannot be used as given (a malformed file, an out-of-range option); the message says what
    is wrong and where. Raised before anything is changed or computed."""


def is_count(value: object, least: int = 0) -> bool:
    """Whether `value` is a whole number >= `least`: an int, not a bool (True is an int to Python) and not a float
    (an infinite or fractional count would pass a plain `>=` and fail later, mid-run)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
