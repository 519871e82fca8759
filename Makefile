# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Adapter packages installed next to the core, and the environments their workers run in.
PLUGINS := examples/adapter-plain plugins/openai plugins/tgi plugins/megatron plugins/deepspeed
ENVS    := torch plain megatron deepspeed

.PHONY: demo test envs setup

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]' $(addprefix -e ,$(PLUGINS))
	touch $@

setup: $(BIN)/.installed

# Each adapter's isolated environment: a pinned virtualenv in llmadapt's state folder.
envs: setup
	for env in $(ENVS); do $(BIN)/llmadapt env create $$env || exit 1; done

demo: setup
	$(BIN)/llmadapt env create torch
	$(BIN)/llmadapt compare examples/tiny-llama.toml --adapters torch \
		--matrix optimizations.recompute=none,full --matrix parallelism.dp=1,2

test: envs
	$(BIN)/python -m pytest -q -ra
