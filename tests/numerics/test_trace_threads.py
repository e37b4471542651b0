"""`fpdoctor trace` on a script that trains in worker threads: torch records a thread's ops in that
thread only, so the trace sees none of them, while torch's optimizer hooks fire in every thread. A
step it never saw the forward and backward of is not judged (an update that made a weight NaN there
was printed as "lower the learning rate", the cause unseen): the report says which threads trained
and how to check them, and its verdict is "not checked", never OK."""

from __future__ import annotations

import json

from tests.conftest import run_fpdoctor
from tests.integrations.test_watch_threads import SCRIPT


def test_training_in_threads_the_trace_does_not_record_is_named_and_not_judged(tmp_path):
    script = tmp_path / "service.py"
    # the main thread's own set-up ops (the data, a warm-up) are no training: the verdict is still "not checked"
    warm_up = "torch.set_num_threads(1)\nwarm = (torch.randn(64, 64) @ torch.randn(64, 64)).tanh().sum()\n"
    script.write_text(SCRIPT.replace("torch.set_num_threads(1)\n", warm_up, 1))
    report_path = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report_path), "--", str(script), timeout=300)
    assert result.code == 0, result.err
    report = json.loads(report_path.read_text())
    assert report["data"]["status"] == "not checked", report["data"]
    assert not report["findings"], [(f["code"], f["title"]) for f in report["findings"]]
    skipped = report["data"]["not_checked"]
    assert "200 optimizer step(s)" in skipped["training in thread 'Thread-1 (clicks)'"], skipped
    assert "600 optimizer step(s)" in skipped["training in thread 'Thread-2 (demand)'"], skipped
