"""Runs pagedllm.benchmarks.shared_prefix (also `pagedllm bench shared-prefix`) from a source checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from pagedllm.benchmarks.shared_prefix import main  # noqa: E402

main()
