"""The targets' latency models for the whole host: every worker trains the same models with what it
observed, and predicts from them (``routing.policies.latency_model.ModelStore``).

::

    latency float64 [targets, SHARED_WORDS]   row = [initialised, TTFT observations, TPOT observations,
                                                     TTFT theta, TTFT P, TPOT theta, TPOT P]

A row is written under the host's lock (an initialisation or a training step reads, then writes); a
prediction reads theta without it, so it may see a step half written by another worker: a coefficient
vector between two consecutive fits, as close to either as one observation moves it.  A target past the
directory's slots keeps its models in each worker alone.
"""

from __future__ import annotations

import numpy as np

from ..routing.policies.latency_model import SHARED_WORDS
from ..types import TargetKey
from .memory import HostLock, HostMemory, SlotsExhausted


class HostLatency:
    def __init__(self, mem: HostMemory) -> None:
        self.mem = mem
        self._rows = mem.view("latency")
        if self._rows.shape[1] < SHARED_WORDS:
            raise ValueError(f"latency rows hold {self._rows.shape[1]} words, the models need {SHARED_WORDS}")

    @property
    def lock(self) -> HostLock:
        return self.mem.lock

    def row(self, target: TargetKey) -> np.ndarray | None:
        try:
            slot = self.mem.targets.slot(target)
        except SlotsExhausted:
            return None
        return self._rows[slot, :SHARED_WORDS]
