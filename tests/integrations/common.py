"""Helpers both frameworks' tests share (no framework imported here)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


@contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """What fpdoctor says through a framework's logger (those loggers do not propagate to pytest's)."""
    handler = Lines()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
