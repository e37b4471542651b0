"""Parameters that train in the forward and that no optimizer holds, beside an optimizer that holds
parameters no forward uses: the optimizer was built before a layer was replaced.

`opt = AdamW(model.parameters()); model.head = nn.Linear(d, classes)` keeps the old head's tensors in
the optimizer, which steps them forever on no gradient, while the new head gets a gradient every step
and never moves. Nothing is NaN and the loss is finite: a run judged by its values looks healthy.

Both halves are needed, so that a choice is never called a bug: an optimizer over part of a model (a
linear probe that leaves the backbone out) holds no tensor outside the forward, and parameters held
by another optimizer (a GAN's two) are dropped as soon as that optimizer steps, and a held tensor a
live module still holds (a head of several taken in turn, not called this step) is no orphan. Read
once per optimizer, at its first step, from the gradients its backward left."""

from __future__ import annotations

import gc
import linecache
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from fpdoctor.userframes import is_user_file


@dataclass
class Unheld:
    """One optimizer's first step: what it holds outside the forward, what the forward trains
    outside it."""

    optimizer: str  # its class name
    orphans: list[torch.Tensor]  # the tensors it holds that no forward used and that had no gradient
    missing: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> parameter with a gradient it lacks
    files: list[str] = field(default_factory=list)  # the user's files on the stack at the step: where to look
    called: str = "optimizer"  # the script's name for the optimizer, where a user frame binds one
    group_lr: float | None = None  # the lr of the group the orphans are in, where it is not the optimizer's default

    @property
    def decided(self) -> bool:
        """Both halves left (another optimizer that stepped may hold what is missing)."""
        return bool(self.orphans) and bool(self.missing)


def read(optimizer: object, held: list[torch.Tensor], modules: Iterable[nn.Module]) -> Unheld | None:
    """`held`: the optimizer's trainable tensors; `modules`: the top-level modules of the step's
    training forwards. None unless both halves are there."""
    ran: dict[int, str] = {}
    named: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():
            ran.setdefault(id(p), name)
            named.setdefault(name, p)
    orphans = [p for p in held if id(p) not in ran and p.grad is None]
    if not orphans:
        return None
    mine = {id(p) for p in held}
    missing = {n: p for n, p in named.items() if p.requires_grad and p.grad is not None and id(p) not in mine}
    if not missing:
        return None
    # a head not called this step (one of several taken in turn) is still a module's: a replaced one is no one's
    registered = _in_modules(orphans)
    orphans = [p for p in orphans if id(p) not in registered]
    if not orphans:
        return None
    found = Unheld(type(optimizer).__name__, orphans, missing)
    # the new layer takes the old one's place: its group's rate, where that is not what add_param_group gives
    groups: list[dict[str, Any]] = getattr(optimizer, "param_groups", [])
    group = next((g for g in groups if any(p is orphans[0] for p in g["params"])), {})
    lr = group.get("lr")
    if isinstance(lr, (int, float)) and lr != getattr(optimizer, "defaults", {}).get("lr"):
        found.group_lr = float(lr)
    return found


def _in_modules(tensors: list[torch.Tensor]) -> set[int]:
    """The ids of those of `tensors` that a live module holds as a parameter (one look at every object
    the collector tracks: made only where both halves were found)."""
    wanted = {id(t) for t in tensors}
    found: set[int] = set()
    with warnings.catch_warnings():  # isinstance on a deprecated alias (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, nn.Module):
                found.update(id(p) for p in obj._parameters.values() if p is not None and id(p) in wanted)
    return found


def held_by(found: Unheld, held: list[torch.Tensor]) -> None:
    """Another optimizer stepped: the parameters it holds are not missing."""
    ids = {id(p) for p in held}
    found.missing = {n: p for n, p in found.missing.items() if id(p) not in ids}


def owner(names: Iterable[str]) -> str:
    """The module that holds all the parameters, by path: `classifier` for classifier.0.weight and
    classifier.2.bias, `classifier.2` for classifier.2.weight and .bias (an item the script replaced),
    "" for the model itself."""
    paths = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def assignment(path: str, files: Iterable[str]) -> tuple[str, int, str] | None:
    """The line of the user's files (those on the stack at the step) that assigns a module to the
    attribute, or the item, that ends `path` from outside the module (`model.head = nn.Linear(...)`,
    `model.classifier[2] = ...`): (file, line, its text), where exactly one does."""
    parts = path.split(".") if path else []
    if not parts:
        return None
    if parts[-1].isdigit():  # an item of a Sequential or ModuleList, assigned by its index
        if len(parts) < 2 or not parts[-2].isidentifier():
            return None
        pattern = re.compile(rf"\.\s*{re.escape(parts[-2])}\s*\[\s*{parts[-1]}\s*\]\s*=(?!=)")
    else:
        attr = re.escape(parts[-1])
        pattern = re.compile(rf"\.\s*{attr}\s*=(?!=)|setattr\([^,]+,\s*['\"]{attr}['\"]")
    # `self.head = ...` is the module's own __init__ building it: the replacement is made from outside
    hits = [
        (source, i, line.strip())
        for source in dict.fromkeys(files)
        for i, line in enumerate(linecache.getlines(source), 1)
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
