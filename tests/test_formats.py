"""One table of float-format names: `trace --dtype`, compare and plan read the same spellings."""

from __future__ import annotations

import pytest

from fpdoctor import formats
from fpdoctor.formats import DTYPE_FORMAT, FORMATS, canonical, format_named
from fpdoctor.precision import names


@pytest.mark.parametrize(
    ("spelling", "fmt"),
    [
        ("half", "fp16"),
        ("torch.float16", "fp16"),
        ("BF16", "bf16"),
        ("float8_e4m3fn", "fp8_e4m3"),
        ("fp8-e4m3", "fp8_e4m3"),
        ("fp8_e5m2", "fp8_e5m2"),
        ("single", "fp32"),
    ],
)
def test_a_format_is_found_by_any_spelling(spelling, fmt):
    assert format_named(spelling) is FORMATS[fmt]


def test_a_name_without_limits_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="use one of fp32, fp16, bf16, fp8-e4m3, fp8-e5m2"):
        format_named("fp64")  # the truth compare measures against; no format limits to judge


def test_the_precision_names_read_every_format_spelling_as_the_formats_do():
    for spelling, name in formats.ALIASES.items():
        assert names.canonical(spelling) == canonical(spelling) == name


def test_each_torch_dtype_maps_to_the_format_its_name_says():
    for dtype, fmt in DTYPE_FORMAT.items():
        found = canonical(dtype)
        assert found is not None and found.replace("-", "_") == fmt
        assert FORMATS[fmt].name == fmt
