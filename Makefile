# The README's two commands. Both set up .venv in the checkout when it is missing (or when
# pyproject.toml changed since the last install), so .venv/bin/tileinfer exists after either.
#   make run   the main job: a chat generation with the embedded default model (SmolLM2-135M).
#              When serving lands, this becomes `serve run serve_config.yaml`.
#   make test  lint and the test suite: what CI runs (.ci/run).

PYTHON = python3
VENV = .venv
# Written after a complete install, so an interrupted one is redone and a finished one is not.
INSTALLED = $(VENV)/.installed
PROMPT = Explain in two sentences what a KV cache is.

.PHONY: run test

run: $(INSTALLED)
	$(VENV)/bin/python -m engine.default_model
	$(VENV)/bin/tileinfer generate smollm2-135m --chat --prompt "$(PROMPT)"

test: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

# torch first and pinned: here 2.13.0 is a local CPU build; letting the project's
# `torch>=2.11` pick one would download the CUDA build (gigabytes).
$(INSTALLED): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install torch==2.13.0
	$(VENV)/bin/python -m pip install -e '.[test]'
	touch $(INSTALLED)
