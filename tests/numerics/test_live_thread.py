"""A finding's live line says the thread it was decided in, where that is not the main thread: two
models trained in two threads, a Sentinel each, print lines that must say whose they are."""

from __future__ import annotations

import threading

from fpdoctor import catalog
from fpdoctor.numerics.training.live import line_of


def test_a_line_said_in_a_worker_thread_names_it_and_the_main_thread_is_not_named():
    finding = catalog.make("nonfinite-loss", message="the loss was NaN", evidence={"step": 66})
    said: list[str] = []
    worker = threading.Thread(target=lambda: said.append(line_of(finding)), name="ctr")
    worker.start()
    worker.join()
    assert said == [f"fpdoctor: thread 'ctr' step 66: {finding.code} nonfinite-loss (error) \u2014 {finding.title}"]
    assert line_of(finding).startswith(f"fpdoctor: step 66: {finding.code}")
