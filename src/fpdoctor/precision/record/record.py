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

Decisions (format 2): when the output is logits (compare/use.py), a sample of values cannot say
which class a row picks, so per input set the record also keeps what the use metrics need
(DecisionRecord): per row the fp64 output's class, the candidate's class and its TOP_K best
(int32), the top-1 floor and KL floor computed here from the whole output, and whole rows of both
outputs for KL. Bounded: DECIDED_ROWS rows of 2 + TOP_K int32s (an evenly spread DECIDED_ROWS of
a longer output), and KEPT_VALUES logits of each output (float64 and float32: at most 1.5 MiB
before gzip; one row when a row alone is longer). A format-1 record has none of it: the judge
says so, and judges the rest as before.
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
from fpdoctor.precision.decide import TOP_K
from fpdoctor.precision.metrics import SAMPLE, l2_norm
from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, REFERENCES

FORMAT = "fpdoctor.compare-record"
VERSION = 2  # 2: per input set, the decisions of an output of logits (DecisionRecord)
# The rows of an output of logits whose decisions a record keeps (an evenly spread sample beyond:
# an LM's batch of 8 x 4096 tokens is all of them) ...
DECIDED_ROWS = 2**15
# ... and how many of its logits it keeps whole, in rows, for KL: a classifier's 1000 classes give
# 131 rows, a vocabulary of 50,000 two.
KEPT_VALUES = 2**17
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


def spread(n: int, count: int) -> torch.Tensor:
    """`count` of n positions evenly spread, first and last included (all of them when count >= n).
    Integer arithmetic: both machines pick the same positions, whatever their torch."""
    if count >= n:
        return torch.arange(n, dtype=torch.int64)
    if count <= 1:
        return torch.zeros(1, dtype=torch.int64)
    return torch.arange(count, dtype=torch.int64) * (n - 1) // (count - 1)


def decided_rows(rows: int) -> int:
    """How many rows of an output of `rows` rows a record keeps the decisions of."""
    return min(rows, DECIDED_ROWS)


