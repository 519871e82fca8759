# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test env setup

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]' -e examples/adapter-plain -e plugins/openai
	touch $@

setup: $(BIN)/.installed

# The reference adapter's isolated environment (a virtualenv in llmadapt's state folder).
env: setup
	$(BIN)/llmadapt env create torch
	$(BIN)/llmadapt env create plain

demo: env
	$(BIN)/llmadapt compare examples/tiny-llama.toml --adapters torch \
		--matrix optimizations.recompute=none,full --matrix parallelism.dp=1,2

test: env
	$(BIN)/python -m pytest -q -ra
