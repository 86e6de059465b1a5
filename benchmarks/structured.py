"""Runs pagedllm.benchmarks.structured (also `pagedllm bench structured`) from a source checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from pagedllm.benchmarks.structured import main  # noqa: E402

main()
