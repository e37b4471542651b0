"""Live fact sources. Each returns plain data or raises `NotChecked` with the reason."""


class NotChecked(Exception):
    """A source could not run here (no driver, no permission, not Linux); the message says why."""
