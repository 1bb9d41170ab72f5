"""Shared fixtures: tiny random HF models on disk (with the embedded model's tokenizer) and a
block-accounting check after every test; and how the suite is laid out over pytest-xdist's workers.
The helpers the tests share (the transformers oracle, model and adapter makers, prompts, ports) are
in tests/helpers.py.

`make test` runs the suite as two pytest processes side by side: the tests marked `ray` or
`cluster`, one after another (they share one local Ray, and some start and stop Ray clusters of
their own: `ray stop` ends every Ray process of the user), and every other test beside them. On two
cores the processes that Ray and Serve start mostly wait, and the CPU-bound engine and kernel tests
fill that time. A test that starts Ray without the marker fails (`ray_only_where_marked`), so the
split stays true.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys

import pytest
from helpers import save_random_model, use_ports

from records.serving import ServingSpec

# Serve reads its proxies' channel from the environment of Ray's processes: the Ray these tests start
# (and each cluster they start) serves the way the default spec asks (ServingSpec.ray_env).
for _name, _value in ServingSpec().ray_env().items():
    os.environ.setdefault(_name, _value)

# Markers of tests that need Ray (a local instance, or a cluster of their own).
RAY_MARKERS = ("ray", "cluster")


def pytest_configure(config: pytest.Config) -> None:
    """The tests without Ray (`-m "not ray ..."`) and the Ray tests take ports from separate
    halves of tests/helpers.py's range, so that the two processes `make test` runs side by side
    never pick the same port."""
    use_ports(range(26000, 32000) if "not ray" in (config.option.markexpr or "") else range(20000, 26000))


def _needs_ray(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) is not None for m in RAY_MARKERS)


def _ray_is_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def ray_only_where_marked(request):
    """A test without the `ray` or `cluster` marker must not start Ray: it runs beside the Ray
    tests (see the module docstring)."""
    before = _ray_is_initialized()
    yield
    if not before and not _needs_ray(request.node) and _ray_is_initialized():
        pytest.fail(f"{request.node.nodeid} started Ray without the `ray` marker")


@pytest.fixture(autouse=True)
def block_accounting(monkeypatch):
    """Every engine made during a test must end it with no request left and every block free.
    (tests/unit, which makes none and imports no torch, replaces this with its own.)"""
    from engine.llm_engine import LLMEngine

    engines: list[LLMEngine] = []
    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield engines
    for engine in engines:
        engine.check_no_leaks()


class Leaks:
    """What each replica left behind (replica id -> its `leaks()` words); true when nothing is,
    so that `assert eventually_no_leaks(...)` names what was left when it fails."""

    def __init__(self, left: dict[str, str]) -> None:
        self.left = left

    def __bool__(self) -> bool:
        return not self.left

    def __repr__(self) -> str:
        return f"Leaks({self.left})"


@pytest.fixture(scope="session")
def eventually_no_leaks():
    """Block accounting for engine replica actors: `check(replicas, timeout)` is true (a `Leaks`)
    once every replica (id -> actor handle) reports no request left and every KV block free."""
    import time

    def check(replicas: dict, timeout: float = 30.0) -> Leaks:
        import ray

        deadline = time.monotonic() + timeout
        while True:
            words = ray.get([h.leaks.remote() for h in replicas.values()])
            leaks = Leaks({r: w for r, w in zip(replicas, words) if w is not None})
            if leaks or time.monotonic() > deadline:
                return leaks
            time.sleep(0.2)

    return check


@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory):
    """The embedded model's tokenizer, saved once as a plain HF tokenizer directory."""
    from transformers import AutoTokenizer

    from records.gguf_file import gguf_hf_dir
    from records.model_source import embedded_model_path

    # (converted once on this machine, as the engine reads it: parsing the GGUF file again costs ~5 s
    # in each test process; tests/engine/test_quant.py checks the two are the same tokenizer)
    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(gguf_hf_dir(os.path.dirname(path), os.path.basename(path)))
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def _make_model(tmp_path_factory, tokenizer, kind: str) -> str:
    from transformers import (
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if kind == "llama4":
        # four layers: pipeline stages that split them in different ways (1+3 against 2+2)
        common["num_hidden_layers"] = 4
    if kind in ("llama", "llama4"):
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
    elif kind == "gemma2":
        # local (window 12) and global layers; both soft-caps low enough to bite; a query scalar
        # that is not head_dim
        config = Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    elif kind == "gemma3":
        # one local layer (window 12, rope base 10,000) and one global (base 1e6, linear scaling)
        config = Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1000000.0}})
    elif kind == "gemma3_mm":
        # a multimodal checkpoint (a tiny SigLIP tower): pdserve serves its language model
        from transformers import SiglipVisionConfig

        text = Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=12)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=56, patch_size=14)
        config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                              image_token_index=5, boi_token_index=6, eoi_token_index=7)
    elif kind == "phi3":
        # LongRoPE at 8x its original 256 positions (the attention factor applies; the tests'
        # sequences stay within the short factors' range, as transformers switches whole passes)
        half = 16 // 2
        config = Phi3Config(**{**common, "max_position_embeddings": 2048}, original_max_position_embeddings=256,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                             "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                             "original_max_position_embeddings": 256},
                            pad_token_id=0, tie_word_embeddings=False)
    elif kind == "mixtral":
        # eight experts, two per token (as Mixtral 8x7B), sliding window off
        config = MixtralConfig(**{**common, "intermediate_size": 96}, num_local_experts=8, num_experts_per_tok=2,
                               sliding_window=None, tie_word_embeddings=False)
    elif kind == "qwen3_moe":
        # q/k norms; a dense first layer (mlp_only_layers) before a sparse one
        config = Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[0],
                                norm_topk_prob=True, tie_word_embeddings=True)
    elif kind == "qwen2_moe":
        # the gated shared expert; top-k weights left unnormalized (norm_topk_prob off)
        config = Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=96, norm_topk_prob=False, tie_word_embeddings=True)
    elif kind == "mistral_swa":
        # Mistral v0.1's shape: every layer attends to a sliding window (32 tokens: two blocks)
        config = MistralConfig(**common, sliding_window=32, tie_word_embeddings=False)
    else:
        raise AssertionError(kind)
    out = save_random_model(tmp_path_factory, config, f"tiny-{kind}",
                            seed={"llama": 0, "qwen2": 1, "mistral": 2, "qwen3": 3, "llama4": 4, "mistral_swa": 5,
                                  "gemma2": 6, "gemma3": 7, "phi3": 8, "mixtral": 9, "qwen3_moe": 10,
                                  "qwen2_moe": 11, "gemma3_mm": 12}[kind])
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "llama")


