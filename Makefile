# The README's two commands. Both set up .venv in the checkout when it is missing (or when
# pyproject.toml changed since the last install), so .venv/bin/tileinfer exists after either.
#   make run   the main job: serve the embedded default model (SmolLM2-135M) with
#              `serve run serve_config.yaml`, an OpenAI-compatible API on http://127.0.0.1:8000.
#   make test  lint, the layers' import contract (pyproject.toml) and the test suite: what CI runs (.ci/run).
#   make run SERVE_PROXY=1  the same behind Serve's Python proxy, not its HAProxy mode (README, Scaling out).

PYTHON = python3
VENV = .venv
# Written after a complete install, so an interrupted one is redone and a finished one is not.
INSTALLED = $(VENV)/.installed
.PHONY: run test

# deployments/launch/launcher.py: Ray's head on 127.0.0.1 only, in Serve's HAProxy mode where ray[serve] brought
# HAProxy, then `serve run serve_config.yaml`; Ctrl-C (or a SIGTERM to it) stops the app, then the Ray it
# started.
run: $(INSTALLED)
	$(VENV)/bin/python -m tileinfer.engine.models.default_model
	exec $(VENV)/bin/python -m tileinfer.deployments.launch.launcher serve_config.yaml $(if $(SERVE_PROXY),--serve-proxy)

# The tests that start a Ray cluster (marked serial, tests/conftest.py) run alone after the rest, which
# run in TEST_WORKERS processes (pytest-xdist): the suite's tests each hold one core.
TEST_WORKERS ?= 2
test: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) -m "not serial"
	$(VENV)/bin/pytest -q -m serial

# torch first and pinned: here 2.13.0 is a local CPU build; letting the project's
# `torch>=2.11` pick one would download the CUDA build (gigabytes).
$(INSTALLED): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install torch==2.13.0
	$(VENV)/bin/python -m pip install -e '.[test]'
	touch $(INSTALLED)
