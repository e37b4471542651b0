"""The lines between a step's backward and its optimizer step, read from the user's source
(numerics/training/between.py): where a call inserted before the processing runs once a step, and the
scaler and optimizer as the step call names them."""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fpdoctor.numerics.training import between

GOT: list[between.Between | None] = []
# the hook compiled as torch's code: the first frame of the user's code is then the step call, as in the watch
_NS: dict = {"GOT": GOT, "between": between}
exec(compile("def hook(opt, args, kwargs):\n    GOT.append(between.read())", torch.__file__, "exec"), _NS)


def _read(step) -> between.Between | None:
    handle = register_optimizer_step_pre_hook(_NS["hook"])
    try:
        GOT.clear()
        step()
    finally:
        handle.remove()
    return GOT[0]


m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)


def per_value_loop() -> None:
    scaler.scale(m(torch.randn(2, 4)).sum()).backward()
    for p in m.parameters():
        if p.grad is not None:
            p.grad.clamp_(-1.0, 1.0)
    scaler.step(opt)
    scaler.update()


def keyword_step() -> None:
    scaler.scale(m(torch.randn(2, 4)).sum()).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    scaler.step(optimizer=opt)
    scaler.update()


def test_a_clip_in_a_loop_is_named_and_the_call_goes_before_the_loop() -> None:
    seen = _read(per_value_loop)
    assert seen is not None and seen.before is not None
    assert seen.before[1] == "for p in m.parameters():"  # not inside it: unscale_ runs once a step
    assert any("clamp_" in text for _, text in seen.lines), seen.lines
    assert (seen.scaler, seen.optimizer) == ("scaler", "opt")


def test_the_optimizer_given_by_keyword_is_named() -> None:
    seen = _read(keyword_step)
    assert seen is not None and (seen.scaler, seen.optimizer) == ("scaler", "opt")
    assert seen.before is not None and seen.before[1].startswith("torch.nn.utils.clip_grad_norm_(")
