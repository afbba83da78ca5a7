"""The ingest's fast path: one compiled call parses a payload (``fast_wire``) and applies it
(``fast_apply``), into and out of the scratch arrays kept here.

::

    Indexer.apply_payload ──BlockIndex.ingest──▶ fast_apply.ingest: parse_batch, apply_rows ──▶ index
        │                      (tables grown first when the payload needs room: then apply_rows alone)
        └─ declined, or applied up to an event the reference path must take ──▶ BatchDecoder, then
           EventApplier._stored / _removed for the rest (the reference path)

So counters, errors and trust come out exactly as if the reference path had done all of it.  Not
thread-safe: one per ``Indexer``, used by its owner.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .fast_apply import OUT
from .fast_wire import ROW
from .hashing import I64Array

_START = 4096


class IngestScratch:
    """Scratch arrays of the fast path, sized for the largest payload seen so far (they only grow)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.rows: I64Array = np.zeros((64, ROW), dtype=np.int64)
        self.engines: I64Array = np.zeros(_START, dtype=np.int64)
        self.blocks: I64Array = np.zeros(_START, dtype=np.int64)
        self.flags: npt.NDArray[np.int8] = np.zeros(_START, dtype=np.int8)
        self.out: I64Array = np.zeros(OUT, dtype=np.int64)

    def grow(self, size: int) -> None:
        """Room for any payload of ``size`` bytes: an event takes >= 2 bytes, an engine hash >= 1, a block
        >= 1 token byte (``parse_batch`` checks every count against the bytes left, so this suffices)."""
        if len(self.rows) < size // 2 + 1:
            self.rows = np.zeros((size // 2 + 1, ROW), dtype=np.int64)
        if len(self.engines) < size:
            self.engines = np.zeros(size, dtype=np.int64)
            self.blocks = np.zeros(size, dtype=np.int64)
            self.flags = np.zeros(size, dtype=np.int8)
