"""The device-side work of a fingerprint, in process on the CPU (and on a GPU where there is one)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fpdoctor.health import gemm  # noqa: E402

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda:0")] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
    torch.backends.cuda.matmul.allow_tf32 = False


def _flip_every(monkeypatch, every: int, row: int = 9, col: int = 5) -> list[int]:
    """torch.mm with the lowest bit of element [row, col] flipped in every `every`th result."""
    real = torch.mm
    calls = [0]

    def faulty(a, b):
        out = real(a, b)
        calls[0] += 1
        if calls[0] % every == 0:
            bits = out.view(torch.int16) if out.element_size() == 2 else out.view(torch.int32)
            bits[row, col] ^= 1
        return out

    monkeypatch.setattr(torch, "mm", faulty)
    return calls


def _reference_hash(i: int, seed: int) -> int:
    """The counter hash in plain Python integers: what every device must compute."""
    x = (i * 0x6C8E9CF5 + seed * 0x7FEB352D + 0x165667B1) & 0xFFFFFFFF  # Python ints never overflow
    x ^= x >> 16
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 15
    return x >> 8


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_hash_is_pinned_because_every_machine_must_draw_the_same_inputs(device):
    values = gemm.hash_ints(6, seed=101, device=device).tolist()
    assert values == [_reference_hash(i, 101) for i in range(6)]
    assert values == [1480754, 16335872, 9405649, 7540113, 6678673, 13559885]
    big = gemm.hash_ints(4, seed=2**31 - 1, device=device, offset=2**32 - 2).tolist()
    assert big == [_reference_hash(2**32 - 2 + i, 2**31 - 1) for i in range(4)]  # the 32-bit counter wraps
    assert gemm.hash_ints(3, seed=101, device=CPU, offset=3).tolist() == values[3:]
    many = gemm.hash_ints(1 << 16, seed=7, device=CPU)
    assert int(many.min()) >= 0 and int(many.max()) < 1 << 24
    assert len(set(many.tolist())) > 0.99 * (1 << 16)  # no short cycle


def test_inputs_are_exact_and_in_range():
    u = gemm.uniform((64, 128), 3, torch.float32, CPU)
    assert float(u.min()) >= -1.0 and float(u.max()) < 1.0
    assert torch.equal(u, u.double().float())  # 24-bit integers scaled by a power of two: exact
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):  # generated straight into the dtype,
        direct = gemm.uniform((64, 128), 3, dtype, CPU).view(torch.uint8)  # yet rounded once from float32
        assert torch.equal(direct, u.to(dtype).view(torch.uint8))
    ints = gemm.integers((64, 224), 4, 3, CPU)
    assert ints.dtype == torch.int64 and int(ints.min()) == -3 and int(ints.max()) == 3


@pytest.mark.parametrize("name", sorted(gemm.KNOWN_ANSWER))
def test_known_answer_bounds_hold_every_partial_sum_exactly(name):
    # the largest integer n with every integer in [-n, n] exact, for the accumulator and the output
    exact_up_to = {"fp32": 2**24, "tf32": 2**24, "fp16": 2**11, "bf16": 2**8, "fp8": 2**8}[name]
    plan = gemm.KNOWN_ANSWER[name]
    assert plan.span**2 * plan.k <= exact_up_to
    if name in ("tf32", "fp8"):  # inputs themselves: tf32 keeps 10 mantissa bits, e4m3 3 bits
        assert plan.span <= {"tf32": 2**11, "fp8": 16}[name]


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("name", gemm.DTYPES)
def test_known_answer_is_exact_on_a_healthy_device(device, name):
    if gemm.supported(name, device):
        pytest.skip(gemm.supported(name, device))
    gemm.deterministic(device)
    mn = 64 if device.type == "cpu" else 256
    result = gemm.known_answer(name, device, mn)
    assert result["ok"], result
    assert result["shape"] == [mn, gemm.KNOWN_ANSWER[name].k, mn]
    # the digest is the exact answer's: the same for every device
    assert result["digest"] == gemm.known_answer(name, CPU, mn)["digest"]


def test_known_answer_sees_one_flipped_bit_and_where_it_is(monkeypatch):
    _flip_every(monkeypatch, 1, row=9, col=5)
    result = gemm.known_answer("fp32", CPU, 64)
    assert not result["ok"]
    assert result["wrong_repeats"] == gemm.KNOWN_ANSWER_REPEATS
    assert result["not_integer"] == 1  # 0.0 or an integer with its last bit flipped is no integer
    assert result["digest"] is None


def test_known_answer_sees_an_intermittent_fault(monkeypatch):
    _flip_every(monkeypatch, 3)
    result = gemm.known_answer("bf16", CPU, 64)
    assert not result["ok"] and result["wrong_repeats"] == 1


def test_known_answer_locates_a_wrong_integer(monkeypatch):
    real = torch.mm

    def off_by_one(a, b):
        out = real(a, b)
        out[9, 5] += 1  # an integer error: still an integer, only the projections see it
        return out

    monkeypatch.setattr(torch, "mm", off_by_one)
    result = gemm.known_answer("fp32", CPU, 64)
    assert not result["ok"] and result["not_integer"] == 0
    assert result["first_wrong_rows"] == [9] and result["first_wrong_cols"] == [5]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_digests_repeat_bit_for_bit(device):
    gemm.deterministic(device)
    first = gemm.seeded("bf16", device, 64, 128, budget_s=0.05)
    again = gemm.seeded("bf16", device, 64, 128, budget_s=0.05)
    assert first["distinct"] == 1 and first["agreeing"] == first["repeats"] >= gemm.MIN_REPEATS
    assert first["digest"] == again["digest"]
    assert first["tflops"] > 0
    assert gemm.seeded("fp16", device, 64, 128, budget_s=0.0)["digest"] != first["digest"]


def test_seeded_repeats_see_an_intermittent_flip(monkeypatch):
    clean = gemm.seeded("fp32", CPU, 64, 128, budget_s=0.0)
    _flip_every(monkeypatch, 3)
    faulty = gemm.seeded("fp32", CPU, 64, 128, budget_s=0.05)
    assert faulty["distinct"] == 2
    assert faulty["digest"] == clean["digest"]  # the majority of repeats is still right
    assert faulty["agreeing"] < faulty["repeats"]


def test_seeded_digest_of_a_consistently_wrong_device_differs(monkeypatch):
    clean = gemm.seeded("bf16", CPU, 64, 128, budget_s=0.0)
    _flip_every(monkeypatch, 1)
    wrong = gemm.seeded("bf16", CPU, 64, 128, budget_s=0.0)
    assert wrong["distinct"] == 1 and wrong["digest"] != clean["digest"]


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.view(-1).__setitem__(7, c.view(-1)[7] + 1),  # one value
        lambda c: c.__setitem__([2, 3], c[[3, 2]]),  # two rows swapped: same words, other places
        lambda c: c.__setitem__((slice(None), [2, 3]), c[:, [3, 2]]),  # two columns swapped
    ],
    ids=["one-value", "rows-swapped", "columns-swapped"],
)
def test_digest_sees_changed_and_moved_values(change):
    c = gemm.uniform((32, 48), 5, torch.float32, CPU).to(torch.bfloat16)
    h = gemm._weights(32, 15, gemm._WEIGHT_LIMIT, CPU)
    g = gemm._weights(48, 16, gemm._WEIGHT_LIMIT, CPU)
    before = gemm._digest(c, h, g).tolist()
    changed = c.clone()
    change(changed)
    assert not torch.equal(changed, c)
    assert gemm._digest(changed, h, g).tolist() != before


def test_tf32_is_not_run_on_a_cpu():
    assert gemm.supported("tf32", CPU)
    assert gemm.supported("bf16", CPU) is None
