"""A compare record: what one machine's compare run saw, to judge another machine's run against.

`fpdoctor compare MODEL --save-reference FILE` on machine A writes one; `--against FILE` on
machine B reads it (against.py judges, recording.py makes records from a run). Anchor:
Polygraphy's `--save-outputs` / `--load-outputs`, which exists for TensorRT and ONNX Runtime only.

Format: gzip'd JSON (RFC 8259: a non-finite number is the string "inf" or "nan"), readable with
`zcat`. Samples are base64 of little-endian arrays: the fp64 output sample as float64, the
candidate's as float32, which holds fp16, bf16, fp8 and fp32 values exactly. Loading parses
JSON and nothing else - never pickle, so a record from anywhere cannot run code - and checks
every field (version, types, lengths, finiteness, the norm against its sample); a file that is
not a record, is truncated or corrupt is refused with one line saying what is wrong.

Size: per module call at most SAMPLE float64 values plus as many float32 ones (96 KiB) and a few
numbers; gzip takes back most of the base64 overhead and some of the zero low bits of fp16/bf16
values. compare itself keeps up to twice SAMPLE values (metrics.flat_sample strides by an
integer); a record keeps SAMPLE of them evenly spread (recording.thin), which both machines do
alike, so their samples stay element for element at the same positions.
"""

from __future__ import annotations

import array
import base64
import binascii
import gzip
import json
import math
import os
import re
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fpdoctor import files
from fpdoctor._version import __version__
from fpdoctor.errors import InputError
from fpdoctor.precision.metrics import SAMPLE, l2_norm
from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, REFERENCES

FORMAT = "fpdoctor.compare-record"
VERSION = 1
# A record of a model with 10,000 module calls is about 1.3 GB of JSON; beyond 4 GiB it is not
# one fpdoctor wrote (a decompression bomb stops here instead of filling the memory).
MAX_BYTES = 4 * 2**30
# What gzip makes of base64'd float samples is 1.3-4x smaller; a file that unpacks to far more
# than that ratio (a gzip'd run of zeros) stops there, before it fills the memory.
MAX_RATIO = 32
_HEX = re.compile(r"^[0-9a-f]{8,64}$")


class RecordError(InputError):
    """A file that is not a usable compare record; the message is one line saying why."""


@dataclass(frozen=True)
class Settings:
    """What the compare run judged; the run against the record must judge the same."""

    candidate: str
    reference: str = "fp32"
    fp8_kernel: str = "auto"
    device: str | None = None  # where the candidate ran when not where the model is (compare --device)
    module: str | None = None  # compare --module


@dataclass(frozen=True, eq=False)
class CallRecord:
    """One module call as compare judged it: its samples and the numbers of its row."""

    module: str  # dotted name as in named_modules(); "" is the whole model
    call: int  # 0 for the first call of the module in the forward, 1 for the next
    leaf: bool
    numel: int  # elements of the whole output
    norm: float  # L2 norm of `truth`
    floor: float  # the row's noise floor (profile.ModuleRow.floor); inf when the reference overflowed
    propagated: float  # the candidate run's error against fp64; inf when non-finite
    isolated: float | None  # the candidate module fed the fp64 inputs; None: not measured
    reference: float | None  # the reference's isolated error; None: not measured
    nonfinite: int  # NaN/Inf among all elements of the candidate's output
    truth: torch.Tensor  # float64, finite: every k-th value of compare's fp64 sample
    candidate: torch.Tensor  # float32, the candidate run's values at the same positions


@dataclass(frozen=True, eq=False)
class SetRecord:
    """One input set: what it was (inputs.describe) and every module call it made."""

    inputs: dict[str, Any]  # {"tensors": [{"name", "shape", "dtype"}], "digest"}
    noise: str | None  # digest of the random draws the forward made itself (noise.py); None: none
    calls: tuple[CallRecord, ...]


