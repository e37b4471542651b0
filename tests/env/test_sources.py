"""Fact sources on real files and processes, with CPU twins for the NVIDIA paths."""

from __future__ import annotations

import importlib.metadata
import os
import stat
import sys
import types

import pytest

from fpdoctor.env.sources import NotChecked, gpus, libraries, system


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("libcublas.so.12", ("cublas", "12")),
        ("libcublasLt.so.12.1.3.1", ("cublasLt", "12.1.3.1")),
        ("libcudart-d0da41ae.so.11.0", ("cudart", "11.0")),  # auditwheel's hash-suffixed copy
        ("libcudnn.so.9", ("cudnn", "9")),
        ("libnccl.so.2", ("nccl", "2")),
        ("libnvJitLink.so.12", ("nvJitLink", "12")),
        ("libcudart.so", ("cudart", "")),
        ("libcudart_stub.so", None),  # a stub is not the runtime (flashinfer#5198)
        ("libcudnn_ops.so.9", None),
        ("libcublas.so.12.txt", None),
        ("xlibcublas.so.12", None),
    ],
)
def test_classify_matches_file_names_not_substrings(name, expected):
    assert libraries.classify(name) == expected


def _lib(directory, name, content=b"\x7fELF fake"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(content)
    return path


def test_copies_collapse_symlinks_and_keep_every_origin(tmp_path, monkeypatch):
    toolkit = tmp_path / "cuda-12.1" / "lib64"
    real = _lib(toolkit, "libcublasLt.so.12.1.3.1")
    (toolkit / "libcublasLt.so.12").symlink_to(real.name)
    (toolkit / "libcublasLt.so").symlink_to("libcublasLt.so.12")
    other = _lib(tmp_path / "opt" / "lib", "libcublasLt.so.12", b"\x7fELF other")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{toolkit}:{other.parent}:/does/not/exist")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-12.1"))
    copies, _ = libraries.library_copies([])
    ours = [c for c in copies if str(tmp_path) in c["path"]]
    assert len(ours) == 2
    by_path = {c["path"]: c for c in ours}
    toolkit_copy = by_path[os.path.realpath(real)]
    assert toolkit_copy["version"] == "12.1.3.1" and toolkit_copy["version_source"] == "filename"
    assert set(toolkit_copy["origins"]) == {"ld_library_path", "cuda_home"}
    assert toolkit_copy["dirs"]["ld_library_path"] == [str(toolkit)]
    assert by_path[os.path.realpath(other)]["version"] == "12"


def test_wheel_copies_carry_the_wheel_version(tmp_path):
    lib = _lib(tmp_path / "nvidia" / "cublas" / "lib", "libcublas.so.12")
    wheel = libraries.wheel_entry("nvidia_cublas_cu12", "12.4.5.8", [str(lib)])
    assert wheel["package"] == "nvidia-cublas-cu12" and wheel["libraries"] == ["cublas", "cublasLt"]
    assert libraries.wheel_entry("nvidia-cublas", "13.0.0.19")["libraries"] == ["cublas", "cublasLt"]  # CUDA 13 name
    assert libraries.wheel_entry("nvidia-cusolver-cu12", "11.0") is None
    copies, _ = libraries.library_copies([wheel])
    mine = next(c for c in copies if c["path"] == os.path.realpath(lib))
    assert (mine["version"], mine["package"], mine["origins"]) == ("12.4.5.8", "nvidia-cublas-cu12", ["pip"])


def test_loaded_copies_from_maps(tmp_path):
    lib = _lib(tmp_path, "libcudnn.so.9")
    copies = libraries.merge_copies(
        [
            {
                "library": "cudnn",
                "path": str(lib),
                "origin": "pip",
                "soname_version": "9",
                "package": "nvidia-cudnn-cu12",
                "package_version": "9.1.0.70",
            }
        ]
    )
    loaded = libraries.loaded_copies([str(lib), "/usr/lib/x86_64-linux-gnu/libc.so.6"], copies)
    assert loaded == [
        {"library": "cudnn", "path": os.path.realpath(lib), "version": "9.1.0.70", "package": "nvidia-cudnn-cu12"}
    ]


