"""Weight updates into a running engine (RL: engine/weight_updates.py, engine/worker/weight_sync.py):
from a checkpoint directory, from tensors and over a gloo group a trainer joins, each token-identical
to a fresh engine loaded with the new weights; refused whole (naming the tensor) on a wrong name or
shape; the prefix cache forgets the old weights' blocks; every output says which weights produced
it; pause keep / abort / wait and resume at a step boundary."""
from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import threading

import pytest
import torch
from helpers import mixed_prompts

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.worker.weight_sync import WeightUpdateGroup

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama after a "training step": every tensor perturbed, saved as a checkpoint of its own."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("trained")
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama, name), out / name)
    g = torch.Generator().manual_seed(7)
    new = {n: (t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)).contiguous()
           for n, t in _tensors(tiny_llama).items()}
    save_file(new, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(1000, seed=31)


@pytest.fixture(scope="module")
def before_after(tiny_llama, trained, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """What fresh engines of the old and the new weights generate."""
    out = []
    for path in (tiny_llama, trained):
        llm = LLM(path, dtype="float32")
        out.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)])
    assert out[0] != out[1]
    return out[0], out[1]


def _run(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_update_from_disk_serves_the_new_weights_and_forgets_old_blocks(tiny_llama, trained, prompts, before_after):
    old, new = before_after
    llm = LLM(tiny_llama, dtype="float32")
    outs = _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == old
    assert {o.weight_version for o in outs} == {"0"} and outs[0].outputs[0].weight_versions == [(0, "0")]
    assert llm.update_weights_from_disk(trained) == "1" and llm.weight_version == "1"
    outs = _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == new
    # The same prompts ran before: no block of the old weights is taken.
    assert all(o.num_cached_tokens == 0 for o in outs) and {o.weight_version for o in outs} == {"1"}
    again = _run(llm, prompts)                   # the new weights' blocks are cached as usual
    assert [o.outputs[0].token_ids for o in again] == new and max(o.num_cached_tokens for o in again) > 0
    llm.llm_engine.check_no_leaks()


def test_a_wrong_name_or_shape_is_refused_and_the_old_weights_keep_serving(tiny_llama, trained, prompts,
                                                                          before_after, tmp_path):
    old, _ = before_after
    llm = LLM(tiny_llama, dtype="float32")
    weights = _tensors(trained)
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(n, t) for n, t in weights.items() if n != name] + [(name, torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \[3, 3\]"):
        llm.update_weights(bad)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.gate.weight' is not a tensor of this model"):
        llm.update_weights([("model.layers.0.mlp.gate.weight", torch.zeros(3))])
    # A checkpoint directory with one wrong shape: checked from its headers before anything loads.
    from safetensors.torch import save_file

    save_file({**weights, name: torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight' has shape"):
        llm.update_weights_from_disk(str(tmp_path))
    assert llm.weight_version == "0" and [o.outputs[0].token_ids for o in _run(llm, prompts)] == old
    # A model kept in GGUF blocks is checked by the checkpoint's dense names and shapes alike.
    gguf = LLM(None, max_model_len=256)
    gguf.check_weights({"model.norm.weight": [576], "model.layers.0.self_attn.q_proj.weight": [576, 576]})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' has shape \[576, 18\]"):
        gguf.check_weights({"model.layers.0.self_attn.q_proj.weight": [576, 18]})


def test_update_from_tensors_and_over_a_gloo_group(tiny_llama, trained, prompts, before_after):
    """A trainer (here a thread: rank 0 of a gloo group) broadcasts each tensor; the engine receives
    them into the model's shards."""
    _, new = before_after
    weights = _tensors(trained)
    llm = LLM(tiny_llama, dtype="float32")
    assert llm.update_weights(list(weights.items()), version="step-1") == "step-1"
    assert [o.outputs[0].token_ids for o in _run(llm, prompts)] == new

    llm = LLM(tiny_llama, dtype="float32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = list(weights)
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            group = WeightUpdateGroup("127.0.0.1", port, 0, 2)
            for name in names:
                group.broadcast(weights[name].clone())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2)
    llm.check_weights({n: list(weights[n].shape) for n in names})
    version = llm.update_weights_from_distributed(names, [str(weights[n].dtype).removeprefix("torch.")
                                                          for n in names], [list(weights[n].shape) for n in names])
    thread.join()
    assert not errors and version == "1"
    assert [o.outputs[0].token_ids for o in _run(llm, prompts)] == new


def test_pause_keep_abort_wait_and_resume(tiny_llama, trained, prompts):
    """keep: requests wait with their KV, an update lands, they go on and say which tokens came from
    which weights; abort: they end with what they generated, finish reason "abort"; wait: running
    requests finish, waiting ones stay until resume; an update with no pause waits for running
    requests to finish (none spans two versions)."""

    async def main() -> None:
        engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32", max_num_seqs=2)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

        async def collect(rid: str, prompt: list[int]):
            last = None
            async for out in engine.generate(rid, prompt, params):
                last = out
            return last

        async def pause_when(condition, mode: str) -> None:
            """Pause at the step boundary where `condition()` first holds: checked after each step
            (the engine's on-step hook), not by polling from here, which let the tiny model's steps
            run past the point on a busy machine (every request done before an abort landed)."""
            reached = asyncio.Event()
            engine.on_step = lambda: condition() and reached.set()
            if condition():
                reached.set()
            await reached.wait()
            engine.on_step = None
            await engine.pause(mode)

        # keep -> update -> resume: the streams span the update
        tasks = [asyncio.create_task(collect(f"k{i}", p)) for i, p in enumerate(prompts[:2])]
        await pause_when(lambda: engine.engine.output.num_generation_tokens >= 10, "keep")
        produced = engine.engine.output.num_generation_tokens
        await asyncio.sleep(0.2)
        assert engine.engine.output.num_generation_tokens == produced        # nothing steps
        assert await engine.update_weights_from_disk(trained) == "1"
        await engine.resume()
        for out in await asyncio.gather(*tasks):
            (first, v0), (switch, v1) = out.outputs[0].weight_versions
            assert (first, v0, v1) == (0, "0", "1") and 0 < switch < 40 and out.weight_version == "1"
            assert out.outputs[0].finish_reason == "length"

        # abort: partial outputs, finish reason "abort"
        tasks = [asyncio.create_task(collect(f"a{i}", p)) for i, p in enumerate(prompts[2:4])]
        await pause_when(lambda: engine.engine.output.num_generation_tokens >= produced + 100, "abort")
        for out in await asyncio.gather(*tasks):
            assert out.finished and out.outputs[0].finish_reason == "abort"
            assert 0 < len(out.outputs[0].token_ids) < 40
        await engine.resume()

        # wait: two run to the end, the third waits until resume
        tasks = [asyncio.create_task(collect(f"w{i}", p)) for i, p in enumerate(prompts[4:7])]
        await pause_when(lambda: len(engine.engine.scheduler.running) >= 2, "wait")
        assert not engine.engine.scheduler.running and len(engine.engine.scheduler.waiting) == 1
        assert all(out.outputs[0].finish_reason == "length" for out in await asyncio.gather(*tasks[:2]))
        await asyncio.sleep(0.2)
        assert not tasks[2].done() and len(engine.engine.scheduler.waiting) == 1
        await engine.resume()
        assert (await tasks[2]).outputs[0].finish_reason == "length"

        # An update without a pause: the running requests finish under the weights they started
        # with (a "wait" pause around it), so none spans two versions; then it lands.
        tasks = [asyncio.create_task(collect(f"u{i}", p)) for i, p in enumerate(prompts[:2])]
        while not engine.engine.scheduler.running:
            await asyncio.sleep(0.01)
        assert await engine.update_weights_from_disk(tiny_llama) == "2"
        outs = await asyncio.gather(*tasks)
        assert all(len(out.outputs[0].weight_versions) == 1 for out in outs)        # no span
        assert ["1"] in [[v for _, v in out.outputs[0].weight_versions] for out in outs]
        assert engine.engine.weights.paused is None
        engine.engine.check_no_leaks()
        await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("family", ["gemma3", "mixtral"])
def test_updates_reach_gemma_norms_and_moe_experts(family, request, tmp_path):
    """Gemma's norms load as 1 + weight and Mixtral's experts through their own loader: an update
    from disk of a perturbed checkpoint answers as a fresh engine of it does."""
    from safetensors.torch import save_file

    path = request.getfixturevalue(f"tiny_{family}")
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(path, name), tmp_path / name)
    g = torch.Generator().manual_seed(3)
    save_file({n: (t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)).contiguous()
               for n, t in _tensors(path).items()}, str(tmp_path / "model.safetensors"))
    prompts = mixed_prompts(1000, seed=5)
    llm = LLM(path, dtype="float32")
    before = [o.outputs[0].token_ids for o in _run(llm, prompts)]
    llm.update_weights_from_disk(str(tmp_path))
    after = [o.outputs[0].token_ids for o in _run(llm, prompts)]
    assert after != before
    assert after == [o.outputs[0].token_ids for o in _run(LLM(str(tmp_path), dtype="float32"), prompts)]


def test_a_partial_update_redoes_only_what_it_wrote(tiny_llama, trained, prompts):
    """One tensor updated alone answers as the whole checkpoint with that tensor changed does (the
    partial load repacks only the layer it wrote)."""
    name = "model.layers.1.mlp.down_proj.weight"
    new = _tensors(trained)[name]
    partial = LLM(tiny_llama, dtype="float32")
    partial.update_weights([(name, new)])
    whole = LLM(tiny_llama, dtype="float32")
    whole.update_weights([(n, new if n == name else t) for n, t in _tensors(tiny_llama).items()])
    untouched = [o.outputs[0].token_ids for o in _run(LLM(tiny_llama, dtype="float32"), prompts)]
    got = [o.outputs[0].token_ids for o in _run(partial, prompts)]
    assert got == [o.outputs[0].token_ids for o in _run(whole, prompts)] and got != untouched


def test_a_prompt_half_computed_at_the_update_is_computed_again(tiny_llama, trained, before_after):
    """A request whose prompt is part way through chunked prefill (no token yet) when the weights
    change computes its prompt again: its output is wholly the new weights'."""
    from engine.llm_engine import LLMEngine
    from records.config_resolution import engine_config

    ids = mixed_prompts(1000, seed=31)[-1]         # 130 tokens: three chunks of 48
    engine = LLMEngine(engine_config(tiny_llama, dtype="float32", max_num_batched_tokens=48))
    engine.add_request("r", None, ids, GREEDY)
    engine.step()
    assert engine.scheduler.requests["r"].num_computed_tokens == 48
    engine.weights.from_disk(trained)
    assert engine.scheduler.requests["r"].num_computed_tokens == 0
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.outputs[0].token_ids == before_after[1][-1] and out.outputs[0].weight_versions == [(0, "1")]
    engine.check_no_leaks()


def test_an_update_under_lora_keeps_serving_the_adapters(tiny_llama, trained, prompts, tmp_path):
    """With LoRA on, an update changes the base weights under the adapters: a request with an
    adapter then answers as a fresh engine of the new weights with the same adapter."""
    from helpers import make_adapter

    from records.lora import LoRARequest

    adapter = LoRARequest("a", 1, make_adapter(tiny_llama, str(tmp_path / "a"), 8, ["q_proj", "v_proj", "down_proj"],
                                               seed=1))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, lora_request=adapter)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=8)
    before = run(llm)
    llm.update_weights_from_disk(trained)
    after = run(llm)
    assert after != before and after == run(LLM(trained, dtype="float32", enable_lora=True, max_lora_rank=8))


def test_fp8_layers_take_updates_quantized_as_a_fresh_load_would(tiny_llama, trained, prompts, tmp_path):
    """A model whose projections are kept in fp8 (quantized at load) takes the trainer's dense
    tensors quantized the same way: the whole checkpoint answers as a fresh fp8 engine of the new
    weights; one projection of a fused layer (q of qkv, up of gate/up) alone leaves its other shards
    as they were (the layer goes back to its loaded form, then is processed again)."""
    from safetensors.torch import save_file

    fp8 = {"dtype": "float32", "quantization": "fp8"}
    new = _tensors(trained)
    llm = LLM(tiny_llama, **fp8)
    assert llm.llm_engine.executor.worker.runner.model.layers[0].self_attn.qkv_proj.qtype == "fp8"
    llm.update_weights(list(new.items()))
    assert [o.outputs[0].token_ids for o in _run(llm, prompts)] == [
        o.outputs[0].token_ids for o in _run(LLM(trained, **fp8), prompts)]

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    mixed = {n: new[n] if n in names else t for n, t in _tensors(tiny_llama).items()}
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama, name), tmp_path / name)
    save_file(mixed, str(tmp_path / "model.safetensors"))
    partial = LLM(tiny_llama, **fp8)
    partial.update_weights([(n, new[n]) for n in names])
    got = [o.outputs[0].token_ids for o in _run(partial, prompts)]
    assert got == [o.outputs[0].token_ids for o in _run(LLM(str(tmp_path), **fp8), prompts)]
    assert got != [o.outputs[0].token_ids for o in _run(LLM(tiny_llama, **fp8), prompts)]


def test_gguf_blocks_take_updates_quantized_as_llama_cpp_does():
    """The embedded model kept in its GGUF blocks (with dense copies for large batches) takes dense
    tensors quantized to each layer's own type, byte for byte as gguf-py's quantizers make them,
    a fused layer's other shards kept; it then answers as the same model served dense (fp32) with
    those blocks' values pushed in: a batch with a long prefill (the dense copies, made again) and
    a few short rows (the blocks' kernel). The embedding (tied to the LM head) included."""
    import gguf

    from kernels.gguf_format import dequantize_gguf, quantize_gguf

    blocks = LLM(dtype="float32", quantization="gguf+dense", max_model_len=512)
    dense = LLM(dtype="float32", quantization="none", max_model_len=512)
    qmodel = blocks.llm_engine.executor.worker.runner.model
    dmodel = dense.llm_engine.executor.worker.runner.model
    q_rows = dmodel.layers[0].self_attn.q_size
    current = {"model.layers.0.self_attn.q_proj.weight": (dmodel.layers[0].self_attn.qkv_proj, slice(0, q_rows)),
               "model.layers.2.mlp.down_proj.weight": (dmodel.layers[2].mlp.down_proj, slice(None)),
               "model.embed_tokens.weight": (dmodel.embed_tokens, slice(None))}
    qlayers = {"model.layers.0.self_attn.q_proj.weight": qmodel.layers[0].self_attn.qkv_proj,
               "model.layers.2.mlp.down_proj.weight": qmodel.layers[2].mlp.down_proj,
               "model.embed_tokens.weight": qmodel.embed_tokens}
    k_before = qmodel.layers[0].self_attn.qkv_proj.weight[q_rows:].clone()
    g = torch.Generator().manual_seed(11)
    new = {n: layer.weight[rows] + 0.01 * torch.randn(layer.weight[rows].shape, generator=g)
           for n, (layer, rows) in current.items()}
    qtypes = {n: qlayers[n].qtype for n in new}
    assert set(qtypes.values()) <= {"Q8_0", "Q4_0", "Q4_1"} and None not in qtypes.values()
    blocks.update_weights(list(new.items()))
    dense.update_weights([(n, dequantize_gguf(quantize_gguf(w, qtypes[n]), qtypes[n])) for n, w in new.items()])
    for n, w in new.items():
        theirs = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, qtypes[n]))
        assert torch.equal(qlayers[n].weight[:len(w)], torch.from_numpy(theirs)), n
    assert torch.equal(qmodel.layers[0].self_attn.qkv_proj.weight[q_rows:], k_before)
    assert qmodel.layers[2].mlp.down_proj.dense is not None
    prompts = [[1, 504, 3458, 282, 4055, 314, 253], list(range(100, 300))]
    prompts += [[1, 30 + i, 700 + 3 * i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [[[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                            use_tqdm=False)] for batch in (prompts, prompts[-3:])]
            for llm in (blocks, dense)]
    assert outs[0] == outs[1]


def test_an_adapter_takes_updates_as_an_rl_policy(tiny_llama, prompts, tmp_path):
    """An RL policy trained as a LoRA adapter over a frozen base: the trainer's adapter tensors (PEFT
    names) replace the served adapter's, from tensors (some, then all) and from a PEFT directory,
    while requests without it keep the base; each time the engine answers as a fresh engine
    serving an adapter of those tensors. A name or shape the adapter lacks is refused by name."""
    from helpers import make_adapter
    from safetensors.torch import load_file, save_file

    from records.lora import ADAPTER_WEIGHTS, LoRARequest

    targets = ["q_proj", "v_proj", "down_proj"]
    first = make_adapter(tiny_llama, str(tmp_path / "first"), 8, targets, seed=1)
    trained = make_adapter(tiny_llama, str(tmp_path / "trained"), 8, targets, seed=2)
    new = load_file(os.path.join(trained, ADAPTER_WEIGHTS))
    lora = {"enable_lora": True, "max_lora_rank": 8, "dtype": "float32"}

    def run(llm: LLM, path: str | None) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                lora_request=LoRARequest("policy", 1, path) if path else None)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                             use_tqdm=False)]

    policy = LoRARequest("policy", 1, first)
    llm = LLM(tiny_llama, **lora)
    base, before = run(llm, None), run(llm, first)
    # Some tensors: the adapter of the first's tensors with those replaced.
    some = {n: t for n, t in new.items() if ".layers.0." in n}
    mixed = tmp_path / "mixed"
    shutil.copytree(first, mixed)
    save_file({**load_file(os.path.join(first, ADAPTER_WEIGHTS)), **some}, str(mixed / ADAPTER_WEIGHTS))
    assert llm.update_weights(list(some.items()), lora_request=policy) == "1"
    assert run(llm, first) == run(LLM(tiny_llama, **lora), str(mixed)) != before
    # All of them, then back from the first adapter's directory.
    llm.update_weights(list(new.items()), lora_request=policy)
    after = run(llm, first)
    assert after == run(LLM(tiny_llama, **lora), trained) != before and run(llm, None) == base
    assert llm.update_weights_from_disk(first, lora_request=policy) == "3" and run(llm, first) == before
    name = next(iter(new))
    with pytest.raises(ValueError, match=rf"'{name}' has shape \[3, 3\]; this adapter's is"):
        llm.update_weights([(name, torch.zeros(3, 3))], lora_request=policy)
    with pytest.raises(ValueError, match="'model.norm.weight' is not a tensor of this adapter"):
        llm.check_weights({"model.norm.weight": [64]}, lora_request=policy)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(tiny_llama, dtype="float32").update_weights(list(new.items()), lora_request=policy)
    assert llm.weight_version == "3" and run(llm, first) == before
