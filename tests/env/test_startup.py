"""What runs before the first line: a sitecustomize that registers a torch.library op and
overrides aten::exp's CPU kernel is in `env`'s facts, in its report, and in `env --diff`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fpdoctor.env.diff import diff_env
from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.sources import startup
from tests.env.strict import strict_json

SITECUSTOMIZE = """\
import torch

_defs = torch.library.Library("nodeops", "DEF")
_defs.define("scale(Tensor x) -> Tensor")
_defs.impl("scale", lambda x: x * 2, "CPU")
_over = torch.library.Library("aten", "IMPL")  # line 6: torch.library records where a Library was made
_over.impl("exp", lambda x: x + 1, "CPU")  # aten::exp's CPU kernel, replaced
"""


def _env(tmp_path: Path, name: str, site: Path | None) -> dict:
    """`fpdoctor env --save-facts` in a fresh process, with `site` (a sitecustomize) on PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        environ["PYTHONPATH"] = str(site)
    saved = tmp_path / f"{name}.json"
    argv = ["env", "--no-probe", "--format", "json", "--save-facts", str(saved)]
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "fpdoctor", *argv],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return {"report": strict_json(proc.stdout), "facts": saved}


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("startup")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    return {"node": _env(root, "node", site), "workstation": _env(root, "workstation", None), "site": site}


def test_the_facts_list_what_the_sitecustomize_registered(machines):
    facts = json.loads(machines["node"]["facts"].read_text())
    path = str(machines["site"] / "sitecustomize.py")
    found = {(r["op"], r["kind"], r["key"]) for r in facts["torch"]["registrations"]}
    assert found == {
        ("aten::exp", "overrides", "CPU"),
        ("nodeops::scale", "defines", None),
        ("nodeops::scale", "adds", "CPU"),
    }
    exp = next(r for r in facts["torch"]["registrations"] if r["op"] == "aten::exp")
    assert (exp["file"], exp["line"], exp["module"]) == (path, 6, "sitecustomize")
    customize = {m["module"]: m for m in facts["startup"]["customize"]}
    assert customize["sitecustomize"]["path"] == path and customize["sitecustomize"]["loaded"] is True
    assert facts["env"]["PYTHONPATH"] == str(machines["site"])


def test_the_report_warns_and_says_where(machines):
    report = machines["node"]["report"]
    warned = [f for f in report["findings"] if f["name"] == "op-overridden-at-startup"]
    assert len(warned) == 1 and warned[0]["severity"] == "warning" and warned[0]["code"] == "ENV007"
    assert "aten::exp" in warned[0]["message"] and "sitecustomize" in warned[0]["message"]
    summary = dict(report["data"]["summary"])
    assert "aten::exp: CPU kernel overridden by sitecustomize" in summary["ops registered at start-up"]
    assert "nodeops::scale defined by sitecustomize" in summary["ops registered at start-up"]


def test_a_machine_without_start_up_code_registers_nothing(machines):
    facts = json.loads(machines["workstation"]["facts"].read_text())
    assert facts["torch"]["registrations"] == []
    assert "sitecustomize" not in {m["module"] for m in facts["startup"]["customize"] if m["loaded"]}
    summary = dict(machines["workstation"]["report"]["data"]["summary"])
    assert summary["ops registered at start-up"].startswith("none")
    assert not any(f["name"] == "op-overridden-at-startup" for f in machines["workstation"]["report"]["findings"])


def test_diff_names_the_start_up_code_and_why_it_changes_numbers(machines):
    report = diff_env(str(machines["workstation"]["facts"]), str(machines["node"]["facts"]))
    by_fact = {f.evidence["key"]: f for f in report.findings if f.name == "startup-differs"}
    ops = by_fact["startup.torch_ops"]
    assert ops.severity.value == "error" and ops.evidence["a"] == "none"
    assert ops.evidence["b"] == "aten::exp: CPU kernel overridden by sitecustomize"
    assert "instead of torch's" in ops.message  # why it changes numbers
    assert by_fact["startup.new_ops"].evidence["b"] == "nodeops::scale defined by sitecustomize"
    assert by_fact["startup.sitecustomize"].evidence["a"] == "none"
    variables = {f.evidence["key"] for f in report.findings if f.name == "math-variable-differs"}
    assert "env.PYTHONPATH" in variables
    assert report.exit_code == 1
    summary = dict(report.data["summary"])
    assert not summary["differences that can change a result or crash"].startswith("0")


def test_the_same_machine_twice_differs_in_nothing():
    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "env" / "rules" / "ENV307-startup-differs.b.json"
    report = diff_env(str(fixture), str(fixture))
    assert report.findings == [] and report.data["differences"] == []


