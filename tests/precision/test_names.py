"""One set of precision names everywhere, a "did you mean" for near misses, and MODEL factories
found and documented as users expect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fpdoctor
from fpdoctor.precision.names import CANDIDATES, PLAN_CANDIDATES, autocast_dtype, canonical, check_name
from tests.conftest import ROOT
from tests.precision import factories


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("float16", "fp16"),
        ("half", "fp16"),
        ("torch.float16", "fp16"),
        ("FP16", "fp16"),
        ("bfloat16", "bf16"),
        ("torch.bfloat16", "bf16"),
        ("float32", "fp32"),
        ("float8_e4m3fn", "fp8-e4m3"),
        ("fp8_e4m3_rowwise", "fp8-e4m3-rowwise"),
        ("e5m2", "fp8-e5m2"),
        ("fp16_accumulate", "fp16-accumulate"),
    ],
)
def test_torch_names_and_aliases_are_accepted(spelling, name):
    assert check_name(spelling, CANDIDATES, "candidate") == name == canonical(spelling)


def test_near_misses_get_a_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown candidate 'flaot16'; did you mean fp16\?"):
        check_name("flaot16", CANDIDATES, "candidate")
    with pytest.raises(ValueError, match=r"did you mean bf16\?"):
        check_name("bf61", PLAN_CANDIDATES, "candidate")
    with pytest.raises(ValueError, match="plan keeps modules in fp32, so its candidate must be below fp32"):
        check_name("float32", PLAN_CANDIDATES, "candidate")


def test_the_python_api_takes_the_same_names():
    model, x = factories.mixed_params()
    model.float()
    assert fpdoctor.compare(model, x, candidate="torch.bfloat16").report.data["summary"][0][1].startswith("bf16 /")
    assert autocast_dtype("half") == "float16" and autocast_dtype("bf16") == "bfloat16"


def test_cli_candidate_names_and_did_you_mean(cli):
    spec = "tests.precision.factories:mixed_params"
    result = cli("compare", spec, "--candidate", "flaot16")
    assert result.code == 2 and "did you mean fp16?" in result.err and len(result.err.strip().splitlines()) == 1
    result = cli("plan", spec, "--candidate", "half", "--format", "json")
    assert result.code == 1, result.err  # the mixed model does not run as given: an error, said first
    assert factories.loads_strict(result.out)["data"]["plan"]["candidate"] == "fp16"


def test_a_factory_module_in_the_current_directory_is_found(tmp_path):
    (tmp_path / "bert_factory.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)), "
        "torch.randn(4, 8)\n"
    )
    # as the console script runs it: -P keeps the current directory off sys.path, unlike `python -m`
    code = "import sys; from fpdoctor.cli.main import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code, "compare", "bert_factory:make", "--candidate", "bf16", "--format", "json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr  # before: "No module named 'bert_factory'"
    assert factories.loads_strict(proc.stdout)["verdict"] == "ok"


@pytest.mark.parametrize("command", ["compare", "plan", "audit"])
def test_help_documents_the_factory_contract(command, capsys):
    from fpdoctor.cli.main import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for words in ("def make():", "a tuple: model(ids, mask)", "a dict: model(**inputs)", "several input sets"):
        assert words in out, words


def test_the_docs_document_the_factory_contract():
    compare = (ROOT / "docs" / "commands" / "compare.md").read_text()
    section = compare.split("## The MODEL argument")[1].split("\n## ")[0]
    for words in ("def make():", "several input sets"):
        assert words in section, words
    plan = (ROOT / "docs" / "commands" / "plan.md").read_text()
    for words in ("fpdoctor plan", "input rounding floor", "compare.md#the-model-argument"):
        assert words in plan, words


def test_each_precision_is_one_declared_entry_every_step_reads():
    """A precision's copy, its dtype, its fp8 layer, its rounding and its storage format all come
    from its PRECISIONS entry, for every candidate."""
    import torch
    from torch import nn

    from fpdoctor.precision.candidates import Fp8Linear, Fp16AccumulateLinear, compute_dtype, make_run
    from fpdoctor.precision.fit import candidate_format
    from fpdoctor.precision.metrics import round_to
    from fpdoctor.precision.names import PRECISIONS
    from fpdoctor.precision.plan.codegen import plan_code

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    # fp32 holds these exactly, fp16, bf16 and fp8 do not
    x = (1 + torch.arange(1, 65, dtype=torch.float64) * 2.0**-20).reshape(8, 8)
    for name in CANDIDATES:
        entry = PRECISIONS[name]
        run = make_run(model, name, "fake", torch.device("cpu"))
        assert run[0].weight.dtype == compute_dtype(name) == getattr(torch, entry.dtype), name
        assert isinstance(run[0], Fp8Linear) == (entry.fp8 is not None), name
        assert isinstance(run[0], Fp16AccumulateLinear) == entry.accumulate, name
        if entry.fp8 is not None:
            assert run[0].rowwise == entry.rowwise, name
        assert (candidate_format(name) is None) == (entry.storage is None), name
        rounded = round_to(x, name)
        assert rounded.dtype == torch.float64 and (torch.equal(rounded, x) == (name in ("fp32", "compiled"))), name
        if entry.applies:
            assert f"model.to(torch.{entry.dtype})" in plan_code(name, [], [])
    assert model[0].weight.dtype == torch.float32  # copies only
