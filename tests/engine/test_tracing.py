"""Tracing and the per-request histograms of one engine (engine/tracing.py, engine/telemetry.py):
spans recorded under the caller's trace context, none without one, both OTLP protocols to a real
receiver on loopback, and the configuration's refusals."""
from __future__ import annotations

import pytest
from otlp_collector import Collector

import engine.tracing as tracing
from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.engine_args import EngineArgs
from records.sampling_params import SamplingParams

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    tracing.use_exporter(exp)
    yield exp
    tracing.shutdown()


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_an_engine_records_its_hop_under_the_callers_trace_or_a_trace_of_its_own(tiny_llama, exporter):
    engine = LLMEngine(engine_config(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("traced", None, list(range(5, 45)), greedy, trace_context={"traceparent": TRACEPARENT})
    engine.add_request("plain", None, list(range(50, 70)), greedy)
    _run(engine)
    finished = exporter.get_finished_spans()
    (own,) = [s for s in finished if s.name == "pdserve.engine" and s.attributes["gen_ai.request.id"] == "plain"]
    assert own.parent is None and format(own.context.trace_id, "032x") != TRACE_ID     # a root of its own
    spans = {s.name: s for s in finished if format(s.context.trace_id, "032x") == TRACE_ID}
    assert set(spans) == {"pdserve.engine", "pdserve.queue", "pdserve.prefill", "pdserve.decode",
                          "pdserve.detokenize"}
    assert len(finished) == 2 * len(spans)
    hop = spans["pdserve.engine"]
    assert format(hop.context.trace_id, "032x") == TRACE_ID
    assert format(hop.parent.span_id, "016x") == CLIENT_SPAN          # the caller's span is its parent
    for name in ("pdserve.queue", "pdserve.prefill", "pdserve.decode", "pdserve.detokenize"):
        assert spans[name].parent.span_id == hop.context.span_id, name
        assert hop.start_time <= spans[name].start_time <= spans[name].end_time <= hop.end_time, name
    # The hop's phases follow each other: queue, then prefill to the first token, then decode.
    assert spans["pdserve.queue"].end_time <= spans["pdserve.prefill"].start_time
    assert spans["pdserve.prefill"].end_time == spans["pdserve.decode"].start_time
    assert hop.attributes["gen_ai.usage.input_tokens"] == 40
    assert hop.attributes["gen_ai.usage.output_tokens"] == 6
    assert hop.attributes["gen_ai.response.finish_reasons"] == "length"
    assert spans["pdserve.prefill"].attributes["pdserve.computed_prompt_tokens"] == 40
    # The per-request histograms counted both requests.
    hist = engine.stats().histograms
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert sum(hist[name][0]) == 2, name
    assert hist["request_prompt_tokens"][1] == 60 and hist["request_generation_tokens"][1] == 12
    assert sum(hist["iteration_tokens_total"][0]) >= 6 and hist["iteration_tokens_total"][1] == 60 + 2 * 5
    assert sum(hist["kv_pull_seconds"][0]) == 0
    engine.check_no_leaks()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_collector_over_either_protocol(tiny_llama, protocol, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pdserve-test")
    collector = Collector(protocol)
    try:
        engine = LLMEngine(engine_config(tiny_llama, dtype="float32", max_model_len=128, num_kv_blocks=32,
                                               otlp_traces_endpoint=collector.endpoint))
        assert tracing.enabled() and tracing.endpoint() == collector.endpoint
        engine.add_request("r", None, list(range(5, 25)), SamplingParams(max_tokens=3, temperature=0.0),
                           trace_context={"traceparent": TRACEPARENT})
        _run(engine)
        tracing.flush()
        spans = collector.wait_for(TRACE_ID, {"pdserve.engine", "pdserve.queue", "pdserve.prefill"}, 30)
        hop = next(s for s in spans if s["name"] == "pdserve.engine")
        assert hop["parent_id"] == CLIENT_SPAN
        assert hop["resource"]["service.name"] == "pdserve-test"
        assert hop["resource"]["pdserve.component"] == "engine"
        with pytest.raises(ValueError, match="already exports traces"):
            tracing.configure("http://127.0.0.1:1")
    finally:
        tracing.shutdown()
        collector.close()


def test_tracing_configuration_is_checked(monkeypatch):
    for bad in ("", "has space:4317", "ftp://host:4317", "http://:4317", "host:notaport"):
        with pytest.raises(ValueError, match="otlp_traces_endpoint"):
            EngineArgs(otlp_traces_endpoint=bad)
    EngineArgs(otlp_traces_endpoint="collector.monitoring:4317")
    EngineArgs(otlp_traces_endpoint="https://otel.example.internal:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_PROTOCOL must be one of \['grpc', 'http/protobuf'\]"):
        tracing.configure("http://127.0.0.1:4318")
    assert not tracing.enabled()
    assert tracing.carrier_from({"traceparent": TRACEPARENT, "other": "x"}) == {"traceparent": TRACEPARENT}
    assert tracing.carrier_from({}) is None
