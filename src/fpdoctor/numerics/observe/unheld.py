"""Parameters that train in the forward and that no optimizer holds, beside an optimizer that holds
parameters no forward uses: the optimizer was built before a layer was replaced.

`opt = AdamW(model.parameters()); model.head = nn.Linear(d, classes)` keeps the old head's tensors in
the optimizer, which steps them forever on no gradient, while the new head gets a gradient every step
and never moves. Nothing is NaN and the loss is finite: a run judged by its values looks healthy.

Both halves are needed, so that a choice is never called a bug: an optimizer over part of a model (a
linear probe that leaves the backbone out) holds no tensor outside the forward, and parameters held
by another optimizer (a GAN's two) are dropped as soon as that optimizer steps. Read once per
optimizer, at its first step, from the gradients its backward left."""

from __future__ import annotations

import linecache
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType

import torch
from torch import nn

from fpdoctor.userframes import is_user_file


@dataclass
class Unheld:
    """One optimizer's first step: what it holds outside the forward, what the forward trains
    outside it."""

    optimizer: str  # its class name
    orphans: list[tuple[int, ...]]  # shapes of the tensors it holds that no forward of the step used
    missing: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> parameter with a gradient it lacks
    files: list[str] = field(default_factory=list)  # the user's files on the stack at the step: where to look
    called: str = "optimizer"  # the script's name for the optimizer, where a user frame binds one


def read(optimizer: object, held: list[torch.Tensor], modules: Iterable[nn.Module]) -> Unheld | None:
    """`held`: the optimizer's trainable tensors; `modules`: the top-level modules of the step's
    training forwards. None unless both halves are there."""
    ran: dict[int, str] = {}
    named: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():
            ran.setdefault(id(p), name)
            named.setdefault(name, p)
    orphans = [tuple(p.shape) for p in held if id(p) not in ran and p.grad is None]
    if not orphans:
        return None
    mine = {id(p) for p in held}
    missing = {n: p for n, p in named.items() if p.requires_grad and p.grad is not None and id(p) not in mine}
    if not missing:
        return None
    return Unheld(type(optimizer).__name__, orphans, missing)


def held_by(found: Unheld, held: list[torch.Tensor]) -> None:
    """Another optimizer stepped: the parameters it holds are not missing."""
    ids = {id(p) for p in held}
    found.missing = {n: p for n, p in found.missing.items() if id(p) not in ids}


def owner(names: Iterable[str]) -> str:
    """The module that holds all the parameters, by path: `classifier` for classifier.0.weight and
    classifier.2.bias (the one a script replaces), "" for the model itself."""
    paths = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    while common and not common[-1].isidentifier():  # `layers.3`: the ModuleList's item was assigned
        common.pop()
    return ".".join(common)


def assignment(path: str, files: Iterable[str]) -> tuple[str, int, str] | None:
    """The line of the user's files (those on the stack at the step) that assigns a module to the
    attribute that ends `path` from outside the module (`model.head = nn.Linear(...)`): (path, line,
    its text), where exactly one does."""
    if not path:
        return None
    attr = re.escape(path.rpartition(".")[2])
    pattern = re.compile(rf"\.\s*{attr}\s*=(?!=)|setattr\([^,]+,\s*['\"]{attr}['\"]")
    # `self.head = ...` is the module's own __init__ building it: the replacement is made from outside
    hits = [
        (path, i, line.strip())
        for path in dict.fromkeys(files)
        for i, line in enumerate(linecache.getlines(path), 1)
        if pattern.search(line) and not line.lstrip().startswith("self.")
    ]
    if len(hits) != 1:
        return None
    where, i, text = hits[0]
    return where, i, text.split("#")[0].strip()


def name_in(frame: FrameType | None, obj: object) -> str | None:
    """The name a user frame on the stack binds `obj` to (`opt`), innermost first."""
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            for scope in (frame.f_locals, frame.f_globals):
                name = next((k for k, v in scope.items() if v is obj and k.isidentifier()), None)
                if name is not None:
                    return name
        frame = frame.f_back
    return None
