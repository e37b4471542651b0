"""Lightning's callback factories (entry-point groups `lightning.pytorch.callbacks_factory` and
`pytorch_lightning.callbacks_factory`): Lightning calls every installed factory for every Trainer.

Switched off (the default) a factory returns no callback and imports nothing; `FPDOCTOR_LIGHTNING=1`
switches it on without a change to the code, `FPDOCTOR_REPORT=PATH` names the report file and
`FPDOCTOR_STOP_ON=error|warning` ends training at the first finding at that level. A
callback the user passes to the Trainer as well wins: the environment's then does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV_SWITCH = "FPDOCTOR_LIGHTNING"
ENV_STOP_ON = "FPDOCTOR_STOP_ON"  # `stop_on` of the callbacks switched on without a code change
_ON = {"1", "true", "yes", "on"}
_OFF = {"", "0", "false", "no", "off"}


def switched_on(logger_name: str) -> bool:
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:  # a typo must not pass for "on" nor go unnoticed
        logging.getLogger(logger_name).warning(
            f"fpdoctor: {ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is neither on nor off; the sentinel stays off. "
            f"Set {ENV_SWITCH}=1 to switch it on."
        )
    return False


def lightning_callbacks() -> list[Any]:
    if not switched_on("lightning.pytorch.fpdoctor"):
        return []
    from fpdoctor.integrations.lightning import from_environment

    return from_environment("lightning.pytorch")


def pytorch_lightning_callbacks() -> list[Any]:
    if not switched_on("pytorch_lightning.fpdoctor"):
        return []
    from fpdoctor.integrations.lightning import from_environment

    return from_environment("pytorch_lightning")


def stop_on_from_environment(logger_name: str) -> str | None:
    """FPDOCTOR_STOP_ON as the callbacks take it; a value they refuse is said and ignored."""
    value = os.environ.get(ENV_STOP_ON, "").strip().lower() or None
    if value not in (None, "error", "warning"):
        logging.getLogger(logger_name).warning(
            f"fpdoctor: {ENV_STOP_ON}={os.environ[ENV_STOP_ON]!r} is neither error nor warning; "
            "training is not stopped."
        )
        return None
    return value