def kept_rows(rows: int, classes: int) -> int:
    """How many of the decided rows a record keeps whole (for KL): KEPT_VALUES logits, one row at least."""
    return min(decided_rows(rows), max(1, KEPT_VALUES // classes))


@dataclass(frozen=True, eq=False)
class DecisionRecord:
    """An output of logits as its rows decide, on this machine: what another run's candidate is
    judged against by its use (top-1, top-5, KL), and this run's own candidate to judge."""

    source: str  # where the logits come from, as the report names it (use.logits_source)
    rows: int  # rows of the output: every dimension but the last
    classes: int
    floor_top1: float  # top-1 agreement of the fp64 output rounded to the candidate's format, decided rows
    floor_kl: float  # KL(fp64 || fp64 rounded to the candidate's format), nats, kept rows
    truth_top1: torch.Tensor  # int32 [decided rows]: the fp64 output's class per row
    candidate_top1: torch.Tensor  # int32 [decided rows]: the candidate's class per row
    candidate_topk: torch.Tensor  # int32 [decided rows, k]: the candidate's k best classes, k = min(TOP_K, classes)
    truth_rows: torch.Tensor  # float64 [kept rows, classes]: the fp64 output's kept rows whole
    candidate_rows: torch.Tensor  # float32 [kept rows, classes]: the candidate's (exact for its formats)

    @property
    def decided(self) -> int:
        return decided_rows(self.rows)

    @property
    def kept(self) -> int:
        return kept_rows(self.rows, self.classes)


@dataclass(frozen=True, eq=False)
class SetRecord:
    """One input set: what it was (inputs.describe) and every module call it made."""

    inputs: dict[str, Any]  # {"tensors": [{"name", "shape", "dtype"}], "digest"}
    noise: str | None  # digest of the random draws the forward made itself (noise.py); None: none
    calls: tuple[CallRecord, ...]
    # the output's decisions when it is logits; a string says why an output of logits has none (its
    # candidate's values are not finite); None: the output is not logits, or a format-1 record
    decisions: DecisionRecord | str | None = None


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
                {
                    "inputs": s.inputs,
                    "noise": s.noise,
                    "calls": [_call_doc(c) for c in s.calls],
                    "decisions": _decisions_doc(s.decisions),
                }
                for s in self.sets
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


def _decisions_doc(d: DecisionRecord | str | None) -> dict[str, Any] | str | None:
    if d is None or isinstance(d, str):
        return d
    return {
        "source": d.source,
        "rows": d.rows,
        "classes": d.classes,
        "floor_top1": d.floor_top1,
        "floor_kl": d.floor_kl,
        "truth_top1": _samples(d.truth_top1, "i"),
        "candidate_top1": _samples(d.candidate_top1, "i"),
        "candidate_topk": _samples(d.candidate_topk, "i"),
        "truth_rows": _samples(d.truth_rows, "d"),
        "candidate_rows": _samples(d.candidate_rows, "f"),
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

    def array(self, obj: Mapping[str, Any], key: str, where: str, code: str, count: int) -> torch.Tensor:
        """Exactly `count` values: int32 ("i", each >= 0), float64 ("d") or float32 ("f"), all finite."""
        text = self.typed(obj, key, str, where)
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise self.fail(f"{where}.{key}", "is not base64") from None
        values = array.array(code)
        if len(raw) != count * values.itemsize:
            raise self.fail(f"{where}.{key}", f"holds {len(raw)} bytes, not {count} values of {values.itemsize} bytes")
        values.frombytes(raw)
        if sys.byteorder == "big":
            values.byteswap()
        dtype = {"i": torch.int32, "d": torch.float64, "f": torch.float32}[code]
        out = torch.frombuffer(values, dtype=dtype).clone() if count else torch.empty(0, dtype=dtype)
        bad = bool((out < 0).any()) if code == "i" else not bool(torch.isfinite(out).all())
        if bad:
            raise self.fail(f"{where}.{key}", "holds a negative class" if code == "i" else "holds NaN or Inf")
        return out


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
    sets = tuple(_parse_set(c, s, f"sets[{k}]", version) for k, s in enumerate(sets_doc))
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


def _parse_set(c: _Check, doc: Any, where: str, version: int) -> SetRecord:
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
    decisions = _parse_decisions(c, doc, where) if version >= 2 else None
    return SetRecord({"tensors": tensors, "digest": digest}, noise, calls, decisions)


def _parse_decisions(c: _Check, doc: Mapping[str, Any], where: str) -> DecisionRecord | str | None:
    d = c.typed(doc, "decisions", (dict, str), where, optional=True)
    if d is None or isinstance(d, str):
        return d
    at = f"{where}.decisions"
    source = c.typed(d, "source", str, at)
    rows = c.count(d, "rows", at, low=1)
    classes = c.count(d, "classes", at, low=2)
    floor_top1 = c.finite(d, "floor_top1", at)
    if floor_top1 > 1:
        raise c.fail(f"{at}.floor_top1", f"is {floor_top1!r}, not a share of rows")
    decided, kept, k = decided_rows(rows), kept_rows(rows, classes), min(TOP_K, classes)
    indices = {key: c.array(d, key, at, "i", n) for key, n in (
        ("truth_top1", decided), ("candidate_top1", decided), ("candidate_topk", decided * k),
    )}  # fmt: skip
    for key, values in indices.items():
        if values.numel() and int(values.max()) >= classes:
            raise c.fail(f"{at}.{key}", f"holds a class beyond its {classes}")
    return DecisionRecord(
        source=source,
        rows=rows,
        classes=classes,
        floor_top1=floor_top1,
        floor_kl=c.finite(d, "floor_kl", at),
        truth_top1=indices["truth_top1"],
        candidate_top1=indices["candidate_top1"],
        candidate_topk=indices["candidate_topk"].reshape(decided, k),
        truth_rows=c.array(d, "truth_rows", at, "d", kept * classes).reshape(kept, classes),
        candidate_rows=c.array(d, "candidate_rows", at, "f", kept * classes).reshape(kept, classes),
    )


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
