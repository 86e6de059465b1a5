"""A worker's torch.profiler session (vLLM's ``LLM.start_profile()`` / ``stop_profile()``).

Every worker profiles its own process (host ops and, on a GPU, kernels) between the two calls
and writes, under ``PAGEDLLM_TORCH_PROFILER_DIR``, ``rank{N}.trace.json`` (open it in Perfetto
or chrome://tracing) and ``rank{N}.txt``: the wall time of the session, the device's busy time
(kernels and copies added up), the ops sorted by their own device time (host time on CPU) and,
on a GPU, by host time (with the serving loop's phases: waiting for the engine, launching a step,
answering the one before).
"""
from __future__ import annotations

import os
import time

import torch

from pagedllm import envs
from pagedllm.utils import check_profiling_on


class WorkerProfiler:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._profile: torch.profiler.profile | None = None
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        check_profiling_on()
        if self._profile is not None:
            return  # already running (a second start, e.g. from another client of the server, keeps it)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._started = time.perf_counter()

    def stop(self) -> str | None:
        """Ends the session; returns the path of this rank's summary (None: no session was running).
        Neither call raises on a worker once profiling is on: a failing call would stop the engine."""
        if self._profile is None:
            return None
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
        wall_s = time.perf_counter() - self._started
        profile, self._profile = self._profile, None
        profile.stop()
        out_dir = envs.PAGEDLLM_TORCH_PROFILER_DIR
        os.makedirs(out_dir, exist_ok=True)
        profile.export_chrome_trace(os.path.join(out_dir, f"rank{self.rank}.trace.json"))
        averages = profile.key_averages()
        key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        # The device's own events (kernels, copies): the ops that launched them carry the same time again.
        busy_s = sum(e.self_device_time_total for e in averages
                     if e.device_type != torch.autograd.DeviceType.CPU) / 1e6 if on_gpu else 0.0
        head = f"rank {self.rank}: {wall_s:.4f} s wall"
        if busy_s:
            head += f", device busy {busy_s:.4f} s ({busy_s / wall_s:.1%})"
        path = os.path.join(out_dir, f"rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(head + "\n" + averages.table(sort_by=key, row_limit=40, max_name_column_width=70) + "\n")
            if on_gpu:  # the host's side: the serving loop's phases and the ops that launch the kernels
                f.write("by host time\n" + averages.table(sort_by="cpu_time_total", row_limit=20,
                                                           max_name_column_width=70) + "\n")
        return path