def test_pth_files_that_run_code_are_told_apart(tmp_path):
    (tmp_path / "paths.pth").write_text("/opt/extra\n# a comment\n", encoding="utf-8")
    (tmp_path / "hook.pth").write_text("import os; os.environ['TORCH_ALLOW_TF32_CUBLAS_OVERRIDE'] = '1'\n")
    (tmp_path / "not-a-pth.txt").write_text("import os\n")
    found = {Path(p["path"]).name: p for p in startup.pth_files([str(tmp_path)])}
    assert set(found) == {"paths.pth", "hook.pth"}
    assert found["paths.pth"]["executes"] is False and found["paths.pth"]["paths"] == 1
    assert found["hook.pth"]["executes"] is True
    assert found["hook.pth"]["code"] == ["import os; os.environ['TORCH_ALLOW_TF32_CUBLAS_OVERRIDE'] = '1'"]
    assert len(found["hook.pth"]["sha256"]) == 12


def test_preloaded_libraries_come_from_ld_preload():
    found = startup.preloaded({"LD_PRELOAD": "/opt/libfastm.so:/opt/libprof.so"})
    assert [p for p in found if p["source"] == "LD_PRELOAD"] == [
        {"path": "/opt/libfastm.so", "source": "LD_PRELOAD"},
        {"path": "/opt/libprof.so", "source": "LD_PRELOAD"},
    ]


def test_a_start_up_fact_of_the_wrong_shape_is_refused_in_one_line(tmp_path, cli):
    fixture = (
        Path(__file__).resolve().parent.parent / "fixtures" / "env" / "rules" / "ENV007-op-overridden-at-startup.json"
    )
    facts = json.loads(fixture.read_text())
    facts["torch"]["registrations"][0]["line"] = "seven"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(facts))
    result = cli("env", "--from", str(bad))
    assert result.code == 2 and "torch.registrations[0].line" in result.err and len(result.err.splitlines()) == 1


def test_the_dispatcher_names_say_where_an_op_was_registered():
    import torch

    from fpdoctor import torchprivate as tp

    lib = torch.library.Library("fpdoctorstartup", "DEF")
    lib.define("twice(Tensor x) -> Tensor")  # the Library was made one line up
    lib.impl("twice", lambda x: x * 2, "CPU")
    assert "fpdoctorstartup::twice" in tp.dispatcher_ops()
    assert tp.defined_at("fpdoctorstartup::twice") == (__file__, lib_line(lib))
    rows = tp.registrations("fpdoctorstartup::twice")
    assert ("CPU", __file__, lib_line(lib), True) in rows
    assert tp.registrations("fpdoctorstartup::nothing") == [] and tp.defined_at("fpdoctorstartup::nothing") is None
    torch_own = tp.registrations("aten::exp")
    assert torch_own and all(not file.startswith(str(Path(__file__).parent)) for _, file, _, _ in torch_own)


def lib_line(lib) -> int:
    """The line torch.library recorded for `lib`: the one that made it."""
    import inspect

    source, start = inspect.getsourcelines(test_the_dispatcher_names_say_where_an_op_was_registered)
    return start + next(i for i, line in enumerate(source) if 'Library("fpdoctorstartup"' in line)


def test_the_text_report_of_saved_facts_shows_the_hooks():
    fixture = (
        Path(__file__).resolve().parent.parent / "fixtures" / "env" / "rules" / "ENV007-op-overridden-at-startup.json"
    )
    report = diagnose_env(from_file=str(fixture))
    text = str(report)
    assert "ops registered at start-up" in text and "sitecustomize" in text and ".pth files" in text


def test_an_op_made_with_custom_op_at_start_up_is_listed(tmp_path):
    """custom_op makes its Library inside torch: the op's function says whose it is."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n\n@torch.library.custom_op('nodeops::clip', mutates_args=())\n"
        "def clip(x: torch.Tensor) -> torch.Tensor:\n    return x.clamp(-1, 1)\n",
        encoding="utf-8",
    )
    code = (
        "import json, runpy, sys\nsys.argv = ['x']\n"
        f"child = runpy.run_path({str(Path(startup.__file__).with_name('torch_child.py'))!r})\n"
        "print('REG ' + json.dumps(child['startup_registrations']()))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=300,
        check=False,
    )
    found = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("REG "))[4:])
    assert {"op": "nodeops::clip", "kind": "defines", "key": None, "file": str(site / "sitecustomize.py"),
            "line": 3, "module": "sitecustomize"} in found  # fmt: skip
