"""Shared fixtures: tiny random HF models on disk (with the embedded model's tokenizer), the HF
oracle, and a block-accounting check after every test."""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from engine.llm_engine import LLMEngine


@pytest.fixture(autouse=True)
def block_accounting(monkeypatch):
    """Every engine made during a test must end it with no request left and every block free."""
    engines: list[LLMEngine] = []
    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield engines
    for engine in engines:
        engine.check_no_leaks()


@pytest.fixture(scope="session")
def eventually_no_leaks():
    """Block accounting for engine replica actors: `check(replicas, timeout)` is True once every
    replica (id -> actor handle) reports no request left and every KV block free."""
    import time

    def check(replicas: dict, timeout: float = 30.0) -> bool:
        import ray

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(ray.get([h.check_no_leaks.remote() for h in replicas.values()])):
                return True
            time.sleep(0.2)
        return False

    return check


@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory):
    """The embedded model's tokenizer, saved once as a plain HF tokenizer directory."""
    from transformers import AutoTokenizer

    from engine.model_source import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _make_model(tmp_path_factory, tokenizer, kind: str) -> str:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if kind == "llama":
        # llama3 rope scaling and untied embeddings.
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "qwen3":
        # per-head q/k norms, and a head_dim that is not hidden_size / heads (as Qwen3's own)
        config = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    elif kind == "mistral":
        # MQA: one KV head shared by every query head.
        config = MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=None,
                               tie_word_embeddings=False)
    else:
        raise AssertionError(kind)
    out = save_random_model(tmp_path_factory, config, f"tiny-{kind}",
                            seed={"llama": 0, "qwen2": 1, "mistral": 2, "qwen3": 3}[kind])
    tokenizer.save_pretrained(out)
    return out


def save_random_model(tmp_path_factory, config, name: str, seed: int, std: float = 0.15) -> str:
    """A transformers model of this config with random fp32 weights, saved as safetensors; matrices
    drawn with a larger std than HF's 0.02 init, so logits are peaked and well separated."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}")


_hf_cache: dict[str, object] = {}


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _hf_cache:
        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """The oracle: transformers' greedy generate, one prompt at a time (no padding), EOS ignored."""
    model = hf_model(path)
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompt lengths: 1 token, block boundaries (15, 16, 17, 32, 33) and > 100 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 32, 33, 130)]


def make_adapter(base_path: str, out_dir: str, rank: int, targets: list[str], seed: int,
                 alpha: float | None = None, rslora: bool = False) -> str:
    """A PEFT LoRA adapter of the model at `base_path` with random A and B (PEFT starts B at zero,
    which would make every adapter the base model), saved as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_path: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int):
    """The oracle: transformers + PEFT greedy generate on `adapter` (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = hf_model(base_path)
    if adapter is not None:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                          adapter).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs
