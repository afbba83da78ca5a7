"""The span exporter's own process (``python -m kvrouter.telemetry.exporter_proc CONFIG``, started by
``export.ExporterProcess``): reads batches of traced requests' encoded spans (msgpack, length-prefixed)
on its standard input, sends each with ``OtlpShipper`` and answers (sent, failed) on its standard
output; exits at the end of its input, once the last batch is answered.

Its standard output carries frames only: file descriptor 1 is pointed at standard error before anything
(the SDK's logging, a library's print) could write to it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import msgspec

from .config import TracingConfig
from .export import FRAME, OtlpShipper, read_frame, write_frame


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: the router, shutting down, still sends what it holds here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    cfg = msgspec.json.decode(argv[0], type=TracingConfig)
    shipper = OtlpShipper(cfg)
    # Everything alive now (the SDK's and urllib3's modules) lives as long as the process: frozen out of
    # the collector's way of the containers each batch and POST makes.
    gc.collect()
    gc.freeze()
    inp = sys.stdin.buffer
    encode = msgspec.msgpack.Encoder().encode
    try:
        while (frame := read_frame(inp)) is not None:
            batch = FRAME(frame)
            write_frame(out, encode(shipper.ship(batch, sum(map(len, batch)))))
    finally:
        shipper.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