@pytest.fixture(scope="session")
def tiny_llama4(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "llama4")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "mistral")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "gemma3")


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smol_tokenizer) -> str:
    """A tiny LLaVA 1.5 (a two-layer CLIP tower on 32x32 images in 8x8 patches: 16 placeholder
    tokens an image, the tiny Llama as its language model), with its processor (CLIP's image
    processor, the tokenizer with an `<image>` token added)."""
    return _make_llava(tmp_path_factory, smol_tokenizer, next_=False)


@pytest.fixture(scope="session")
def tiny_llava_next(tmp_path_factory, smol_tokenizer) -> str:
    """The same as a LLaVA-NeXT ("anyres": 32x32 tiles of the image at the grid resolution among
    32x32 .. 64x64 that fits it best, after the whole image shrunk to one; rows ended by a learned
    newline), with LLaVA-NeXT's processor: an image's token count follows its size."""
    return _make_llava(tmp_path_factory, smol_tokenizer, next_=True)


def _make_llava(tmp_path_factory, smol_tokenizer, next_: bool) -> str:
    import copy

    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    common = dict(vision_config=vision.to_dict(), text_config=text.to_dict(),
                  image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                  vision_feature_layer=-2, vision_feature_select_strategy="default")
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    torch.manual_seed(14 if next_ else 13)
    model = (LlavaNextForConditionalGeneration(LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)) if next_
             else LlavaForConditionalGeneration(LlavaConfig(**common))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or "image_newline" in name:
                p.normal_(0, 0.15)
    out = tmp_path_factory.mktemp("tiny-llava-next" if next_ else "tiny-llava")
    model.save_pretrained(out, safe_serialization=True)
    sizes = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    options = dict(tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    processor = (LlavaNextProcessor(image_processor=LlavaNextImageProcessor(**sizes, image_grid_pinpoints=pinpoints),
                                    **options) if next_
                 else LlavaProcessor(image_processor=CLIPImageProcessor(**sizes), **options))
    processor.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory, smol_tokenizer) -> str:
    """A tiny Qwen2-VL (a two-block vision transformer in 8x8 patches, 2x2 merged: an image of
    16x16 .. 96x96 pixels at about its own size, its token count following it; M-RoPE over a
    Qwen2 language model), with its image processor and the tokenizer with the vision tokens."""
    return _make_qwen_vl(tmp_path_factory, smol_tokenizer, v2_5=False)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory, smol_tokenizer) -> str:
    """The same as a Qwen2.5-VL: RMS-normed gated blocks, the first and last attending within
    2x2-token windows of the image, the middle one over all of it."""
    return _make_qwen_vl(tmp_path_factory, smol_tokenizer, v2_5=True)


@pytest.fixture(scope="session")
def tiny_gemma3_vl(tmp_path_factory, smol_tokenizer) -> str:
    """A tiny Gemma 3 with images in: a two-layer SigLIP tower on 56x56 images (4x4 patches pooled
    to 4 tokens), four language layers (sliding window 12, so an image spans windows), its real
    processor and a tokenizer with Gemma's image tokens."""
    import torch
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out = tmp_path_factory.mktemp("tiny-gemma3-vl")
    smol_tokenizer.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    boi, eoi, image = (tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>",
                                                                     "<image_soft_token>"))
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=12, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    torch.manual_seed(17)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)          # (at 0.15 this deep Gemma repeats one token: a weak oracle)
    model.save_pretrained(out, safe_serialization=True)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}), tokenizer=tokenizer,
                    image_seq_length=4, chat_template=tokenizer.chat_template).save_pretrained(out)
    return str(out)


QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _make_qwen_vl(tmp_path_factory, smol_tokenizer, v2_5: bool) -> str:
    import copy

    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS]
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    common = dict(text_config=text, vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                  video_token_id=ids[3], tie_word_embeddings=False)
    torch.manual_seed(16 if v2_5 else 15)
    if v2_5:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=vision, **common))
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, **common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    out = tmp_path_factory.mktemp("tiny-qwen2_5_vl" if v2_5 else "tiny-qwen2_vl")
    model.eval().save_pretrained(out, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=96 * 96, patch_size=8, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_gemma3_mm(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "gemma3_mm")


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "phi3")


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen2_moe")


@pytest.fixture(scope="session")
def tiny_mistral_swa(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "mistral_swa")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, smol_tokenizer) -> str:
    return _make_model(tmp_path_factory, smol_tokenizer, "qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request) -> str:
    return request.getfixturevalue(f"tiny_{request.param}")


