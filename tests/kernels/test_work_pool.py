"""The kernels' own threads (kernels/csrc/work_pool.h), which run the kernels' work where OpenMP's
threads sleep when idle (OMP_WAIT_POLICY=passive) or PDSERVE_WORK_POOL=1: a region ends when its
items are done, each item runs once, a second caller thread runs its call on OpenMP's threads, and
the outputs are the bits OpenMP's threads give. The switch is read once a process, so each check
runs in a fresh one.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(TESTS))

_PRELUDE = f"""
import sys, threading, torch
sys.path[:0] = [{ROOT!r}, {TESTS!r}]
from cpu_batches import PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, paged_batch, prefill_batch
from kernels import cpu_ops
from engine.model.layers.cpu_gemm import OwnPanels
cpu_ops.load()
torch.set_num_threads(2)
torch.manual_seed(0)
prefill = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 9, 3, 64, 16, torch.bfloat16)
decode = paged_batch([37 * i % 700 + 1 for i in range(30)], 9, 3, 64, 16, torch.bfloat16)
def attention():
    return (cpu_ops.prefill_attention(*prefill, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125),
            cpu_ops.decode_attention(*decode, 0.125))
"""

# Fixed inputs through the GEMMs, attention, norm and argmax: their outputs, saved for comparison.
_OUTPUTS = _PRELUDE + """
x, w = torch.randn(37, 576, dtype=torch.bfloat16), torch.randn(1536, 576, dtype=torch.bfloat16)
gate_up = torch.randn(2 * 512, 576, dtype=torch.bfloat16)
prefill_out, decode_out = attention()
out = dict(linear=OwnPanels(w).matmul(x), linear_silu=OwnPanels(gate_up, gate_up=True).matmul_silu(x),
           linear_f32=OwnPanels(w.float()).matmul(x.float()),
           rms=cpu_ops.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-5)[0],
           argmax=cpu_ops.argmax_rows(torch.randn(64, 49152)), prefill=prefill_out, decode=decode_out)
torch.save(out, sys.argv[1])
"""

# The pool under stress: other thread counts (more threads than cores: helpers descheduled all the
# time), two caller threads at once, thousands of small regions back to back.
_STRESS = _PRELUDE + """
expected = attention()
for n in (1, 3, 7):
    torch.set_num_threads(n)
    got = attention()
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"{n} threads"
torch.set_num_threads(2)
failures = []
def call():
    for _ in range(20):
        if not all(torch.equal(a, b) for a, b in zip(attention(), expected)):
            failures.append("a caller's attention")
threads = [threading.Thread(target=call) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not failures, failures
x = torch.randn(64, 4096)
norm = cpu_ops.rms_norm(x, torch.ones(4096), 1e-6)[0]
for _ in range(3000):
    assert torch.equal(cpu_ops.rms_norm(x, torch.ones(4096), 1e-6)[0], norm)
print("ok")
"""


def _run(script: str, *args: str, pool: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDSERVE_WORK_POOL=pool)
    env.pop("OMP_WAIT_POLICY", None)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_pool_gives_openmp_s_bits(tmp_path):
    results = {}
    for pool in ("1", "0"):
        path = tmp_path / f"pool{pool}.pt"
        out = _run(_OUTPUTS, str(path), pool=pool)
        assert out.returncode == 0, out.stderr[-3000:]
        results[pool] = torch.load(path)
    assert results["1"].keys() == results["0"].keys()
    for name, value in results["1"].items():
        assert torch.equal(value, results["0"][name]), name


def test_the_pool_under_other_thread_counts_two_callers_and_many_regions():
    out = _run(_STRESS, pool="1")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# Threads the process gains in its first kernel call after OpenMP's team has started: the pool's helper.
_NEW_THREADS = _PRELUDE + """
import os
torch.randn(1 << 22).sum()                  # OpenMP's team, started by a torch op
before = len(os.listdir("/proc/self/task"))
attention()
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_the_switch_follows_openmp_s_wait_policy():
    """Unset, the pool runs where OpenMP's idle threads sleep (OMP_WAIT_POLICY=passive) and not with
    OpenMP's default, whose idle thread spins after each of torch's parallel ops on the core the
    pool's helper needs."""
    started = {}
    for policy in ("PASSIVE", "passive", "ACTIVE", None):
        env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_WORK_POOL", "OMP_WAIT_POLICY")}
        if policy is not None:
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run([sys.executable, "-c", _NEW_THREADS], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        started[policy] = int(out.stdout.strip().splitlines()[-1])
    assert started == {"PASSIVE": 1, "passive": 1, "ACTIVE": 0, None: 0}
