"""A small in-process stack sampler (no extra packages, no ptrace): a thread snapshots the main
thread's Python stack every ``interval`` seconds; ``report`` aggregates the samples of a time
window by self frame and by inclusive function.

    s = HostSampler(); s.start(); ...; s.stop(); s.report(t_from, t_to)
"""
from __future__ import annotations

import collections
import sys
import threading
import time


class HostSampler:
    def __init__(self, interval: float = 0.0005) -> None:
        self.interval = interval
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self.t0 = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self._main)
            stack = []
            while frame is not None and len(stack) < 40:
                code = frame.f_code
                stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            self.samples.append((time.perf_counter() - self.t0, tuple(stack)))
            time.sleep(self.interval)

    def start(self) -> "HostSampler":
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, t_from: float, t_to: float, title: str, top: int = 14) -> None:
        picked = [s for t, s in self.samples if t_from <= t < t_to and s]
        if not picked:
            print(f"-- {title}: no samples")
            return
        leaf = collections.Counter(s[0] for s in picked)
        incl = collections.Counter()
        for s in picked:
            for f in set(":".join(x.split(":")[:2]) for x in s):
                incl[f] += 1
        n = len(picked)
        print(f"-- {title}: {n} samples over {t_to - t_from:.2f} s")
        print("   self: " + "; ".join(f"{100 * c / n:.0f}% {k}" for k, c in leaf.most_common(top)))
        print("   incl: " + "; ".join(f"{100 * c / n:.0f}% {k}" for k, c in incl.most_common(top + 10)))
