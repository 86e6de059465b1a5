"""Runs pagedllm.benchmarks.long_prompt (also `pagedllm bench long-prompt`) from a source checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from pagedllm.benchmarks.long_prompt import main  # noqa: E402

main()
