#!/bin/bash
# How long `pdserve serve` (make serve's topology, the embedded model) takes to answer: seconds to
# /health 200, then one Responses call. Run from the repository root with nothing on port 8000;
# `PDSERVE_GGUF_CACHE=$(mktemp -d) bash benchmarks/startup.sh cold` measures an empty GGUF cache.
# docs/perf/journal.md §15.
set -e
label=${1:-run}
export RAY_USAGE_STATS_ENABLED=0
start=$(date +%s.%N)
.venv/bin/pdserve serve --host 127.0.0.1 --port 8000 > "/tmp/pdserve-startup-$label.log" 2>&1 &
pid=$!
until curl -sf 127.0.0.1:8000/health > /dev/null; do
  kill -0 $pid 2> /dev/null || { echo "pdserve serve exited; see /tmp/pdserve-startup-$label.log"; exit 1; }
  sleep 0.5
done
ready=$(date +%s.%N)
curl -s 127.0.0.1:8000/v1/responses -H 'Content-Type: application/json' \
  -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "input": "What is the capital of France?", "max_output_tokens": 12, "temperature": 0}' \
  | python3 -c "import json, sys; r = json.load(sys.stdin); print(r['status'], repr(r['output_text'] if 'output_text' in r else r['output'][0]['content'][0]['text']))"
done_=$(date +%s.%N)
python3 -c "print(f'$label: healthy after {$ready - $start:.1f} s, first response {$done_ - $ready:.2f} s')"
kill -INT $pid
wait $pid || true
