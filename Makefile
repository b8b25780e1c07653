# The README's two commands. Both set up .venv in the checkout when it is missing (or when
# pyproject.toml changed since the last install), so .venv/bin/tileinfer exists after either.
#   make run   the main job: serve the embedded default model (SmolLM2-135M) with
#              `serve run serve_config.yaml`, an OpenAI-compatible API on http://127.0.0.1:8000.
#   make test  lint and the test suite: what CI runs (.ci/run).

PYTHON = python3
VENV = .venv
# Written after a complete install, so an interrupted one is redone and a finished one is not.
INSTALLED = $(VENV)/.installed
# Ray on this machine's loopback address only (the env var makes Ray take 127.0.0.1 as the node's IP).
# gRPC's fork handlers off: the Ray Client proxy forks a server per connection, and with them on the
# child once segfaulted in gRPC's event engine before exec.
RAY_ENV = RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GRPC_ENABLE_FORK_SUPPORT=0

.PHONY: run test

run: $(INSTALLED)
	$(VENV)/bin/python -m engine.default_model
	$(RAY_ENV) $(VENV)/bin/ray start --head --node-ip-address=127.0.0.1 --disable-usage-stats \
		|| echo "ray start failed: serving on the Ray cluster already running here"
	trap '$(VENV)/bin/ray stop' EXIT; $(RAY_ENV) $(VENV)/bin/serve run serve_config.yaml

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
