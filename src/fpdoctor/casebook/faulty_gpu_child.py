"""The fingerprint child of the faulty-GPU case's rank 1 (fault injection, casebook only): every
Nth torch.mm result has the lowest bit of one element flipped, as a marginal GPU would - no NaN,
no visible jump. The product has no switch that injects faults; the case points that rank's
fingerprint child at this module instead.

Usage: python -m fpdoctor.casebook.faulty_gpu_child EVERY SPEC
"""

from __future__ import annotations

import sys

import torch

from fpdoctor.health import fingerprint

_mm = torch.mm
_calls = [0]


def _faulty_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = _mm(a, b)
    _calls[0] += 1
    if _calls[0] % EVERY == 0:
        bits = out.view(torch.int16) if out.element_size() == 2 else out.view(torch.int32)
        bits[out.shape[0] // 3, 5] ^= 1
    return out


if __name__ == "__main__":
    EVERY = int(sys.argv[1])
    torch.mm = _faulty_mm  # type: ignore[assignment]
    code = fingerprint.child_main(sys.argv[2:])
    sys.stdout.flush()
    raise SystemExit(code)