@dataclass(frozen=True, eq=False)
class CompareRecord:
    """A compare run on one machine: `fpdoctor.compare(..., save_reference=PATH)` writes it,
    `fpdoctor.compare(..., against=PATH or CompareRecord)` judges another run against it."""

    settings: Settings
    machine: dict[str, str | int | float | bool | None]  # machine.facts()
    weights: dict[str, str]  # module name -> digest of its own parameters and buffers
    sets: tuple[SetRecord, ...]
    fpdoctor: str = __version__
    created: str = ""  # ISO 8601, UTC
    skipped: int = 0  # module calls left out: their fp64 output was not finite, no scale to judge by
    version: int = field(default=VERSION)
    source: str = field(default="the record", compare=False)  # the file it was read from; not written

    @property
    def calls(self) -> int:
        return sum(len(s.calls) for s in self.sets)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "fpdoctor": self.fpdoctor,
            "created": self.created,
            "settings": vars(self.settings),
            "machine": self.machine,
            "weights": self.weights,
            "skipped": self.skipped,
            "sets": [
                {"inputs": s.inputs, "noise": s.noise, "calls": [_call_doc(c) for c in s.calls]} for s in self.sets
            ],
        }
        text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
        # mtime=0: the same record gives the same bytes; level 6 is zlib's default trade-off
        return gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0)

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "the record") -> CompareRecord:
        return _parse(_document(data, source), source)

    def save(self, path: str | os.PathLike[str]) -> int:
        """Write atomically (a reader never sees half a record; an existing file keeps its mode, a
        new one gets the umask's); returns the size in bytes."""
        data = self.to_bytes()
        write_bytes_atomic(Path(path), data)
        return len(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CompareRecord:
        """Read and check a record; RecordError (one line) for anything that is not a usable one."""
        source = str(path)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise RecordError(f"{source}: no such file; give the file --save-reference wrote") from None
        except IsADirectoryError:
            raise RecordError(f"{source} is a directory; give the file --save-reference wrote") from None
        except OSError as exc:
            raise RecordError(f"{source}: cannot be read ({exc.strerror or exc})") from None
        return cls.from_bytes(data, source)


# -- writing ------------------------------------------------------------------------------------


def _number(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _samples(t: torch.Tensor, code: str) -> str:
    values = array.array(code, t.detach().to("cpu").reshape(-1).tolist())
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def _call_doc(c: CallRecord) -> dict[str, Any]:
    return {
        "module": c.module,
        "call": c.call,
        "leaf": c.leaf,
        "numel": c.numel,
        "norm": _number(c.norm),
        "floor": _number(c.floor),
        "propagated": _number(c.propagated),
        "isolated": None if c.isolated is None else _number(c.isolated),
        "reference": None if c.reference is None else _number(c.reference),
        "nonfinite": c.nonfinite,
        "truth": _samples(c.truth, "d"),
        "candidate": _samples(c.candidate, "f"),
    }


def write_bytes_atomic(target: Path, data: bytes) -> None:
    """Via a temporary file in the same directory and a rename (fpdoctor.files)."""
    if target.is_dir():
        raise ValueError(f"{target} is a directory; give a file name for the record")
    if not target.parent.exists():
        raise ValueError(f"{target.parent} does not exist; create it or choose another path for the record")
    files.write_atomic(target, data)


# -- reading: bytes -> JSON document -> record, every field checked ----------------------------


def _document(data: bytes, source: str) -> dict[str, Any]:
    what = "a compare record (gzip'd JSON that `fpdoctor compare --save-reference` writes)"
    if data[:2] == b"\x1f\x8b":
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing; checks the CRC at the end
        limit = min(MAX_BYTES, max(2**26, MAX_RATIO * len(data)))
        try:
            text = inflate.decompress(data, limit + 1)
        except zlib.error as exc:
            raise RecordError(f"{source} is corrupt: its gzip data does not decompress ({exc})") from None
        if len(text) > limit:
            raise RecordError(
                f"{source} unpacks to more than {limit // 2**20} MiB ({MAX_RATIO}x its size at most for a "
                f"record): it is not {what}"
            )
        if not inflate.eof:
            raise RecordError(f"{source} is truncated (its gzip stream ends early); copy the file again")
        if inflate.unused_data.strip(b"\0"):
            raise RecordError(f"{source} has data after its gzip stream; copy the file again")
    elif data[:1] == b"{":  # a record unpacked with gunzip reads as well
        text = data
    elif not data:
        raise RecordError(f"{source} is empty; copy the file again, or make a new record")
    elif data[:1] == b"\x80" or data[:2] == b"PK":
        kind = "a Python pickle" if data[:1] == b"\x80" else "a zip archive (torch.save, .npz)"
        raise RecordError(f"{source} is {kind}, which fpdoctor never unpickles (it could run code); give {what}")
    else:
        raise RecordError(f"{source} is not {what}")

    def refuse(constant: str) -> Any:
        raise ValueError(f"non-standard constant {constant}")

    try:
        doc = json.loads(text.decode("utf-8"), parse_constant=refuse)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"{source} is not valid JSON ({str(exc).splitlines()[0]}): it is not {what}") from None
    except RecursionError:  # nesting no record has
        raise RecordError(f"{source} is JSON nested too deep: it is not {what}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecordError(f"{source} is JSON but not {what}")
    return doc


class _Check:
    """Field access that names the field and the problem in the RecordError."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> RecordError:
        return RecordError(f"{self.source}: {where} {problem}; the record is damaged or was edited, make it again")

    def get(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"{where}.{key}".lstrip("."), "is missing")
        return obj[key]

    def typed(self, obj: Mapping[str, Any], key: str, kind: Any, where: str, optional: bool = False) -> Any:
        value = self.get(obj, key, where)
        if value is None and optional:
            return None
        # bool is an int in Python; a count or index must not be true/false
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(f"{where}.{key}".lstrip("."), f"is {type(value).__name__}, not {name}")
        return value

    def count(self, obj: Mapping[str, Any], key: str, where: str, low: int = 0) -> int:
        value: int = self.typed(obj, key, int, where)
        if value < low:
            raise self.fail(f"{where}.{key}", f"is {value}, below {low}")
        return value

    def error(self, obj: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> float | None:
        """A relative error: a number >= 0, or "inf" (a non-finite output)."""
        value = self.get(obj, key, where)
        if value is None and optional:
            return None
        if value == "inf":
            return math.inf
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
        raise self.fail(f"{where}.{key}", f'is {value!r}, not an error (a number >= 0 or "inf")')

    def finite(self, obj: Mapping[str, Any], key: str, where: str) -> float:
        value = self.get(obj, key, where)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0:
            raise self.fail(f"{where}.{key}", f"is {value!r}, not a finite number >= 0")
        return float(value)

    def samples(self, obj: Mapping[str, Any], key: str, where: str, code: str) -> torch.Tensor:
        text = self.typed(obj, key, str, where)
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise self.fail(f"{where}.{key}", "is not base64") from None
        size = array.array(code).itemsize
        if not raw or len(raw) % size or len(raw) // size > SAMPLE:
            raise self.fail(f"{where}.{key}", f"holds {len(raw)} bytes, not 1 to {SAMPLE} values of {size} bytes")
        values = array.array(code)
        values.frombytes(raw)
        if sys.byteorder == "big":
            values.byteswap()
        dtype = torch.float64 if code == "d" else torch.float32
        return torch.frombuffer(values, dtype=dtype).clone()


def _parse(doc: dict[str, Any], source: str) -> CompareRecord:
    c = _Check(source)
    version = c.typed(doc, "version", int, "")
    made_by = doc.get("fpdoctor") if isinstance(doc.get("fpdoctor"), str) else "?"
    if version > VERSION:
        raise RecordError(
            f"{source} is a compare record of format {version}, made by fpdoctor {made_by}; this fpdoctor "
            f"({__version__}) reads format {VERSION}: upgrade fpdoctor on this machine"
        )
    if version < 1:
        raise c.fail("version", f"is {version}")
    settings_doc = c.typed(doc, "settings", dict, "")
    candidate = c.typed(settings_doc, "candidate", str, "settings")
    reference = c.typed(settings_doc, "reference", str, "settings")
    fp8_kernel = c.typed(settings_doc, "fp8_kernel", str, "settings")
    for what, value, allowed in (
        ("candidate", candidate, CANDIDATES),
        ("reference", reference, REFERENCES),
        ("fp8_kernel", fp8_kernel, FP8_KERNELS),
    ):
        if value not in allowed:
            raise c.fail(f"settings.{what}", f"is {value!r}, not one of {', '.join(allowed)}")
    settings = Settings(
        candidate,
        reference,
        fp8_kernel,
        c.typed(settings_doc, "device", str, "settings", optional=True),
        c.typed(settings_doc, "module", str, "settings", optional=True),
    )
    machine = c.typed(doc, "machine", dict, "")
    for key, value in machine.items():
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise c.fail(f"machine.{key}", f"is {type(value).__name__}, not a plain value")
    weights = c.typed(doc, "weights", dict, "")
    for key, value in weights.items():
        if not isinstance(value, str) or not _HEX.match(value):
            raise c.fail(f"weights[{key!r}]", "is not a hex digest")
    sets_doc = c.typed(doc, "sets", list, "")
    if not sets_doc:
        raise c.fail("sets", "is empty")
    sets = tuple(_parse_set(c, s, f"sets[{k}]") for k, s in enumerate(sets_doc))
    return CompareRecord(
        source=source,
        settings=settings,
        machine=machine,
        weights=weights,
        sets=sets,
        fpdoctor=c.typed(doc, "fpdoctor", str, ""),
        created=c.typed(doc, "created", str, ""),
        skipped=c.count(doc, "skipped", ""),
        version=version,
    )


def _parse_set(c: _Check, doc: Any, where: str) -> SetRecord:
    if not isinstance(doc, dict):
        raise c.fail(where, f"is {type(doc).__name__}, not an object")
    inputs = c.typed(doc, "inputs", dict, where)
    digest = c.typed(inputs, "digest", str, f"{where}.inputs")
    if not _HEX.match(digest):
        raise c.fail(f"{where}.inputs.digest", "is not a hex digest")
    tensors = c.typed(inputs, "tensors", list, f"{where}.inputs")
    for k, t in enumerate(tensors):
        at = f"{where}.inputs.tensors[{k}]"
        if not isinstance(t, dict):
            raise c.fail(at, "is not an object")
        c.typed(t, "name", str, at)
        c.typed(t, "dtype", str, at)
        shape = c.typed(t, "shape", list, at)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise c.fail(f"{at}.shape", "is not a list of sizes")
    noise = c.typed(doc, "noise", str, where, optional=True)
    if noise is not None and not _HEX.match(noise):
        raise c.fail(f"{where}.noise", "is not a hex digest")
    calls_doc = c.typed(doc, "calls", list, where)
    calls = tuple(_parse_call(c, d, f"{where}.calls[{k}]") for k, d in enumerate(calls_doc))
    seen: set[tuple[str, int]] = set()
    for call in calls:
        if (call.module, call.call) in seen:
            raise c.fail(where, f"has module `{call.module}` call {call.call} twice")
        seen.add((call.module, call.call))
    return SetRecord({"tensors": tensors, "digest": digest}, noise, calls)


def _positive(c: _Check, doc: Mapping[str, Any], where: str) -> float:
    floor = c.error(doc, "floor", where) or 0.0
    if floor <= 0:
        raise c.fail(f"{where}.floor", "is 0, not a noise floor")
    return floor


def _parse_call(c: _Check, doc: Any, where: str) -> CallRecord:
    if not isinstance(doc, dict):
        raise c.fail(where, f"is {type(doc).__name__}, not an object")
    truth = c.samples(doc, "truth", where, "d")
    candidate = c.samples(doc, "candidate", where, "f")
    if truth.numel() != candidate.numel():
        raise c.fail(where, f"has {truth.numel()} fp64 values but {candidate.numel()} candidate values")
    if not bool(torch.isfinite(truth).all()):
        raise c.fail(f"{where}.truth", "holds NaN or Inf")
    norm = c.finite(doc, "norm", where)
    if not math.isclose(norm, l2_norm(truth), rel_tol=1e-9, abs_tol=1e-300):
        raise c.fail(f"{where}.norm", "does not match its sample")
    numel = c.count(doc, "numel", where, low=1)
    if numel < truth.numel():
        raise c.fail(f"{where}.numel", f"is {numel}, fewer than its {truth.numel()} sampled values")
    return CallRecord(
        module=c.typed(doc, "module", str, where),
        call=c.count(doc, "call", where),
        leaf=c.typed(doc, "leaf", bool, where),
        numel=numel,
        norm=norm,
        floor=_positive(c, doc, where),
        propagated=c.error(doc, "propagated", where) or 0.0,
        isolated=c.error(doc, "isolated", where, optional=True),
        reference=c.error(doc, "reference", where, optional=True),
        nonfinite=c.count(doc, "nonfinite", where),
        truth=truth,
        candidate=candidate,
    )