def test_distributions_see_this_torch_a_second_one_and_leftovers(tmp_path, monkeypatch):
    (tmp_path / "~orch-2.1.0.dist-info").mkdir()
    second = tmp_path / "torch-2.1.0.dist-info"
    second.mkdir()
    (second / "INSTALLER").write_text("pip\n")
    wheel = tmp_path / "nvidia_cublas_cu12-12.4.5.8.dist-info"
    wheel.mkdir()
    (wheel / "RECORD").write_text("nvidia/cublas/lib/libcublas.so.12,,\nnvidia/cublas/__init__.py,,\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    found = libraries.scan_distributions()
    torch_installs = found["torch_installs"]
    # the torch running these tests, whatever its version; a CUDA build brings its own nvidia-*
    # wheels (and a used machine may have debris of its own), so the planted ones are looked up
    release = importlib.metadata.version("torch")
    assert any(i["version"] == release for i in torch_installs["installs"]), torch_installs
    assert {"version": "2.1.0", "location": str(tmp_path), "installer": "pip"} in torch_installs["installs"]
    assert [d for d in torch_installs["debris"] if d.startswith(str(tmp_path))] == [
        str(tmp_path / "~orch-2.1.0.dist-info")
    ]
    assert [w for w in found["wheels"] if w["files"] and w["files"][0].startswith(str(tmp_path))] == [
        {
            "package": "nvidia-cublas-cu12",
            "version": "12.4.5.8",
            "libraries": ["cublas", "cublasLt"],
            "files": [str(tmp_path / "nvidia" / "cublas" / "lib" / "libcublas.so.12")],
        }
    ]


def test_relevant_env_keeps_what_matters():
    env = system.relevant_env(
        {
            "CUDA_VISIBLE_DEVICES": "0",
            "NCCL_DEBUG": "INFO",
            "HOME": "/root",
            "LD_LIBRARY_PATH": "/x",
            "PIP_EXTRA_INDEX_URL": "https://u:p@h/simple",
            "SHELL": "bash",
        }
    )
    assert set(env) == {"CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "LD_LIBRARY_PATH", "PIP_EXTRA_INDEX_URL"}


class _NVMLError(Exception):
    pass


def _fake_pynvml(init_error: str | None = None):
    """An in-memory stand-in for nvidia-ml-py: two H20s on driver 535.161.08 (CUDA 12.2)."""
    mod = types.SimpleNamespace(NVMLError=_NVMLError)

    def init():
        if init_error:
            raise _NVMLError(init_error)

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: None
    mod.nvmlSystemGetDriverVersion = lambda: "535.161.08"
    mod.nvmlSystemGetCudaDriverVersion = lambda: 12020
    mod.nvmlDeviceGetCount = lambda: 2
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H20"
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{h:02X}:00.0")
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=97871 * 2**20)
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    return mod


def test_nvml_source(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    facts = gpus.from_nvml()
    assert facts["driver"] == {"version": "535.161.08", "cuda": "12.2", "source": "nvml"}
    assert facts["gpus"][1] == {
        "index": 1,
        "name": "NVIDIA H20",
        "source": "nvml",
        "uuid": "GPU-1",
        "pci_bus_id": "00000000:01:00.0",
        "memory_mib": 97871,
        "compute_capability": "9.0",
    }


def test_nvml_failure_falls_back_to_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error="Driver Not Loaded"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H20, 9.0, 97871, GPU-aaaa, 00000000:18:00.0, 560.28.03'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    facts, not_checked = gpus.collect()
    assert not_checked == {"nvml": "NVML could not start: Driver Not Loaded"}
    assert facts["driver"]["version"] == "560.28.03"
    assert facts["gpus"] == [
        {
            "index": 0,
            "name": "NVIDIA H20",
            "compute_capability": "9.0",
            "memory_mib": 97871,
            "uuid": "GPU-aaaa",
            "pci_bus_id": "00000000:18:00.0",
            "source": "nvidia-smi",
        }
    ]


def test_no_driver_at_all_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error="NVML Shared Library Not Found"))
    monkeypatch.setenv("PATH", str(tmp_path))
    facts, not_checked = gpus.collect()
    assert facts == {"driver": None, "gpus": []}
    assert set(not_checked) == {"nvml", "nvidia-smi"}
    with pytest.raises(NotChecked):
        gpus.from_nvidia_smi()


def test_old_nvidia_smi_without_compute_cap(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error="Driver Not Loaded"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in *compute_cap*) echo \'Field "compute_cap" is not a valid field to query.\'; exit 2;; esac\n'
        "echo '0, Tesla V100-SXM2-16GB, 16160, GPU-bbbb, 00000000:3B:00.0, 470.82.01'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    facts = gpus.from_nvidia_smi()
    assert facts["gpus"][0]["compute_capability"] is None and facts["driver"]["version"] == "470.82.01"


def test_conda_env_libraries_are_found(tmp_path, monkeypatch):
    lib = _lib(tmp_path / "env" / "lib", "libcublas.so.11.11.3.6")
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "env"))
    copies, _ = libraries.library_copies([])
    mine = next(c for c in copies if c["path"] == os.path.realpath(lib))
    assert mine["origins"] == ["conda"] and mine["version"] == "11.11.3.6"
