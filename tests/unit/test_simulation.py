"""The simulation's records: profiles (files, built-ins, the cost model), traces (both formats, a
bad line named by number and field), and the virtual clock."""
from __future__ import annotations

import json

import pytest

import records.clock as clock
from cluster.sim.trace import TraceTokens, read_trace
from records.engine_args import EngineArgs
from records.sim_profile import (
    LINEAR_FEATURES,
    SimProfile,
    StepShape,
    builtin_profiles,
    load_profile,
    save_profile,
)


def test_the_h200_profile_reproduces_the_measured_decode_steps():
    """Its constants came from docs/perf/journal.md section 6: the decode steps measured there, within 10%."""
    p = load_profile("h200-llama3-8b")
    assert "h200-llama3-8b" in builtin_profiles()
    measured = p.fit["decode_step_ms_measured"]
    for batch, ms in measured.items():
        b = int(batch)
        shape = StepShape(decode_rows=b, decode_context=b * p.fit["decode_step_context"], sampled_rows=b)
        assert p.step_time(shape) * 1e3 == pytest.approx(ms, rel=0.10), batch
    # Prefill is compute-bound, decode memory-bound; TP halves a rank's share and adds its all-reduces.
    prompt = StepShape(prefill_tokens=8192, prefill_attention=8192 * 8193 / 2, sampled_rows=1)
    assert p.step_time(prompt) > 20 * p.step_time(StepShape(decode_rows=1, decode_context=8192, sampled_rows=1))
    assert p.step_time(prompt) / 2 < p.step_time(prompt, tp=2) < p.step_time(prompt) * 0.6
    # Pipeline stages: a batch's latency covers every stage (and the hops between them).
    assert p.step_time(prompt, pp=2) > p.stage_time(prompt, pp=2) * 2
    # The KV cache an H200 leaves Llama-3-8B: over 800k tokens on one rank, more per rank at TP=2.
    assert p.kv_capacity_bytes(1, 1) / p.model.kv_bytes_per_token() > 800_000
    assert p.kv_capacity_bytes(2, 1) > 2 * p.kv_capacity_bytes(1, 1)


def test_a_linear_profile_round_trips_and_bad_ones_are_refused(tmp_path):
    p = SimProfile.from_dict({**load_profile("h200-llama3-8b").to_dict(), "name": "lin", "kind": "linear",
                              "knots": [1, 4, 64], "coefficients": [1e-3, 2e-3, 5e-3, 0.0, 1e-8, 1e-4]})
    path = tmp_path / "lin.json"
    save_profile(p, str(path))
    again = load_profile(str(path))
    assert again == p
    shape = StepShape(prefill_tokens=30, decode_rows=4, decode_context=300, sampled_rows=4)     # 34 tokens
    assert again.step_time(shape) == pytest.approx(2e-3 + 0.5 * 3e-3 + 300 * 1e-8 + 4 * 1e-4)  # halfway 4..64
    assert again.step_time(StepShape(decode_rows=1, sampled_rows=1)) == pytest.approx(1e-3 + 1e-4)
    assert again.step_time(StepShape(prefill_tokens=124)) == pytest.approx(5e-3 + 3e-3)      # the last line on
    assert again.step_time(shape, tp=2) == pytest.approx(again.step_time(shape) / 2)
    with pytest.raises(ValueError, match="neither a profile file nor a built-in profile; the built-ins are "
                                         r"\['h200-llama3-8b'"):
        load_profile("h100-nothing")
    with pytest.raises(ValueError, match=f"a linear profile needs {3 + len(LINEAR_FEATURES)} coefficients"):
        SimProfile.from_dict({**p.to_dict(), "coefficients": [1.0]})
    with pytest.raises(ValueError, match="needs knots, increasing token counts"):
        SimProfile.from_dict({**p.to_dict(), "knots": [4, 1, 64]})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**p.to_dict(), "model": {**p.to_dict()["model"], "layers": 3}}))
    with pytest.raises(ValueError, match=r"bad.json: model: unknown fields \['layers'\]"):
        load_profile(str(bad))
    # The engine arguments check the profile when the spec loads, and its time scale.
    with pytest.raises(ValueError, match="built-ins are"):
        EngineArgs(simulate="nope")
    with pytest.raises(ValueError, match="simulate_time_scale must be > 0"):
        EngineArgs(simulate="h200-llama3-8b", simulate_time_scale=0)
    with pytest.raises(ValueError, match="does not model speculative decoding"):
        EngineArgs(simulate="h200-llama3-8b", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_a_trace_reads_both_formats_and_names_a_bad_line(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7]},
        "",
        {"timestamp": 500, "prompt_token_ids": [5, 6, 7], "output_length": 2},
        {"timestamp": 900, "prompt": "hello there", "max_tokens": 4}])
    trace = read_trace(path)
    assert [r.arrival_s for r in trace] == [0.0, 0.5, 0.9, 2.0]          # in arrival order
    assert trace[0].hash_ids == (7,) and trace[1].prompt_token_ids == (5, 6, 7) and trace[2].prompt == "hello there"
    tokens = TraceTokens(vocab_size=1000, encode=lambda text: [1] * len(text.split()))
    a, b = tokens.prompt(trace[0], 0), tokens.prompt(trace[3], 3)
    assert len(a) == 600 and len(b) == 1100
    assert a[:512] == b[:512] and a[512:] != b[512:600]      # hash id 7 is the same 512 tokens in both
    assert b[512:1024] == TraceTokens(1000).prompt(trace[3], 3)[512:1024]     # and the same every time
    assert tokens.prompt(trace[2], 2) == [1, 1] and tokens.prompt(trace[1], 1) == [5, 6, 7]
    assert [r.arrival_s for r in read_trace(path, start_s=0.5, duration_s=1.0)] == [0.0, 0.4]   # a window

    cases = [({"timestamp": -1, "prompt": "x", "output_length": 1}, "timestamp must be a number"),
             ({"timestamp": 0, "input_length": 10, "hash_ids": [1]}, "output_length must be an integer >= 1"),
             ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]},
              "hash_ids has 2 blocks of 512 tokens, more than input_length 10 fills"),
             ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}, "hash_ids must be a list"),
             ({"timestamp": 0, "prompt_token_ids": [], "output_length": 1}, "prompt_token_ids must be a non-empty"),
             ({"timestamp": 0, "output_length": 1}, "a line needs prompt"),
             ({"timestamp": 0, "prompt": "x", "output_length": 1, "temperature": 1},
              r"unknown fields \['temperature'\]"),
             ("{not json", "not JSON")]
    for obj, message in cases:
        bad = _write(tmp_path / "bad.jsonl", [{"timestamp": 0, "prompt": "ok", "output_length": 1}, obj])
        with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{message}"):
            read_trace(bad)
    with pytest.raises(ValueError, match="cannot read"):
        read_trace(str(tmp_path / "missing.jsonl"))


def test_the_virtual_clock():
    assert not clock.is_virtual()
    with clock.virtual(clock.VirtualClock(5.0)) as c:
        assert clock.monotonic() == 5.0 and clock.wall() == clock.VIRTUAL_EPOCH + 5.0
        clock.advance(7.5)
        clock.advance(6.0)              # never backwards
        assert clock.monotonic() == 7.5 == c.now
    assert not clock.is_virtual() and clock.monotonic() > 0
