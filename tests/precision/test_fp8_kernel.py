"""fp8 candidates: the real fp8 GEMM (torch._scaled_mm) where it runs, fake-quant elsewhere, and the
report says which. torch's CPU _scaled_mm is a slow reference kernel, so these use small layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.candidates import Fp8Linear, make_run, resolve_fp8_kernel


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scaled_mm_layer_matches_fake_quant(fp8, rowwise):
    linear = small()[0]
    x = torch.randn(4, 6, 32) * 3
    real, fake = Fp8Linear(linear, fp8, rowwise, "scaled_mm"), Fp8Linear(linear, fp8, rowwise, "fake")
    with torch.no_grad():
        got, want = real(x), fake(x)
        # rows of a larger input with the whole input's tensorwise scale, as the isolated re-run passes them
        rows, rows_fake = real(x[:, :2], input_amax=x.abs().amax()), fake(x[:, :2], input_amax=x.abs().amax())
    assert got.shape == (4, 6, 48) and got.dtype == torch.float32
    if real.fallback is not None:
        # The kernel refused, which is allowed only for rowwise scales: torch 2.11's CPU _scaled_mm
        # scales tensorwise only. The layer then says why and computes exactly what fake-quant does.
        assert rowwise, real.fallback
        assert real.fallback.startswith(("RuntimeError: ", "NotImplementedError: ")) and len(real.fallback) > 20
        assert torch.equal(got, want) and torch.equal(rows, rows_fake)
        return
    # the same fp8 values and scales; only the order of the fp32 sums and of the scaling differs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, rows_fake, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, want[:, :2], rtol=1e-5, atol=1e-5)


def test_compare_reports_the_real_kernel():
    model, x = small(), torch.randn(8, 32)
    real = fpdoctor.compare(model, x, candidate="fp8-e4m3", fp8_kernel="scaled_mm")
    fake = fpdoctor.compare(model, x, candidate="fp8-e4m3", fp8_kernel="fake")
    assert real.report.data["fp8_kernel"] == {
        "layers": 2,
        "scaled_mm": 2,
        "fake": 0,
        "fallback": [],
        "text": "torch._scaled_mm (the real fp8 kernel) in all 2 Linear layer(s)",
    }
    assert dict(fake.report.data["summary"])["fp8 GEMM"].startswith("simulated (fake-quant")
    for a, b in zip(real.rows, fake.rows, strict=True):
        assert a.module == b.module and a.propagated == pytest.approx(b.propagated, rel=1e-3)


def test_a_layer_the_kernel_rejects_falls_back_and_says_why(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("Multiplication of two Float8_e5m2 matrices is not supported\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    result = fpdoctor.compare(small(), torch.randn(8, 32), candidate="fp8-e5m2", fp8_kernel="scaled_mm")
    kernels = result.report.data["fp8_kernel"]
    assert kernels["scaled_mm"] == 0 and kernels["fake"] == 2
    assert kernels["fallback"] == ["RuntimeError: Multiplication of two Float8_e5m2 matrices is not supported"]
    assert "the kernel did not run: RuntimeError: Multiplication" in kernels["text"]
    assert result.first_divergent is None and len(result.rows) == 4  # the simulation took over


def test_auto_is_fake_quant_off_fp8_tensor_cores():
    cpu = torch.device("cpu")
    assert resolve_fp8_kernel("auto", cpu) == "fake" and resolve_fp8_kernel("scaled_mm", cpu) == "scaled_mm"
    kinds = {m.kernel for m in make_run(small(), "fp8-e4m3-rowwise").modules() if isinstance(m, Fp8Linear)}
    assert kinds == {"fake"}
    with pytest.raises(ValueError, match="unknown fp8 kernel 'cublas'"):
        resolve_fp8_kernel("cublas", cpu)


def test_fp16_reductions_flag_on_cuda_is_set_and_restored():
    """CPU twin of the CUDA path: the flag lives in torch's global context on every build."""
    from fpdoctor.precision.candidates import Fp16AccumulateLinear, run_flags

    matmul = torch.backends.cuda.matmul
    cuda, before = torch.device("cuda"), matmul.allow_fp16_reduced_precision_reduction
    try:
        for user in (True, False):
            matmul.allow_fp16_reduced_precision_reduction = user
            with run_flags("fp16-accumulate", cuda) as flags:
                assert matmul.allow_fp16_reduced_precision_reduction is True
            assert flags == {"allow_fp16_reduced_precision_reduction": True, "yours": user}
            with run_flags("fp16", cuda) as flags:
                assert matmul.allow_fp16_reduced_precision_reduction is False
            assert matmul.allow_fp16_reduced_precision_reduction is user
            with run_flags("fp16-accumulate", torch.device("cpu")) as flags, run_flags("bf16", cuda) as other:
                assert flags == {} and other == {} and matmul.allow_fp16_reduced_precision_reduction is user
    finally:
        matmul.allow_fp16_reduced_precision_reduction = before
    # on CUDA the flag does the accumulation: plain fp16 Linear layers; elsewhere the simulation
    on_cuda = make_run(small(), "fp16-accumulate", device=cuda)
    assert not any(isinstance(m, Fp16AccumulateLinear) for m in on_cuda.modules())
    assert on_cuda[0].weight.dtype == torch.float16
    assert sum(isinstance(m, Fp16AccumulateLinear) for m in make_run(small(), "fp16-accumulate").modules()) == 2
