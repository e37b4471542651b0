"""The Hugging Face callback switched on in every `transformers.Trainer` made under a watch.

The Trainer has no callback factory that an installed package can join (Lightning has one:
entry_point.py), so while a watch is entered `Trainer.__init__` is wrapped: a Trainer made then
gets `FpDoctorCallback` unless the script passed one itself (one judge per step: the script's
wins). The callback judges its Trainer's steps; `fpdoctor watch` leaves that optimizer to it and
adds its findings to its own report. Nothing is imported that the script does not import: where
transformers is not loaded yet, the wrap waits for the script's own import of `transformers.trainer`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from fpdoctor.imports import AfterImport, after_import

_TRAINER = "transformers.trainer"


def _wrapped(trainer: Any) -> Callable[[], None]:
    """Wrap `trainer.__init__`; the undo puts the original back."""
    original = trainer.__dict__["__init__"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            from fpdoctor.integrations.entry_point import stop_on_from_environment
            from fpdoctor.integrations.hf import FpDoctorCallback

            if not any(isinstance(c, FpDoctorCallback) for c in self.callback_handler.callbacks):
                self.add_callback(FpDoctorCallback(stop_on=stop_on_from_environment("transformers.fpdoctor")))
        except Exception:  # an older transformers: the watch's own hooks judge the steps instead
            pass

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    trainer.__init__ = __init__

    def undo() -> None:
        if trainer.__dict__.get("__init__") is __init__:
            trainer.__init__ = original

    return undo


@contextlib.contextmanager
def callback_in_trainers(on_error: Callable[[str, BaseException], None] | None = None) -> Iterator[None]:
    """Inside the block, every Trainer made gets the fpdoctor callback (unless it has one). What
    fails in switching it on goes to `on_error`, never into the script's import."""
    undo: list[Callable[[], None]] = []

    def wrap() -> None:
        try:
            trainer = getattr(sys.modules.get(_TRAINER), "Trainer", None)
            if isinstance(trainer, type) and "__init__" in trainer.__dict__:
                undo.append(_wrapped(trainer))
        except Exception as exc:  # the observer never kills the job: the watch's own hooks judge instead
            if on_error is not None:
                with contextlib.suppress(Exception):
                    on_error("switching the fpdoctor callback on in the Hugging Face Trainer", exc)

    finder: AfterImport | None = None
    if _TRAINER in sys.modules:
        wrap()
    else:
        finder = after_import(_TRAINER, wrap)
    try:
        yield
    finally:
        if finder is not None:  # never imported inside the block: nothing waits for it after
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
        for done in undo:
            done()
