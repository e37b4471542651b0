"""The package version, in one place (pyproject.toml carries the same string)."""

__version__ = "0.1.0"
