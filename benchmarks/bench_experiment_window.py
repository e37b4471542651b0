"""The memory the experiment window (numerics/engine/reruns.py's Window) holds in a healthy trace.

The window keeps references to the last ops' arguments so that the experiments at a NaN can re-run
them. A reference keeps a tensor alive that the program has already let go of (a temporary of the
forward, an activation's gradient in backward): that is its cost in memory. Two figures, for the
same traced training step of `models.py`'s transformer:

  held      after backward, before the optimizer step, the bytes of the distinct storages the
            window references that nothing else holds (not a parameter, gradient, buffer, input
            or optimizer state): memory that would have been freed without it;
  peak RSS  the process's peak resident memory over the traced steps, with the window as the
            tracer keeps it and with its append made a no-op, each in a fresh process (the
            difference is what the window adds to the peak).

Run: python benchmarks/bench_experiment_window.py [--layers L] [--dim D] [--heads H] [--batch B] [--length T]
     [--window-bytes N]   (the byte bound to measure; a large N measures the count bound alone)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from fpdoctor.numerics.engine import reruns as experiments
from fpdoctor.pytrees import tensors_in
from models import batch, make_step, small_transformer

STEPS = 3


def _storages(tensors: Any) -> dict[int, int]:
    """data_ptr -> bytes of each distinct storage among `tensors`."""
    out: dict[int, int] = {}
    for t in tensors_in(tensors):
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _held(window: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: Any) -> dict[str, int]:
    referenced = _storages([(args, kwargs) for _, _, args, kwargs in window.steps])
    alive = _storages(
        [
            list(model.parameters()),
            [p.grad for p in model.parameters() if p.grad is not None],
            list(model.buffers()),
            inputs,
            [list(state.values()) for state in optimizer.state.values()],
        ]
    )
    only = {ptr: size for ptr, size in referenced.items() if ptr not in alive}
    return {
        "ops": len(window.steps),
        "referenced_bytes": sum(referenced.values()),
        "held_only_by_window_bytes": sum(only.values()),
        "held_only_by_window_tensors": len(only),
    }


def variant(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = small_transformer(layers=args.layers, dim=args.dim, heads=args.heads, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer)
    tokens, targets = batch(size=args.batch, length=args.length, device="cpu")
    step_fn(tokens, targets)  # untraced: the plain step's own peak first
    optimizer.step()
    plain_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held: dict[str, int] = {}
    for _ in range(STEPS):
        with fpdoctor.trace(model) as t:
            window = t.tracer._window
            if args.variant == "off":
                window.append = lambda step: None  # the tracer reads this attribute per op
            step_fn(tokens, targets)
            held = _held(window, model, optimizer, (tokens, targets))
            optimizer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"plain_peak": plain_peak, "traced_peak": peak, "parameter_bytes": parameters, **held}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--window-bytes", type=int, default=experiments.WINDOW_BYTES, help="the bound to measure")
    parser.add_argument("--variant", choices=("on", "off"), default=None)
    args = parser.parse_args()
    experiments.WINDOW_BYTES = args.window_bytes
    if args.variant is not None:
        print(json.dumps(variant(args)))
        return 0
    shape = ["--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads)]
    shape += ["--batch", str(args.batch), "--length", str(args.length), "--window-bytes", str(args.window_bytes)]
    results = {}
    for name in ("on", "off"):
        out = subprocess.run(
            [sys.executable, __file__, *shape, "--variant", name], capture_output=True, text=True, check=True
        )
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    on, off = results["on"], results["off"]
    mib = 2**20
    print(
        f"transformer: {args.layers} layers, dim {args.dim}, {args.batch} x {args.length} tokens; "
        f"parameters {on['parameter_bytes'] / mib:.1f} MiB; window {experiments.WINDOW} ops, "
        f"{experiments.WINDOW_BYTES / mib:.0f} MiB"
    )
    print(
        f"held after backward: {on['ops']} ops referenced {on['referenced_bytes'] / mib:.1f} MiB, "
        f"{on['held_only_by_window_bytes'] / mib:.1f} MiB in {on['held_only_by_window_tensors']} tensors "
        "held by the window alone"
    )
    print(
        f"peak RSS: plain step {on['plain_peak'] / mib:.0f} MiB; traced with the window "
        f"{on['traced_peak'] / mib:.0f} MiB, without {off['traced_peak'] / mib:.0f} MiB "
        f"(+{(on['traced_peak'] - off['traced_peak']) / mib:.0f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
