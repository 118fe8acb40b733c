# `make demo`: install everything, then generate with the embedded default model.
# `make test`: install everything (if needed), lint, and run the whole test suite (what CI runs).
# `make test-fast`: lint, then every test that needs neither the default model nor a shell's end-to-end run (marked
# `slow`): the core, the kernels and every method's exactness on tiny models.
# Both run in WORKERS pytest-xdist processes, one torch thread each (tests/conftest.py).
VENV := .venv
STAMP := $(VENV)/.installed
WORKERS ?= 2
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo test test-fast lint

$(STAMP): pyproject.toml setup.py scripts/setup.sh $(wildcard src/triedec/model/csrc/* src/triedec/model/csrc/x86/*/*)
	bash scripts/setup.sh
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/triedec generate --max-new-tokens 128 "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts evals

test: lint
	$(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=15

test-fast: lint
	$(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadfile --durations=10 -m "not default_model and not slow"
