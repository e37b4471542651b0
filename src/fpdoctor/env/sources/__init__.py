"""Live fact sources. Each returns plain data or raises `NotChecked` with the reason."""


class NotChecked(Exception):  # noqa: N818 - it is a result, not a failure of fpdoctor
    """A source could not run here (no driver, no permission, not Linux); the message says why."""
