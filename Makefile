# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs setup clean browser corpus prepare-h200 h200-ladder bytecode

# One resolver pass: torch pinned to the CPU build's version (the machine's wheel, +cpu, is the
# newest of that version), so nothing pulls a multi-GB CUDA wheel; the venv's own pip does it.
# pip compiles the installed packages' bytecode one file at a time (about 45 s here); compileall
# does the same files on every core (the same .pyc files; a file that does not compile, such as
# torch's Python 3.12 syntax test module, is skipped as pip skips it). The packages' own test suites
# (a sixth of the files) are left out: nothing here imports them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile "torch==$${TORCH_VERSION:-2.13.0}" -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 -x '/tests?/|/testing/_internal/' "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	touch $(STAMP)

setup: $(STAMP)

# The project's own modules compiled once (the installed packages were at install): every CLI, rank
# and Ray worker process imports them, and where PYTHONDONTWRITEBYTECODE is set no process writes
# the bytecode it compiles, so each would compile the project again (about 0.3 s of CPU a process).
# Only changed files are compiled again.
SOURCES := core engines ladder analysis bench tests experiments
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $(SOURCES) >/dev/null

demo: $(STAMP) bytecode
	$(BIN)/ladder demo experiments/proxy_cpu.py --out report

# The offline corpus (engines/corpus.py): installed packages' Python, prose and C/C++/CUDA, deduplicated,
# as jsonl under $$MOE_LADDER_CORPUS (default ~/.cache/moe-ladder/corpus), with token counts under
# the H200 ladder's tokenizer. Runs on a bare machine's python3 too: python3 -m engines.corpus build ...
CORPUS ?= $(or $(MOE_LADDER_CORPUS),$(HOME)/.cache/moe-ladder/corpus)
corpus:
	$(or $(wildcard $(BIN)/python),$(PY)) -m engines.corpus build --out $(CORPUS) --tokenizer experiments/tokenizers/h200-16k.json

# Tokenize the H200 ladder's sources into shards once (`make corpus` first).
prepare-h200: $(STAMP)
	MOE_LADDER_CORPUS=$(CORPUS) $(BIN)/ladder data prepare experiments/proxy_h200.py

# The H200 ladder end to end on one H200 (about 12 GPU-minutes of training; the corpus and its
# shards first): rungs, forecast, hero, compare, report. Phases: bash experiments/h200_ladder.sh help
h200-ladder: $(STAMP)
	MOE_LADDER_CORPUS=$(CORPUS) bash experiments/h200_ladder.sh all

# The report test drives Debian's chromium through chromedriver (no browser download).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { echo "installing Debian's chromium and chromium-driver for the report test"; \
	    s=""; [ "$$(id -u)" = 0 ] || s="sudo -n"; \
	    { $$s apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$s apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	    echo "warning: could not install chromium; tests/analysis/test_report_browser.py will fail"; }

# The suite on four pytest-xdist workers, a test file to a worker (its module fixtures, such as one
# local Ray, stay in one process), the longest files first (tests/conftest.py: LONGEST_FIRST; xdist's
# own reorder by test count is off). The two-node Ray Train cluster file goes first, so it starts in
# a worker process of its own: after the rest of the suite in one process, Ray Train's controller
# actor of its second job was once dropped before it started (ActorDiedError); alone it passes.
# Four workers on the two cores: many files wait (Ray and tracking servers starting, runs polled,
# subprocesses); with three the cores were busy about 150% of the run, with four about 199%, and
# six were slower (871 s of pytest against 814 s: Ray's daemons, uncounted by time(1), fill the rest).
# --durations keeps the slowest tests in CI's output. pytest's exit 5 (no tests collected) fails
# the target like any other failure.
# The browser's apt install runs beside pip's (pip keeps about one core busy; apt mostly waits).
TEST_WORKERS ?= 4
test:
	$(MAKE) --no-print-directory -j 2 setup bytecode browser
	rc=0; $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 || rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (exit 5)" >&2; fi; exit $$rc

# The documentation site (mkdocs.yml) into site/; the CLI reference is generated from the typer app.
# `$(BIN)/mkdocs serve` serves it at http://127.0.0.1:8000 while you edit.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .ladder report report-h200 site
