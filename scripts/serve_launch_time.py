"""Seconds from launching `pagedllm serve` to its first /health 200 (issue 18's start-up target).

    python scripts/serve_launch_time.py [--runs N] [-- extra `pagedllm serve` arguments]

Each run spawns `python -m pagedllm.entrypoints.cli serve` on 127.0.0.1:8123 (the embedded model
unless a model is given after `--`), polls /health every 50 ms, prints the seconds, and stops the
server. The server's output goes to a temporary log, printed if it exits early; --timeline prints
each of its lines with the seconds since launch at which it had been written (read back every
50 ms while waiting), which shows where start-up goes.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PORT = 8123


def launch_once(serve_args: list[str], timeout_s: float, timeline: bool = False, profile: str | None = None) -> float:
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        seen = 0

        def show_new_lines() -> None:
            nonlocal seen
            if timeline:
                log.seek(seen)
                for line in log.readlines():
                    print(f"  {time.perf_counter() - t0:6.2f}  {line.rstrip()[:160]}")
                seen = log.tell()

        prof = ["-m", "cProfile", "-o", profile] if profile else []
        proc = subprocess.Popen([sys.executable, *prof, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(PORT), *serve_args], stdout=log, stderr=subprocess.STDOUT)
        try:
            while time.perf_counter() - t0 < timeout_s:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read()[-2000:]}")
                show_new_lines()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - t0
                except OSError:
                    time.sleep(0.05)
            raise RuntimeError(f"not healthy within {timeout_s:.0f} s")
        finally:
            proc.send_signal(signal.SIGINT)  # as Ctrl-C: the server shuts down (and cProfile writes its stats)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--timeline", action="store_true", help="print the server's lines as they come, timed")
    p.add_argument("--profile-api", metavar="FILE", help="run the API process under cProfile, its stats written to "
                   "FILE when the server stops (read them with pstats)")
    p.add_argument("serve_args", nargs="*", help="after --: passed to `pagedllm serve`")
    args = p.parse_args()
    times = []
    for _ in range(args.runs):
        times.append(launch_once(args.serve_args, args.timeout_s, args.timeline, args.profile_api))
        print(f"healthy after {times[-1]:.2f} s", flush=True)
    if len(times) > 1:
        print(f"median {statistics.median(times):.2f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
