# The two set-up commands of the README.
VENV ?= .venv

.PHONY: demo test install

# Install kvflow (CPU torch when there is no GPU) and run the quickstart pipeline.
demo:
	bash scripts/install.sh
	$(VENV)/bin/kvflow run pipelines/quickstart.yaml

# Install the dev and docs extras and run the test suite (which also builds the docs, strict).
test:
	bash scripts/install.sh dev,docs
	$(VENV)/bin/python -m pytest

install:
	bash scripts/install.sh
