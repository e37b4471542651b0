"""Runs GEMM probes in a child interpreter and prints one JSON line per probe.

Each probe multiplies random matrices rounded to the probe's dtype and compares the result with
a float64 CPU product of the same rounded inputs. A library that crashes kills only this child;
the parent (`fpdoctor.env.probe`) records the signal and restarts a child for the rest.
Standard library and torch only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Any

START, RESULT = "FPDOCTOR-PROBE-START:", "FPDOCTOR-PROBE-RESULT:"

# Unit roundoff of the format that limits each probe's accuracy (inputs or output).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp8_e4m3": 2.0**-8}


def run_probe(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    dtype_name, device = spec["dtype"], spec["device"]
    m, k, n = spec["shape"]
    if spec.get("fault") == "sigfpe":
        # Fault injection for the casebook and tests: die exactly as cuBLAS does on H20.
        signal.raise_signal(signal.SIGFPE)
    if spec.get("fault") == "hang":
        time.sleep(3600)  # fault injection: a wedged GPU or a deadlocked library
    gen = torch.Generator().manual_seed(1234)
    a64 = torch.randn(m, k, generator=gen, dtype=torch.float64)
    b64 = torch.randn(k, n, generator=gen, dtype=torch.float64)
    start = time.perf_counter()
    if dtype_name == "fp8_e4m3":
        fp8 = torch.float8_e4m3fn
        a8, b8 = a64.to(fp8), b64.t().contiguous().to(fp8).t()  # _scaled_mm wants B column-major
        a, b = a8.double(), b8.double()
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a8.to(device), b8.to(device), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            dtype_name
        ]
        a, b = a64.to(dtype), b64.to(dtype)
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
        out = a.to(device) @ b.to(device)
        a, b = a.double(), b.double()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = a @ b
    got = out.double().cpu()
    finite = bool(torch.isfinite(got).all())
    err = float((got - ref).abs().max()) if finite else math.inf
    # Probabilistic dot-product error bound: sqrt(k) * u * (|A| @ |B|), plus rounding of the output.
    u = UNIT_ROUNDOFF[dtype_name]
    scale = float((a.abs() @ b.abs()).max())
    tol = 8.0 * math.sqrt(k) * u * scale + u * float(ref.abs().max())
    return {
        "status": "ok" if finite and err <= tol else "wrong",
        "max_abs_err": err,
        "tolerance": tol,
        "scale": scale,  # max(|A| @ |B|): the bound grows with it; reports show error and tolerance relative to it
        "k": k,
        "u": u,
        "seconds": round(seconds, 4),
        "finite": finite,
    }


def main() -> None:
    specs = json.loads(sys.argv[1])
    import torch  # noqa: F401 - imported before the first START, so the probe timeout excludes it

    for spec in specs:
        print(START + spec["name"], flush=True)
        try:
            result = run_probe(spec)
        except Exception as exc:  # an exception is a result; only signals kill the child
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(RESULT + json.dumps({"name": spec["name"], **result}), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the slow teardown of an interpreter that imported torch
