"""Errors of the environment doctor that the CLI turns into exit code 2."""


class InputError(ValueError):
    """A --from file that cannot be diagnosed; the message is the one line the user sees."""
