"""The peak memory a measured run uses, polled from outside it: `regen pilot` records it per candidate.

On the CPU it is the RSS of the run's process tree (its workers and CPU engines); on GPUs each visible device's
used memory, by nvidia-smi, since the engine's CUDA context lives in vLLM's engine-core process, not in one the
pilot can ask.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading

MEMORY_POLL_S = 0.5


def memory_kind(gpus: list[str] | None) -> str:
    """What a candidate's peak memory is, as its table row says."""
    return "one GPU, nvidia-smi" if gpus else "host RSS"


class PeakMemory:
    """Polls the memory a candidate's run uses and keeps the peak: on the CPU the RSS of the run's process
    tree (its workers and CPU engines), on GPUs each visible device's used memory (nvidia-smi)."""

    def __init__(self, pid: int, gpus: list[str] | None):
        self.pid, self.gpus = pid, gpus
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    @property
    def what(self) -> str:
        return memory_kind(self.gpus)

    def _sample(self) -> int:
        if self.gpus:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout
            used = [int(v) for i, v in (line.split(",") for line in out.strip().splitlines())
                    if i.strip() in self.gpus]
            return max(used, default=0) << 20
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total

    def _poll(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                self.peak = max(self.peak, self._sample())
            self.stop.wait(MEMORY_POLL_S)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
