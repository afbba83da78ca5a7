"""A clear read from a replay of the past does not undo what the router sent since it started.

A router that starts after its instances have run joins late: vLLM's first live batch has a sequence past
0, so the router replays the instance's buffered past, which may hold an ``AllBlocksCleared`` (a cache
reset before the router started).  Applied while the router catches up, that clear empties the stored
blocks it read so far, but keeps the speculative entries of the requests the router already sent there
and does not count as a clear (``Indexer.clears`` voids the placements made before one).  The same event
arriving live drops both.  (Found by the real-vLLM tier: a LoRA test reset the caches, started a gateway,
sent a prompt twice, and the second was predicted 0 cached tokens where vLLM served 192.)
"""

from __future__ import annotations

import numpy as np

from indexer import Indexer, SourceKey
from indexer.encode import PayloadEncoder
from indexer.hashing import request_chains
from indexer.index import SPECULATIVE_BIT

TS = 1_700_000_000.0
SRC = SourceKey("v", 0)


def test_a_replayed_clear_keeps_what_was_sent_since_and_a_live_one_does_not() -> None:
    e = PayloadEncoder()
    ix = Indexer(4)
    ix.register(SRC, has_replay=True)
    assert ix.on_connect(SRC) == [0]  # a router starting asks for everything v still buffers
    sent = np.asarray(request_chains(list(range(1, 9)), 4), dtype=np.int64)  # a prompt routed to v
    ix.add_speculative(SRC, sent, now=0.0)
    other = list(range(50, 58))
    assert ix.on_message(SRC, 3, e.batch([e.stored([7, 8], None, other, 4)], ts=TS + 3)) == []  # buffered
    ix.on_replay(SRC, 0, e.batch([e.stored([5, 6], None, other, 4)], ts=TS))
    ix.on_replay(SRC, 1, e.batch([e.cleared()], ts=TS + 1))  # the reset before the router started
    ix.on_replay(SRC, 2, e.batch([e.stored([9], None, other[:4], 4)], ts=TS + 2))
    held = ix.holding(SRC, sent)
    assert held is not None and all(h & SPECULATIVE_BIT for h in held.tolist())
    assert ix.clears(SRC) == 0
    ix.on_replay_end(SRC)
    assert ix.lookup(list(range(1, 9))).instances[0].matched_blocks == 2  # still expected there
    # a clear that arrives live is the cache emptied now: what was sent before it is gone
    ix.on_message(SRC, 4, e.batch([e.cleared()], ts=TS + 4))
    held = ix.holding(SRC, sent)
    assert held is None or not any(h & SPECULATIVE_BIT for h in held.tolist())
    assert ix.clears(SRC) == 1
