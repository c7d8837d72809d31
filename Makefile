# The two set-up commands of the README.
VENV ?= .venv

.PHONY: demo test test-fast install

# Install kvflow (CPU torch when there is no GPU) and run the quickstart pipeline.
demo:
	bash scripts/install.sh
	$(VENV)/bin/kvflow run pipelines/quickstart.yaml

# The separately installable example plugin distributions (each its own pyproject, entry point
# and tests), installed editable like any third-party plugin; --no-build-isolation uses the
# hatchling of the dev extra (offline-safe), --no-deps keeps the editable kvflow.
EXAMPLE_PLUGINS := $(sort $(wildcard plugins/kvflow-example-*))

# Install the dev, docs, ray and serve extras, SGLang, vLLM's own environment (.venv-vllm) and the example
# plugins, then run the test suite (which also builds the docs, strict, and runs the example plugins'
# tests: see pyproject testpaths).
TEST_WORKERS ?= 2
test:
	bash scripts/install.sh dev,docs,sglang,ray,serve,vllm
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
		$(addprefix -e ,$(EXAMPLE_PLUGINS))
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The quick tier, for work in progress (in the environment `make test` installed): every module
# at unit level, without the tests that start SGLang engines, a Ray cluster, a browser or runs
# on real checkpoints, or build the docs (tests/conftest.py says which: the `slow` marker).
test-fast:
	$(VENV)/bin/python -m pytest -m "not slow"

install:
	bash scripts/install.sh
