# `make demo`: install everything, then generate with the embedded default model.
# `make test`: install everything (if needed), lint, and run the test suite.
VENV := .venv
STAMP := $(VENV)/.installed
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo test lint bench-foundation

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/triedec generate --method pld --max-new-tokens 128 "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

test: lint
	$(VENV)/bin/python -m pytest -q --durations=15
