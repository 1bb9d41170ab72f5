"""fp8 KV cache decode attention on a CUDA GPU: launch options and a K-load variant (issue 26).

    python benchmarks/fp8_kv_variants.py

Times kernels/triton_attention.py's decode kernel over an fp8 (e4m3) cache, against its bf16 cache
at the default launch, for: each launch option of the fp8 cache (FP8_DECODE_*: warps, pipeline
stages, tokens per tile), and a variant of the kernel that loads K already transposed ([head_dim,
tokens], so that no transpose sits between the widening and the dot). The variant is the module's
source with two lines replaced, imported from a temporary file; its outputs are checked against the
module's own. Nothing is asserted about speed; medians of CUDA-event timings, each shape's cache
several times the L2.
"""
from __future__ import annotations

import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference
from kernels import triton_attention as ta

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)       # benchmarks/kernels.py: bench, paged_cache, the 8B shapes

SHAPES = ((1, 32768), (16, 8192), (64, 2048), (64, 8192))
K_LOAD = "k = _load_kv(k_ptr + off[:, None] + d[None, :], kv_mask, q, FP8)"
K_DOT = "s = _dot(q, tl.trans(k), IEEE).to(tl.float32) * scale"


def k_transposed_module():
    src = Path(ta.__file__).read_text()
    assert K_LOAD in src and K_DOT in src
    src = src.replace(K_LOAD, "k = _load_kv(k_ptr + off[None, :] + d[:, None], tl.trans(kv_mask), q, FP8)")
    src = src.replace(K_DOT, "s = _dot(q, k, IEEE).to(tl.float32) * scale")
    path = Path(tempfile.mkdtemp()) / "ta_k_transposed.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("ta_k_transposed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_kv_variants.py needs a CUDA GPU")
    tt = k_transposed_module()
    cases = []
    for batch, context in SHAPES:
        cache, tables = bk.paged_cache(batch, context)
        q = torch.randn(batch, bk.HEADS, bk.HEAD_DIM, dtype=bk.DTYPE, device="cuda")
        lens = torch.full((batch,), context, device="cuda")
        cases.append((batch, context, cache, cache.to(reference.FP8_DTYPE), tables, q, lens))
    scale = bk.HEAD_DIM ** -0.5
    base = {}
    for batch, context, cache, fp8, tables, q, lens in cases:
        bf16 = bk.bench(lambda: ta.decode_attention(q, cache, tables, lens, scale))
        want = ta.decode_attention(q, fp8, tables, lens, scale, 0.5, 0.5)
        other = tt.decode_attention(q, fp8, tables, lens, scale, 0.5, 0.5)
        err = ((other.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err      # the dot may sum in another order; bf16 outputs
        bf16_t = bk.bench(lambda: tt.decode_attention(q, cache, tables, lens, scale))
        base[batch, context] = bf16
        print(f"b={batch} ctx={context}: bf16 {bf16 * 1e3:.1f} us (K transposed: {bf16 / bf16_t:.2f}x); "
              f"K transposed against as is, fp8: relative error {err:.1e}", flush=True)
    for module, name in ((ta, "as is"), (tt, "K transposed")):
        saved = (module.FP8_DECODE_TILE_TOKENS, dict(module.FP8_DECODE_LAUNCH))
        for tile, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
            module.FP8_DECODE_TILE_TOKENS = tile
            module.FP8_DECODE_LAUNCH.update(num_warps=warps, num_stages=stages)
            cells = []
            for batch, context, _, fp8, tables, q, lens in cases:
                try:
                    ms = bk.bench(lambda: module.decode_attention(q, fp8, tables, lens, scale, 0.5, 0.5), rep=40)
                    cells.append(f"b{batch}xc{context} {base[batch, context] / ms:.2f}x")
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    cells.append(f"b{batch}xc{context} {type(e).__name__}")
            print(f"fp8 {name} tile={tile} warps={warps} stages={stages}: " + ", ".join(cells), flush=True)
        module.FP8_DECODE_TILE_TOKENS = saved[0]
        module.FP8_DECODE_LAUNCH.update(saved[1])


if __name__ == "__main__":
    main()
