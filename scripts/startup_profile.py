"""Where a warm offline LLM() spends its time: cProfile of the imports and of LLM() (issue 19).

python scripts/startup_profile.py [--shape llama3-8b] [--top 40]

Run it after one start-up has warmed Triton's cache and the kept compile jobs. It prints the
wall-clock split (imports, LLM(), first token), then the functions with the most cumulative
time inside LLM(), and pagedllm's own functions by time spent in them. cProfile slows
Python-heavy code, so read it for where time goes, not for the totals.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()

if __name__ == "__main__":
    import argparse
    import cProfile
    import io
    import pstats

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--max-model-len", type=int, default=None)
    args = p.parse_args()

    prof_import = cProfile.Profile()
    prof_import.enable()
    import torch

    from pagedllm import LLM, SamplingParams, TokensPrompt
    prof_import.disable()
    t_imported = time.perf_counter()
    from pagedllm.benchmarks.common import write_shape

    folder = write_shape(args.shape)
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    prof.enable()
    llm = LLM(folder, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len)
    prof.disable()
    t2 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 17)))],
                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False), use_tqdm=False)
    t3 = time.perf_counter()
    print(f"imports {t_imported - _T0:.2f} s, LLM() {t2 - t1:.2f} s, first token {t3 - t2:.2f} s "
          f"(torch {torch.__version__}, cProfile on)")

    def show(profile: cProfile.Profile, sort: str, top: int, pattern: str = "") -> None:
        s = io.StringIO()
        stats = pstats.Stats(profile, stream=s)
        stats.sort_stats(sort).print_stats(pattern, top) if pattern else stats.sort_stats(sort).print_stats(top)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        for ln in lines[start:]:
            print(ln[:190])

    print("== LLM(), cumulative")
    show(prof, "cumulative", args.top)
    print("== LLM(), own time")
    show(prof, "tottime", 25)
    print("== imports, cumulative (pagedllm modules)")
    show(prof_import, "cumulative", 25, "pagedllm")
