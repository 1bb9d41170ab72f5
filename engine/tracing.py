"""OpenTelemetry tracing for one process (an ingress replica, an engine replica, `LLM`): off by
default; the OpenTelemetry packages are imported only once it is turned on.

`configure(endpoint)` (vLLM's `--otlp-traces-endpoint`) installs this process's tracer, which
exports spans in batches over OTLP: the protocol is `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or
`OTEL_EXPORTER_OTLP_PROTOCOL`), `grpc` (the default, as vLLM) or `http/protobuf`; the exporters read
the other standard variables themselves (headers, timeout, certificates, `..._INSECURE`), and the
resource `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` (the service is `pdserve` otherwise).
`use_exporter(exporter)` exports to a given exporter instead (in-process tests).

A request's trace crosses processes as a W3C trace-context carrier, a dict of `traceparent` (and
`tracestate`) headers: the client's headers start it, the ingress passes its request span's
carrier to each engine replica with the request (a plain argument of the actor call), and the
engine parents its spans on it. Spans are recorded with the times they happened: the engine
records a request's spans when it ends, from its timeline (engine/telemetry.py), so tracing
costs the step loop nothing per token.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from records.engine_args import check_otlp_endpoint

Carrier = dict[str, str]
PROTOCOLS = ("grpc", "http/protobuf")
TRACE_HEADERS = ("traceparent", "tracestate")

_lock = threading.Lock()
_tracer: Any = None          # the process's opentelemetry Tracer, or None: tracing is off
_provider: Any = None
_endpoint: str | None = None
# Engine and ingress times are time.monotonic(); spans take epoch nanoseconds.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def protocol() -> str:
    """The OTLP protocol the standard variables ask for; ValueError naming the allowed values."""
    name = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    value = os.environ.get(name)
    if not value:
        name, value = "OTEL_EXPORTER_OTLP_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if value not in PROTOCOLS:
        raise ValueError(f"{name} must be one of {list(PROTOCOLS)}; got {value!r}")
    return value


def _exporter(endpoint: str) -> Any:
    if protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    if urlparse(url).path in ("", "/"):      # a collector's base address: its traces path (OTLP/HTTP)
        url = url.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


def configure(endpoint: str | None, component: str = "engine") -> bool:
    """Turn tracing on in this process, exporting to `endpoint` (None: leave it as it is). Returns
    whether this process traces. Idempotent; a second, different endpoint is refused."""
    global _endpoint
    if endpoint is None:
        return _tracer is not None
    check_otlp_endpoint(endpoint)
    with _lock:
        if _tracer is not None:
            if _endpoint not in (None, endpoint):
                raise ValueError(f"this process already exports traces to {_endpoint}; got {endpoint}")
            return True
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

        _install(BatchSpanProcessor(_exporter(endpoint)), component)
        _endpoint = endpoint
    return True


def use_exporter(exporter: Any, component: str = "engine") -> None:
    """Export every span to `exporter` as it ends (tests; replaces any tracer of this process)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: PLC0415

    with _lock:
        shutdown()
        _install(SimpleSpanProcessor(exporter), component)


def _install(processor: Any, component: str) -> None:
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415

    attributes = {"pdserve.component": component, "process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "pdserve"
    # Our own provider, not the global one: an application embedding pdserve keeps its own.
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("pdserve")


def enabled() -> bool:
    return _tracer is not None


def endpoint() -> str | None:
    return _endpoint


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered (before the process ends, or a test reads)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    global _tracer, _provider, _endpoint
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = _endpoint = None


def carrier_from(headers: Mapping[str, str]) -> Carrier | None:
    """The W3C trace-context headers of a request (HTTP headers, gRPC metadata), or None."""
    found = {k: headers[k] for k in TRACE_HEADERS if headers.get(k)}
    return found or None


def _ns(t: float) -> int:
    return int(t * 1e9) + _EPOCH_OFFSET_NS


def start_span(name: str, parent: Carrier | Any | None, start: float | None = None,
               attributes: Mapping[str, Any] | None = None, kind: str = "INTERNAL") -> Any:
    """A span (an opentelemetry Span; end it with `end_span`) under `parent`: a carrier, a span, or
    None (a new trace). `start`: a time.monotonic() time (default now); `kind`: SpanKind's name."""
    from opentelemetry import trace  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    if parent is None or isinstance(parent, dict):
        context = TraceContextTextMapPropagator().extract(parent or {})
    else:
        context = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=context, kind=getattr(trace.SpanKind, kind),
                              attributes=dict(attributes or {}),
                              start_time=_ns(start) if start is not None else None)


def end_span(span: Any, end: float | None = None, error: str | None = None) -> None:
    """End a span at `end` (time.monotonic(); default now), with an error status when `error`."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=_ns(end) if end is not None else None)


def record_span(name: str, parent: Carrier | Any | None, start: float, end: float,
                attributes: Mapping[str, Any] | None = None, kind: str = "INTERNAL",
                error: str | None = None) -> Any:
    """A span that already happened (from `start` to `end`, time.monotonic()); returns it (ended),
    to parent others on."""
    span = start_span(name, parent, start, attributes, kind)
    end_span(span, max(start, end), error)
    return span


def carrier_of(span: Any) -> Carrier:
    """The W3C carrier of a span (to hand its context to another process)."""
    from opentelemetry import trace  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier
