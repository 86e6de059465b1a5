"""Runs pagedllm.benchmarks.cpu_vs_hf (also `pagedllm bench cpu`) from a source checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from pagedllm.benchmarks.cpu_vs_hf import main  # noqa: E402

main()
