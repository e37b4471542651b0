"""The training sentinel: an always-on finite check of loss and gradients that replays bad steps.

Cost per step: one fused device-side reduction over the gradients (`_foreach_norm`, the same
kernel gradient clipping uses) and one host read of two numbers. When a step is not finite it
is replayed before anything is updated - same batch, RNG state restored, same weights, buffers
restored afterwards - under `trace`. Reproduced: a numerical bug at the op the trace names.
Not reproduced: the first run did not compute what the code asks for; suspect the hardware.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.preserve import RngState, preserved
from fpdoctor.report.model import Finding, Report

SPIKE_WINDOW = 32
SPIKE_MIN_HISTORY = 8
# A loss more than SPIKE_SIGMAS standard deviations above the recent mean, and at least
# SPIKE_RATIO times it, is a spike: both, so that a flat loss curve's tiny noise does not count.
SPIKE_SIGMAS = 6.0
SPIKE_RATIO = 1.5


@dataclass
class StepOutcome:
    step: int
    loss: float
    finite: bool
    skipped: bool
    verdict: str | None = None  # "deterministic-nonfinite" / "transient-fault-suspected"


@dataclass
class Sentinel:
    """Guard a training step: `loss = guard.step(step_fn, *args)`; `guard.report` for the story.

    `step_fn` runs forward and backward and returns the loss; the sentinel calls
    `optimizer.step()` only when loss and gradients are finite. Gradients are assumed to be
    zeroed by `step_fn` (or before it), as in a plain training loop.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    replay: bool = True
    checkpoint_path: str | None = None
    checkpoint_every: int = 0
    steps: int = 0
    skipped: int = 0
    findings: list[Finding] = field(default_factory=list)
    history: list[StepOutcome] = field(default_factory=list)
    last_good_step: int | None = None
    _losses: deque[float] = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.checkpoint_every and not self.checkpoint_path:
            raise ValueError("checkpoint_every needs checkpoint_path")
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    # -- the always-on part --------------------------------------------------------------------
    def check(self, loss: torch.Tensor) -> tuple[bool, float, float]:
        """(finite, loss, gradient norm) with one host read; no per-op synchronisation."""
        loss_value = loss.detach().float().reshape(())
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads:
            norms = torch._foreach_norm(grads)  # one fused kernel: a NaN or Inf anywhere makes its norm non-finite
            if len({(n.dtype, n.device) for n in norms}) == 1:
                total = torch.stack(norms).sum().float().to(loss_value.device)
            else:  # mixed dtypes or devices (pipeline stages, fp32 master weights)
                total = torch.stack([n.float().to(loss_value.device) for n in norms]).sum()
        else:
            total = torch.zeros((), device=loss_value.device)
        lv, gv = torch.stack([loss_value, total]).tolist()
        return math.isfinite(lv) and math.isfinite(gv), lv, gv

    def step(self, step_fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        rng = RngState.capture()
        loss = step_fn(*args, **kwargs)
        self.steps += 1
        step = self.steps
        try:
            finite, loss_value, grad_norm = self.check(loss)
        except Exception as exc:  # the observer never kills the job: fall back to an unguarded step
            self.findings.append(catalog.make("known-issue", message=f"sentinel check failed: {exc}"))
            finite, loss_value, grad_norm = True, float("nan"), float("nan")
        outcome = StepOutcome(step, loss_value, finite, skipped=not finite)
        if finite:
            self._spike(step, loss_value)
            if self.optimizer is not None:
                self.optimizer.step()
            self.last_good_step = step
            if self.checkpoint_every and step % self.checkpoint_every == 0:
                self._save_checkpoint(step)
        else:
            self.skipped += 1
            self._record_nonfinite(step, loss_value, grad_norm)
            if self.replay:
                outcome.verdict = self._replay(step, rng, step_fn, args, kwargs)
            for p in self._params:  # nothing of this step may reach the weights
                p.grad = None
        self.history.append(outcome)
        return loss

    # -- findings ------------------------------------------------------------------------------
    def _record_nonfinite(self, step: int, loss_value: float, grad_norm: float) -> None:
        where = {
            "module": None,
            "op": None,
            "phase": "backward" if math.isfinite(loss_value) else "forward",
            "step": step,
        }
        if not math.isfinite(loss_value):
            self.findings.append(
                catalog.make(
                    "nonfinite-loss",
                    message=f"Step {step}: the loss was {loss_value}; the step was skipped.",
                    where=where,
                    evidence={"kind": _kind(loss_value), "count": 1, "numel": 1, "dtype": None, "step": step},
                )
            )
        else:
            bad = [
                name
                for name, p in self.model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            self.findings.append(
                catalog.make(
                    "nonfinite-gradient",
                    message=(
                        f"Step {step}: the loss was finite ({loss_value:.4g}) but gradients were not "
                        f"({len(bad)} parameter(s): {', '.join(bad[:4])}); the step was skipped."
                    ),
                    where=where,
                    evidence={
                        "kind": _kind(grad_norm),
                        "count": len(bad),
                        "numel": len(self._params),
                        "dtype": None,
                        "parameters": bad[:20],
                        "step": step,
                    },
                )
            )

    def _spike(self, step: int, loss_value: float) -> None:
        history = self._losses
        if len(history) >= SPIKE_MIN_HISTORY:
            mean = statistics.fmean(history)
            spread = statistics.pstdev(history)
            if loss_value > mean + SPIKE_SIGMAS * spread and loss_value > SPIKE_RATIO * abs(mean):
                self.findings.append(
                    catalog.make(
                        "loss-spike",
                        message=(
                            f"Step {step}: loss {loss_value:.4g} against a recent mean of {mean:.4g} "
                            f"(std {spread:.2g} over {len(history)} steps)."
                        ),
                        where={"module": None, "op": None, "phase": "forward", "step": step},
                        evidence={
                            "kind": "spike",
                            "loss": loss_value,
                            "mean": mean,
                            "std": spread,
                            "step": step,
                            "count": 1,
                            "numel": 1,
                            "dtype": None,
                        },
                    )
                )
        history.append(loss_value)

    def _replay(self, step: int, rng: RngState, step_fn: Callable[..., torch.Tensor], args: Any, kwargs: Any) -> str:
        from fpdoctor.numerics.api import trace

        for p in self._params:
            p.grad = None
        try:
            with preserved(self.model):  # the replay's RNG draws and buffer updates stay in the replay
                rng.restore()
                with trace(self.model, headroom=False) as t:
                    replay_loss = step_fn(*args, **kwargs)
                finite, loss_value, _ = self.check(replay_loss)
        except Exception as exc:
            self.findings.append(
                catalog.make(
                    "known-issue",
                    title="The sentinel's replay failed",
                    message=f"Step {step}: replaying the step raised {type(exc).__name__}: {exc}",
                    where={"step": step},
                )
            )
            return "replay-failed"
        assert t.report is not None
        culprits = [f for f in t.report.findings if f.name in ("nonfinite-produced", "nonfinite-input")]
        if not finite or culprits:
            first = culprits[0] if culprits else None
            self.findings.append(
                catalog.make(
                    "deterministic-nonfinite",
                    message=(
                        f"Step {step} replayed with the same batch, RNG state and weights and was non-finite again"
                        + (f": {first.message}" if first else ".")
                    ),
                    where={
                        **(dict(first.where) if first else {"module": None, "op": None, "phase": None}),
                        "step": step,
                    },
                    evidence={**(dict(first.evidence) if first else {}), "step": step, "replay_loss": loss_value},
                    fix=first.fix if first else catalog.get("deterministic-nonfinite").fix,
                )
            )
            self.findings.extend(f for f in t.report.findings if f is not first and f.name != "nonfinite-masked")
            return "deterministic-nonfinite"
        device = _device_description(self._params[0].device if self._params else torch.device("cpu"))
        self.findings.append(
            catalog.make(
                "transient-fault-suspected",
                message=(
                    f"Step {step} was non-finite, but replaying it with the same batch, RNG state and weights gave "
                    f"a finite loss ({loss_value:.4g}) and finite gradients. Suspect {device['description']}."
                ),
                where={
                    "module": None,
                    "op": None,
                    "phase": None,
                    "step": step,
                    **{k: v for k, v in device.items() if k != "description"},
                },
                evidence={
                    "kind": "transient",
                    "step": step,
                    "replay_loss": loss_value,
                    "count": 1,
                    "numel": 1,
                    "dtype": None,
                    **device,
                },
            )
        )
        return "transient-fault-suspected"

    def _save_checkpoint(self, step: int) -> None:
        assert self.checkpoint_path is not None
        state = {"step": step, "model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        directory = os.path.dirname(os.path.abspath(self.checkpoint_path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".fpdoctor-ckpt-", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, self.checkpoint_path)  # atomic: a reader never sees half a checkpoint
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @property
    def report(self) -> Report:
        nonfinite = sum(1 for h in self.history if not h.finite)
        summary = [
            ("steps", str(self.steps)),
            ("non-finite steps", str(nonfinite)),
            ("skipped optimizer steps", str(self.skipped)),
            ("last good step", str(self.last_good_step)),
        ]
        if self.checkpoint_path:
            summary.append(("last-good checkpoint", self.checkpoint_path))
        return Report(
            command="sentinel",
            findings=list(self.findings),
            data={
                "summary": summary,
                "steps": self.steps,
                "nonfinite_steps": nonfinite,
                "skipped_steps": self.skipped,
                "last_good_step": self.last_good_step,
                "verdicts": {h.step: h.verdict for h in self.history if h.verdict},
            },
        )


def _kind(value: float) -> str:
    return "nan" if math.isnan(value) else "+inf" if value > 0 else "-inf"


def _device_description(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "device": str(device)}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info["rank"] = torch.distributed.get_rank()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["uuid"] = str(getattr(props, "uuid", "")) or None
    where = f"{info['device']} on host {info['host']}"
    if "rank" in info:
        where = f"rank {info['rank']} ({where})"
    if info.get("gpu"):
        where += f", {info['gpu']} {info.get('uuid') or ''}".rstrip()
    info["description"] = where
    return info
