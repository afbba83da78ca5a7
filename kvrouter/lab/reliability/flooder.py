"""A KV-event source publishing as fast as a PUB socket takes it
(``python -m kvrouter.lab.reliability.flooder``).

::

    precomputed payloads (distinct blocks) ──send, no pause──▶ PUB (seq numbers, high-water mark: drops)
                                            └─ replay ROUTER (last ``buffer`` batches) between bursts

Payloads are encoded before the clock starts and sent as bytes, so the rate is what ZeroMQ and one Python
loop push (hundreds of thousands of batches a second), far above what an indexer applies.  A JSON line
with the batches published and dropped at the PUB ends the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import struct
import sys
import time

import msgspec
import zmq
import zmq.asyncio

from indexer.encode import PayloadEncoder

END = b"\xff" * 8
_F64 = struct.Struct(">d")


class FloodReport(msgspec.Struct):
    batches: int
    dropped: int
    seconds: float
    replay_requests: int


def payloads(distinct: int, blocks: int, seed: int) -> list[bytes]:
    """``distinct`` batches of ``blocks`` new 16-token blocks each (after them, the same ones again)."""
    rng = random.Random(seed)
    enc = PayloadEncoder()
    out = []
    for _ in range(distinct):
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        tokens = [rng.randrange(1, 30_000) for _ in range(16 * blocks)]
        out.append(enc.batch([enc.stored(hashes, None, tokens, 16)], ts=0.0))  # [0x93, 0xcb, f64 ts, ...]
    return out


async def _serve_replay(
    router: zmq.asyncio.Socket, buffer: collections.deque[tuple[int, bytes]], rep: FloodReport
) -> None:
    while True:
        frames = await router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            continue
        rep.replay_requests += 1
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, p in list(buffer):
            if seq >= start:
                await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), p])
        await router.send_multipart([ident, b"", END, b""])


async def flood(
    endpoint: str, replay: str | None, seconds: float, batches: list[bytes], buffer_steps: int
) -> FloodReport:
    ctx = zmq.asyncio.Context()
    sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
    pub = sync_ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    rep = FloodReport(0, 0, 0.0, 0)
    buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
    task = None
    router = None
    if replay is not None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(replay)
        task = asyncio.create_task(_serve_replay(router, buffer, rep))
    await asyncio.sleep(0.5)  # the subscriber connects (slow joiner)
    t0 = time.monotonic()
    seq, n = 0, len(batches)
    while time.monotonic() - t0 < seconds:
        ts = _F64.pack(time.time())  # stamped now, as vLLM does: a process's timestamps only grow
        for _ in range(512):
            p = batches[seq % n]
            p = p[:2] + ts + p[10:]
            buffer.append((seq, p))
            try:
                pub.send_multipart([b"", seq.to_bytes(8, "big"), p], flags=zmq.NOBLOCK)
            except zmq.Again:
                rep.dropped += 1
            seq += 1
        await asyncio.sleep(0)  # serve replay requests
    rep.batches, rep.seconds = seq, time.monotonic() - t0
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if router is not None:
        router.close(linger=0)
    pub.close(linger=0)
    ctx.term()
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrouter.lab.reliability.flooder")
    ap.add_argument("--endpoint", required=True, help="PUB endpoint to bind")
    ap.add_argument("--replay", default=None, help="replay ROUTER endpoint to bind")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--distinct", type=int, default=20_000, help="distinct batches before they repeat")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per batch")
    ap.add_argument("--buffer", type=int, default=10_000, help="replay buffer (batches)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    batches = payloads(a.distinct, a.blocks, a.seed)
    rep = asyncio.run(flood(a.endpoint, a.replay, a.seconds, batches, a.buffer))
    sys.stdout.write(msgspec.json.encode(rep).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
