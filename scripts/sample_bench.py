"""Time of drawing one token per row on the CPU: the exponential race (the GPU's way) against
the two-level inverse CDF (sample/draw.py), vocabulary 49,152. Usage: PYTHONPATH=src python
scripts/sample_bench.py"""
import time

import torch

from pagedllm.sample.draw import _inverse_cdf, _race


def timed(fn, probs: torch.Tensor, n: int = 20) -> float:
    fn(probs.clone(), {})
    start = time.perf_counter()
    for _ in range(n):
        fn(probs.clone(), {})
    return (time.perf_counter() - start) / n * 1e3


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
for rows in (1, 16, 32, 64, 256):
    probs = torch.softmax(torch.randn(rows, 49152), dim=-1)
    print(f"{rows:4d} rows: race {timed(_race, probs):7.2f} ms   inverse CDF {timed(_inverse_cdf, probs):6.2f} ms")
