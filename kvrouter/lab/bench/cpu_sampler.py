"""A CPU-time sampling profiler for a router process: ``python -m kvrouter.lab.bench.cpu_sampler OUT
ARGS...`` runs ``kvrouter ARGS...`` and, when it exits, writes its samples to OUT as collapsed stacks
(``frame;frame;... count``, root first, each frame ``function (path:line)``: py-spy's raw format).

Sampling runs while the process is told to (SIGUSR1 starts or resumes it, SIGUSR2 pauses it): a
benchmark samples its measured phases only, not start-up or warm-up.  Samples are taken every
``interval`` of the process's CPU time (``ITIMER_PROF``: user and system time, every thread's, at the
kernel's tick), so a thread waiting for a core (preempted inside a socket write on a busy machine) takes
no samples, unlike a wall-clock sampler such as py-spy.  The signal is handled in the main thread at its
next bytecode: time inside a C call (a socket write, a tokenizer's encode) lands on the Python line that
made it.
"""

from __future__ import annotations

import collections
import signal
import sys
from types import CodeType, FrameType


class CpuSampler:
    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.stacks: collections.Counter[tuple[tuple[CodeType, int], ...]] = collections.Counter()

    def start(self) -> None:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def on_signals(self) -> None:
        """SIGUSR1 starts (or resumes) sampling, SIGUSR2 pauses it."""
        signal.signal(signal.SIGUSR1, lambda *_: self.start())
        signal.signal(signal.SIGUSR2, lambda *_: self.stop())

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_IGN)

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        stack = []
        while frame is not None:
            stack.append((frame.f_code, frame.f_lineno))
            frame = frame.f_back
        self.stacks[tuple(stack)] += 1

    def collapsed(self) -> str:
        lines = []
        for stack, n in self.stacks.items():
            frames = [f"{c.co_qualname} ({c.co_filename}:{line})" for c, line in reversed(stack)]
            lines.append(f"{';'.join(frames)} {n}")
        return "\n".join(lines) + "\n"


def main() -> int:
    out, args = sys.argv[1], sys.argv[2:]
    from kvrouter.cli import main as kvrouter_main

    sampler = CpuSampler()
    sampler.on_signals()
    try:
        sys.argv = ["kvrouter", *args]
        return kvrouter_main() or 0
    finally:
        sampler.stop()
        with open(out, "w") as f:
            f.write(sampler.collapsed())


if __name__ == "__main__":
    sys.exit(main())
