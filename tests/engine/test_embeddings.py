"""Embeddings (SamplingParams.pooling; LLM.embed) against transformers' hidden states: the final
hidden states after the model's last norm, pooled (last token, mean, first token) and
L2-normalized, in fp32 within 1e-4 of `model.model(ids).last_hidden_state` pooled the same way:
through chunked prefill, batched with generations (which stay token-exact), with prefix-cache hits
for last-token pooling, after a preemption, on a tiny random Llama (the embedded GGUF model's are
checked in tests/engine/test_async_and_text.py, which loads both it and transformers' copy
already). The served endpoint is tests/serving/test_embeddings.py."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from records.model_source import model_pooling

TOL = 1e-4


def run_to_end(engine) -> dict:
    """Step the engine until every request ended; request id -> its final output."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def reference(hf, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def test_pooled_hidden_states_match_transformers_through_chunks_and_beside_generation(tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    # 16-token chunks: the longer prompts are pooled over several steps.
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=16, max_model_len=256, block_size=8)
    prompts = [[(i * 37 + j * 11) % 900 + 5 for j in range(n)] for i, n in enumerate((3, 16, 41, 77))]
    worst = 0.0
    for pooling in ("last", "mean", "cls"):
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], pooling=pooling, use_tqdm=False)
        for ids, out in zip(prompts, outs):
            got = torch.tensor(out.embedding)
            assert got.shape == (hf.config.hidden_size,) and out.outputs[0].finish_reason == "stop"
            assert out.outputs[0].token_ids == []
            worst = max(worst, (got - reference(hf, ids, pooling)).abs().max().item())
    raw = llm.embed({"prompt_token_ids": prompts[2]}, pooling="mean", normalize=False, use_tqdm=False)[0]
    worst = max(worst, (torch.tensor(raw.embedding) - reference(hf, prompts[2], "mean", False)).abs().max().item())
    assert worst <= TOL, f"max abs diff {worst:.2e}"
    print(f"tiny Llama: max abs diff {worst:.2e}")

    # Beside generations in the same steps: both right (every block freed: the block_accounting
    # fixture checks the engine at the end).
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                          use_tqdm=False)]
    embed = SamplingParams(max_tokens=1, pooling="mean", output_kind="final_only")
    final = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="final_only")
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", None, ids, final)
        engine.add_request(f"e{i}", None, ids, embed)
    done = run_to_end(engine)
    for i, ids in enumerate(prompts):
        assert done[f"g{i}"].outputs[0].token_ids == want[i]
        assert (torch.tensor(done[f"e{i}"].embedding) - reference(hf, ids, "mean")).abs().max().item() <= TOL

    # Last-token pooling takes prefix-cache hits (the prompt's blocks from the run above).
    again = llm.embed({"prompt_token_ids": prompts[3]}, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 72
    assert (torch.tensor(again.embedding) - reference(hf, prompts[3], "last")).abs().max().item() <= TOL


def test_sentence_transformers_pooling_config_and_bad_fields(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},'
        ' {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]')
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert model_pooling(str(tmp_path), None) == ("mean", True)
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="only last-token, mean and CLS pooling"):
        model_pooling(str(tmp_path), None)
    with pytest.raises(ValueError, match="pooling must be None or one of"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="n must be 1 for an embedding"):
        SamplingParams(pooling="last", n=2)


def test_embeddings_pooled_again_after_preemption(tiny_llama):
    """A pool too small for the batch preempts by recompute: an embedding preempted mid-prompt pools
    its prompt from the start again (nothing of the lost chunks counted twice)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(tiny_llama, dtype="float32", block_size=8, num_kv_blocks=14, max_num_batched_tokens=16,
              max_model_len=96, preemption_mode="recompute")
    engine = llm.llm_engine
    prompts = [[(i * 53 + j * 5) % 900 + 5 for j in range(40)] for i in range(4)]
    embed = SamplingParams(max_tokens=1, pooling="mean", output_kind="final_only")
    hold = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind="final_only")
    preempted = []
    preempt = engine.scheduler._preempt

    def counting(request, swap_out):
        if request.sampling_params.pooling is not None and request.num_computed_tokens:
            preempted.append(request.request_id)      # mid-prompt, with rows already pooled
        preempt(request, swap_out)

    engine.scheduler._preempt = counting
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", None, ids[:20], hold)
        engine.add_request(f"e{i}", None, ids, embed)
    done = run_to_end(engine)
    assert preempted, "no embedding was preempted mid-prompt: the pool is not small enough"
    for i, ids in enumerate(prompts):
        got = torch.tensor(done[f"e{i}"].embedding)
        assert (got - reference(hf, ids, "mean")).abs().max().item() <= TOL
