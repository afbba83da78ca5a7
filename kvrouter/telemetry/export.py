"""Spans out over OTLP: a traced request's spans, encoded when it ends, batched and sent by the
OpenTelemetry SDK's exporter (http/protobuf or gRPC), away from the request path.

::

    request ends ──SpanSink.emit──▶ otlp_wire: the request's Span messages ─▶ queue (bounded: full ─▶ dropped)
    export thread: every schedule delay, or at a full batch ──▶ Shipper.ship(batch) ──▶ (sent, failed)
      ExporterProcess (default): the batch's span bytes ──pipe──▶ ``exporter_proc`` ▸ OtlpShipper ──▶ receiver
      OtlpShipper (``tracing.export_process: false``, or a sender given): on the export thread itself

The request path pays for its records and their encoding (``otlp_wire``, about 15 us for a request's nine
spans); wrapping the spans in export requests and sending them (the SDK's HTTP or gRPC client, most of a
POST's CPU) run in the exporter's process, off the event loop's CPU and GIL.  A batch is whole requests
of at most ``max_export_batch_size`` spans, so one POST each.  A batch counts as sent once acknowledged.
The SDK supplies what an operator configures (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``,
``OTEL_EXPORTER_OTLP_*``, ``OTEL_BSP_*`` read in ``config``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import IO, Any, Protocol

import msgspec
from opentelemetry.sdk.resources import Resource

from .config import TracingConfig
from .otlp_wire import OtlpEncoder
from .record import RequestRecord

log = logging.getLogger("kvrouter.telemetry")


class SpanSender(Protocol):
    """Sends one encoded ``ExportTraceServiceRequest``; True when the receiver took it."""

    def send(self, payload: bytes) -> bool: ...

    def shutdown(self) -> None: ...


class _HttpSender:
    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.exporter = OTLPSpanExporter(endpoint=cfg.traces_endpoint, timeout=cfg.export_timeout_s)
        try:
            _urllib3_transport(self.exporter)
        except (AttributeError, ImportError):  # another SDK's insides: its own transport then
            log.debug("OTLP/HTTP over the SDK's default transport", exc_info=True)

    def send(self, payload: bytes) -> bool:
        return bool(self.exporter._client.export(payload).success)

    def shutdown(self) -> None:
        self.exporter.shutdown()


def _urllib3_transport(exporter: Any) -> None:
    """The SDK's urllib3 transport in place of its requests one, where they do the same (no proxy for the
    receiver, no credentials from the environment or a provider): half a POST's CPU, which ``requests``
    spends reading proxies, ``.netrc`` and CA bundles from the environment again for every POST.  The
    SDK still makes the headers, compression, retries and certificates."""
    import requests
    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    from requests.utils import get_netrc_auth, select_proxy

    client = exporter._client
    session = getattr(getattr(client, "_transport", None), "_session", None)
    url = getattr(client, "_endpoint", None)
    if type(session) is not requests.Session or not url or session.auth is not None:
        return
    env = session.merge_environment_settings(url, {}, None, None, None)
    if select_proxy(url, env["proxies"]) or get_netrc_auth(url) is not None:
        return
    client._transport = Urllib3HTTPTransport(verify=env["verify"], cert=session.cert)


class _GrpcSender:
    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.sdk.trace.export import SpanExportResult

        class Exporter(OTLPSpanExporter):
            def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
                return ExportTraceServiceRequest.FromString(data)  # already encoded (upb parses in C)

        e = cfg.endpoint
        insecure = None if e is None else e.startswith("http://") or "://" not in e
        self.exporter = Exporter(endpoint=e, insecure=insecure, timeout=cfg.export_timeout_s)
        self._ok = SpanExportResult.SUCCESS

    def send(self, payload: bytes) -> bool:
        return bool(self.exporter.export(payload) == self._ok)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self.exporter.shutdown()


def otlp_sender(cfg: TracingConfig) -> SpanSender:
    return _GrpcSender(cfg) if cfg.protocol == "grpc" else _HttpSender(cfg)


Encoded = list[bytes]
"""One traced request's spans, each an encoded ``Span`` (``OtlpEncoder.spans_of``), the root first."""


class Shipper(Protocol):
    """Sends a batch of traced requests' encoded spans (``spans`` in all): (spans sent, spans that
    failed)."""

    def start(self) -> None: ...

    def ship(self, batch: list[Encoded], spans: int) -> tuple[int, int]: ...

    def shutdown(self) -> None: ...


def _resource(cfg: TracingConfig) -> dict[str, Any]:
    """The resource's attributes as the SDK makes them (``OTEL_RESOURCE_ATTRIBUTES`` and the rest)."""
    return dict(Resource.create({"service.name": cfg.service_name}).attributes)


class OtlpShipper:
    """Wraps requests' encoded spans in export requests of at most ``max_export_batch_size`` spans and
    sends them: in the exporter's process, or on the router's export thread."""

    def __init__(self, cfg: TracingConfig, sender: SpanSender | None = None) -> None:
        self.encoder = OtlpEncoder(_resource(cfg))
        self.sender = sender or otlp_sender(cfg)
        self.batch = cfg.max_export_batch_size

    def start(self) -> None:
        pass

    def ship(self, batch: list[Encoded], spans: int) -> tuple[int, int]:
        flat: list[bytes] = []
        for request_spans in batch:
            flat += request_spans
        sent = failed = 0
        for i in range(0, len(flat), self.batch):
            chunk = flat[i : i + self.batch]
            try:
                ok = self.sender.send(self.encoder.request(chunk))
            except Exception:  # the exporter's failure is never the request path's
                log.exception("span export failed")
                ok = False
            if ok:
                sent += len(chunk)
            else:
                failed += len(chunk)
        return sent, failed

    def shutdown(self) -> None:
        self.sender.shutdown()


