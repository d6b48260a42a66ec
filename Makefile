# One entry point per habit. `make demo` and `make test` work on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
TSTAMP  := $(VENV)/.installed-test
BSTAMP  := $(VENV)/.installed-bench
DEMO    := data/models/demo
SYNTH   := .cache/synth-demo
MODEL   ?= $(if $(wildcard $(DEMO)/config.json),$(DEMO),$(SYNTH))
PROMPT  ?= def fibonacci(n):
MAXTOK  ?= 48
# Test workers: one a core, 2 to 8 (tests wait on engine subprocesses half the time).
JOBS    ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$((n < 2 ? 2 : n > 8 ? 8 : n)))

.PHONY: demo test test-slow lint format bench clean browser

$(PYTHON):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PYTHON)
	$(BIN)/pip install -q -e .
	touch $@

$(TSTAMP): pyproject.toml | $(PYTHON)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP) $@

$(SYNTH)/config.json: | $(STAMP)
	$(BIN)/colibri synth --family qwen3_moe --layers 4 --experts 16 --top-k 4 --hidden 128 \
		--moe-ff 64 --vocab 512 --seed 0 --out $(SYNTH)

# The peers benchmark: the test extra (transformers) and the bench extra (llama-cpp-python,
# compiled from source on first install: the library alone, ~10 minutes on 2 cores).
# Results in experiments/results/.
# On CPUs with AMX, ggml's AMX int8 path (q8_0, q4_0 matrices) dies of SIGILL at its first tile
# instruction in a worker thread (Xeon model 207 under KVM; ggml-org/llama.cpp#26954): x86 builds
# leave it out, and a library built with it (an older venv) is rebuilt without it.
LLAMA_CMAKE := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF \
	$(if $(filter x86_64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)
LLAMA_ENV := CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc)
$(BSTAMP): pyproject.toml Makefile | $(PYTHON)
	$(LLAMA_ENV) $(BIN)/pip install -q -e '.[test,bench]'
	$(PYTHON) -c 'import sys, llama_cpp; sys.exit(b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())' || \
		$(LLAMA_ENV) $(BIN)/pip install -q --no-cache-dir --force-reinstall --no-deps \
		"llama-cpp-python==$$($(PYTHON) -c 'import llama_cpp; print(llama_cpp.__version__)')"
	touch $(STAMP) $(TSTAMP) $@

bench: $(BSTAMP)
	$(PYTHON) experiments/bench_peers.py

demo: $(STAMP) $(if $(wildcard $(DEMO)/config.json),,$(SYNTH)/config.json)
	$(BIN)/colibri generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens $(MAXTOK)

# The page test drives the system Chromium (Playwright, no browser download): installed here
# with apt-get when missing and run as root; otherwise that test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	echo "no chromium: the page test is skipped"

test: $(TSTAMP) browser
	$(BIN)/pytest -q -n $(JOBS)

test-slow: $(TSTAMP)
	$(BIN)/pytest -q -m slow

lint: $(TSTAMP)
	$(BIN)/ruff check colibri tests experiments
	$(BIN)/ruff format --check colibri tests experiments

format: $(TSTAMP)
	$(BIN)/ruff format colibri tests experiments
	$(BIN)/ruff check --fix colibri tests experiments

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Notebooks are committed without outputs: run this before `git add notebooks/`.
.PHONY: strip-notebooks
strip-notebooks: $(TSTAMP)
	$(PYTHON) -c 'import sys, nbformat; nbs = {p: nbformat.read(p, 4) for p in sys.argv[1:]}; \
	[nb.metadata.pop("widgets", 0) for nb in nbs.values()]; \
	code = [c for nb in nbs.values() for c in nb.cells if c.cell_type == "code"]; \
	[c.update(outputs=[], execution_count=None) or c.metadata.pop("execution", 0) for c in code]; \
	[nbformat.write(nb, p) for p, nb in nbs.items()]' notebooks/*.ipynb
