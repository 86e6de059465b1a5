"""Benchmarks of docs/benchmarks.md's workloads; each module runs as `pagedllm bench NAME`,
`python -m pagedllm.benchmarks.NAME` or `python benchmarks/NAME.py`, one JSON line per result."""