_LEN = 4


def write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(len(payload).to_bytes(_LEN, "little") + payload)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the stream (the other side closed it)."""
    head = inp.read(_LEN)
    if len(head) < _LEN:
        return None
    n = int.from_bytes(head, "little")
    body = inp.read(n)
    if len(body) < n:
        return None
    return body


FRAME = msgspec.msgpack.Decoder(list[Encoded]).decode
"""A batch as it crosses the pipe: a msgpack array of the requests' arrays of span bytes."""


class ExporterProcess:
    """The exporter's process seen from the router: each batch goes over its standard input (msgpack,
    length-prefixed) and its answer, (sent, failed), comes back on its standard output.  Started when the
    export thread starts; one that exited is started again at the next batch (its batch in flight counted
    failed)."""

    def __init__(self, cfg: TracingConfig) -> None:
        self.cfg = cfg
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._decode = msgspec.msgpack.Decoder(tuple[int, int]).decode
        self._encode = msgspec.msgpack.Encoder().encode

    def _start(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "kvrouter.telemetry.exporter_proc",
            msgspec.json.encode(self.cfg).decode(),
        ]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy()
        )
        self.starts += 1
        return self._proc

    def start(self) -> None:
        if self._proc is None:
            self._start()

    def ship(self, batch: list[Encoded], spans: int) -> tuple[int, int]:
        n, payload = spans, self._encode(batch)
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            log.warning("the span exporter's process exited (code %s): starting it again", proc.poll())
            self._stop(proc)
            proc = None
        if proc is None:
            proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            write_frame(proc.stdin, payload)
            reply = read_frame(proc.stdout)
        except OSError:
            reply = None
        if reply is None:
            log.warning("the span exporter's process exited (code %s): its batch is lost", proc.poll())
            self._stop(proc)
            return 0, n
        try:
            sent, failed = self._decode(reply)
        except msgspec.DecodeError:
            log.warning("the span exporter's process answered %r: its batch counted failed", reply[:64])
            return 0, n
        return sent, failed

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(self.cfg.export_timeout_s + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None

    def shutdown(self) -> None:
        if self._proc is not None:
            self._stop(self._proc)


class SpanSink:
    """Traced requests' spans from the request path to the shipper: encoded at ``emit``, queued (at most
    ``max_queue_size`` spans: beyond, dropped and counted), taken by the export thread in batches of
    whole requests up to ``max_export_batch_size`` spans (one export request each, unless a request alone
    has more)."""

    def __init__(self, cfg: TracingConfig, sender: SpanSender | None = None) -> None:
        self.cfg = cfg
        self.shipper: Shipper = (
            OtlpShipper(cfg, sender) if sender is not None or not cfg.export_process else ExporterProcess(cfg)
        )
        self.encoder = OtlpEncoder({})
        """Writes spans only (``spans_of``): the resource goes in where export requests are made, by the
        shipper's own encoder, so the SDK's resource detection does not run twice in the router."""
        self._pending: list[Encoded] = []
        self._pending_spans = 0
        self._cv = threading.Condition()
        self._flushing = 0
        self._busy = False
        self._stop = False
        self.emitted = 0
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="kvrouter-otlp", daemon=True)
        self._thread.start()

    def emit(self, rec: RequestRecord) -> None:
        """Queue a request's spans, encoded now (``otlp_wire``).  Encoding here, once, is the cheapest
        place: a plain form would be packed, unpacked and encoded again on the far side of the pipe
        (together about as much CPU as the encoding itself), and bytes wait for their batch where tuples
        and dicts would be promoted into the old generation the full collections traverse."""
        spans = self.encoder.spans_of(rec.compact())
        n = len(spans)
        with self._cv:
            if self._pending_spans + n > self.cfg.max_queue_size:
                self.dropped += n
                return
            self._pending.append(spans)
            self._pending_spans += n
            if self._pending_spans >= self.cfg.max_export_batch_size:
                self._cv.notify()
        self.emitted += 1

    def _take(self, everything: bool) -> tuple[list[Encoded], int]:
        """The next batch (under the lock): whole requests while they fit ``max_export_batch_size``
        spans (at least one), or ``everything`` queued (shutting down)."""
        pending, total = self._pending, self._pending_spans
        if everything or total <= self.cfg.max_export_batch_size:
            self._pending, self._pending_spans = [], 0
            return pending, total
        room, i, spans = self.cfg.max_export_batch_size, 0, 0
        while i < len(pending) and (i == 0 or spans + len(pending[i]) <= room):
            spans += len(pending[i])
            i += 1
        self._pending, self._pending_spans = pending[i:], total - spans
        return pending[:i], spans

    def _run(self) -> None:
        batch = self.cfg.max_export_batch_size
        try:
            self.shipper.start()  # before the first traced request: its start-up is no batch's wait
        except Exception:
            log.exception("the span exporter could not start")
        while True:
            with self._cv:
                if not self._stop and not self._flushing and self._pending_spans < batch:
                    self._cv.wait(self.cfg.schedule_delay_s)
                stop = self._stop
                take, spans = self._take(stop)
                self._busy = bool(take)
            if take:
                try:
                    sent, failed = self.shipper.ship(take, spans)
                except Exception:  # the exporter's failure is never the request path's
                    log.exception("span export failed")
                    sent, failed = 0, spans
                self.sent += sent
                self.failed += failed
            with self._cv:
                self._busy = False
                if not self._pending and self._flushing:
                    self._cv.notify_all()
            if stop:
                return

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued now (blocking: call off the event loop)."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout_s)
            finally:
                self._flushing -= 1

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(self.cfg.export_timeout_s + 5)
        self.shipper.shutdown()
