"""Operating system, Python, and the environment variables that change CUDA/PyTorch behaviour."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Any

# Variables that change which libraries load, which GPUs are visible or how numerics behave.
_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "CUBLAS", "CUDNN_", "NVIDIA_", "LD_", "OMP_")
_NAMES = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "UV_INDEX_URL",
    "UV_EXTRA_INDEX_URL",
    "CONDA_PREFIX",
    "VIRTUAL_ENV",
    "PYTHONPATH",
)


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(_PREFIXES) or k in _NAMES}


def collect() -> dict[str, Any]:
    libc = " ".join(platform.libc_ver()).strip() or None
    distro = None
    with contextlib.suppress(OSError, AttributeError):
        distro = platform.freedesktop_os_release().get("PRETTY_NAME")
    return {
        "os": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "distro": distro,
            "libc": libc,
        },
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "implementation": platform.python_implementation(),
        },
        "env": relevant_env(),
    }
