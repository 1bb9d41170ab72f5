"""A real OTLP trace receiver on loopback for the tracing tests: the collector side of OTLP/gRPC
(opentelemetry-proto's TraceService) and of OTLP/HTTP (protobuf POSTs to /v1/traces), keeping every
span it receives in memory, as plain dicts."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from helpers import free_port


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


def _spans(request: Any) -> list[dict[str, Any]]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex() or None, "kind": s.kind,
                            "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "resource": resource, "status": s.status.code, "status_message": s.status.message})
    return out


class Collector:
    """`protocol`: "grpc" or "http/protobuf". `endpoint` is what --otlp-traces-endpoint takes."""

    def __init__(self, protocol: str = "grpc") -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        collector = self
        if protocol == "grpc":
            import grpc

            class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):  # noqa: N802
                    collector._add(_spans(request))
                    return trace_service_pb2.ExportTraceServiceResponse()

            self._grpc = grpc.server(ThreadPoolExecutor(2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
            self._grpc.add_insecure_port(f"127.0.0.1:{port}")
            self._grpc.start()
            self._http = None
        else:
            class Handler(BaseHTTPRequestHandler):
                def do_POST(self):
                    body = self.rfile.read(int(self.headers.get("content-length", 0)))
                    if self.path == "/v1/traces":
                        request = trace_service_pb2.ExportTraceServiceRequest()
                        request.ParseFromString(body)
                        collector._add(_spans(request))
                    self.send_response(200 if self.path == "/v1/traces" else 404)
                    self.send_header("content-type", "application/x-protobuf")
                    self.end_headers()
                    self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

                def log_message(self, *args):
                    pass

            self._grpc = None
            self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
            threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def _add(self, spans: list[dict[str, Any]]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def all(self) -> list[dict[str, Any]]:
        """Every span received so far."""
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 60.0,
                 counts: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """The trace's spans once every name in `names` arrived, and at least `counts[name]` spans of
        those names (the processes export in batches, ~5 s apart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            seen = [s["name"] for s in spans]
            if (names <= set(seen) and all(seen.count(n) >= k for n, k in (counts or {}).items())) \
                    or time.monotonic() > deadline:
                return spans
            time.sleep(0.25)

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(0)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
