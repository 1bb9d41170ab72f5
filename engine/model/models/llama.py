"""The Llama family: Llama (1-3.x), Mistral, Qwen2 (QKV bias), Qwen3 (per-head RMSNorm of q and k
before the rotary embedding), SmolLM; GQA/MQA, tied embeddings.

Parameters keep HF names except the fused `qkv_proj` and `gate_up_proj`, which load from the HF
q/k/v and gate/up tensors through their weight loaders (see `load_weights`). Tensor parallelism is in
the layers (each shards itself by this process's TP rank); pipeline parallelism builds only this
stage's decoder layers (`start_layer`..`end_layer`), the embedding on the first stage and the final
norm and LM head on the last, and passes (hidden, residual) between stages.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.loading.quant_checkpoint import FP8Weight, quantize_to
from engine.loading.weights import GGUFWeight
from engine.model.layers.attention import Attention, AttentionMetadata
from engine.model.layers.cpu_gemm import Packed, prepack
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.layers.linear import Linear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.model.layers.rmsnorm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model.parallel_state import get_parallel_state, pp_layer_range
from kernels.dispatch import kernels_for
from kernels.gguf_format import dequantize_gguf
from kernels.reference import FP8_DTYPE
from records.model_source import attention_windows


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, qk_norm: bool = False,
                 window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        """window: this layer's sliding window (None: whole context); scale: the scores' (default
        head_dim ** -0.5); softcap: the scores' cap; norm: the q/k norms' class (with qk_norm)."""
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias, dtype=dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads   # this rank's
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=o_bias, dtype=dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale, window, softcap)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen3: each head's q and k RMS-normalized over head_dim (weights shared by the heads, so
        # every TP rank holds them whole)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(k.shape)
        q, k = rotary.rotate_(q, k, cos, sin)
        out = self.attn(q, k, v, kv_cache, meta)          # [T, H, d]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu'; got {config.hidden_act!r}")
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=bias, dtype=dtype,
                                                       swiglu=True)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, qk_norm: bool = False,
                 window: int | None = None, mlp: nn.Module | None = None) -> None:
        """mlp: the layer's MLP where it is not Llama's (a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, qkv_bias, o_bias, qk_norm, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, rotary, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False         # Qwen3's per-head norms of q and k
    cpu_decode_plan = True  # its decode step is what engine/worker/cpu_decode.py flattens

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias) for this architecture."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    norm_class: type[RMSNorm] = RMSNorm

    def make_layer(self, config: Any, dtype: torch.dtype, index: int, window: int | None) -> nn.Module:
        """Decoder layer `index` (of the whole model) of this architecture; window: its sliding window
        (None: none)."""
        qkv_bias, o_bias = self.attention_biases(config)
        return LlamaDecoderLayer(config, dtype, qkv_bias, o_bias, self.qk_norm, window)

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = config
        state = get_parallel_state()
        self.is_first_stage, self.is_last_stage = state.is_first_stage, state.is_last_stage
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, state.pp_rank, state.pp_size,
                                                          state.layer_partition)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # The last stage needs the embedding too when the LM head is tied to it.
        needs_embedding = self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                             if needs_embedding else None)
        windows = attention_windows(config)
        self.layers = nn.ModuleList(self.make_layer(config, dtype, i, windows[i])
                                    for i in range(self.start_layer, self.end_layer))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype) if self.is_last_stage else None
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(config), dtype)
        self.tied_packed: Packed | None = None     # prepacked embedding for tied logits
        self.head_packed: Packed | None = None
        self.lm_head = None
        if self.is_last_stage and not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: this stage's layers. On the last stage returns the
        final hidden states [T, hidden]; on earlier ones (hidden, residual) stacked: [2, T, hidden],
        which is the next stage's `intermediate`. `inputs_embeds`: the first stage's input
        embeddings when they are not the tokens' own (images: engine/worker/encoder_cache.py)."""
        ropes = self.layer_ropes(positions)
        if self.is_first_stage:
            hidden, residual = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds), None
        else:
            assert intermediate is not None
            hidden, residual = intermediate[0], intermediate[1]
        for layer, kv_cache, (cos, sin, rotary) in zip(self.layers, kv_caches, ropes, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, rotary, kv_cache, meta)
        if not self.is_last_stage:
            return torch.stack([hidden, residual])
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states (Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, RotaryEmbedding]]:
        """Each of this stage's layers' (cos, sin, rotary) at these positions: one rope for all of
        them here (Gemma 3's local layers have their own)."""
        cos, sin = self.rotary.lookup(positions)
        return [(cos, sin, self.rotary)] * len(self.layers)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       model_dtype: bool = False) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (gathered over the TP ranks: call on all of them).
        `out`: a float32 buffer of at least [N, this rank's vocabulary rows] to convert into, so a
        low-precision model's step does not allocate the float32 logits anew (see ModelRunner).
        `model_dtype`: leave them in the model's dtype (what a greedy argmax needs, on one rank)."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        packed = self.tied_packed if self.lm_head is None else self.head_packed
        local = head.logits(hidden, packed)
        if local.dtype != torch.float32 and not model_dtype:
            local = local.float() if out is None else out[:local.shape[0], :local.shape[1]].copy_(local)
        return head.gather_logits(local)

    # Submodules whose parameters load apart from the language model's (a vision tower: llava.py).
    loaded_apart: tuple[str, ...] = ()
    # HF name fragment -> (our fused parameter fragment, shard id)
    _fused = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]],
                     dense_copies: bool = False, partial: bool = False) -> None:
        """Load HF-named tensors (GGUFWeights: kept in their blocks; with `dense_copies` each such layer
        also keeps its weight dense for large batches); ValueError if any parameter was left unloaded,
        unless `partial` (a weight update into a loaded model: engine/worker/weight_sync.py)."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith(self.loaded_apart)}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name.startswith("layers."):           # renumber to this stage's layers; skip others'
                index = int(name.split(".")[1])
                if not self.start_layer <= index < self.end_layer:
                    continue
                name = f"layers.{index - self.start_layer}." + name.split(".", 2)[2]
            shard = None
            mapped = self.remap_weight(name)
            if mapped is not None:
                name, shard = mapped
            else:
                for frag, (fused, shard_id) in self._fused.items():
                    if f".{frag}." in name:
                        name, shard = name.replace(f".{frag}.", f".{fused}."), shard_id
                        break
            param = params.get(name)
            if param is None:
                continue                      # e.g. unused buffers some checkpoints carry
            if param.dtype in (torch.uint8, FP8_DTYPE) and not isinstance(tensor, (GGUFWeight, FP8Weight)):
                # A dense tensor for a layer kept quantized (a weight update): quantized to its type.
                tensor = quantize_to(tensor, self.get_submodule(name.rsplit(".", 1)[0]).qtype)
            if isinstance(tensor, (GGUFWeight, FP8Weight)):
                param = params[name] = self._quantized_param(name, param, tensor.qtype)
            else:
                tensor = tensor.to(param.dtype)
            param.weight_loader(param, tensor, shard)
            loaded.add(name if shard is None else f"{name}:{shard}")
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + ":") for k in loaded)]
        if missing and not partial:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:5]}")
        # (a partial load redoes only the layers it wrote: a trainer's update of some of them)
        touched = {n.split(":")[0].rsplit(".", 1)[0] for n in loaded}
        for module_name, module in self.named_modules():
            if isinstance(module, Linear) and (not partial or module_name in touched):
                module.process_weights_after_loading(dense_copies)
        self.head_packed = _head_packed(self.lm_head, dense_copies) if self.lm_head is not None else None
        if self.lm_head is None and self.is_last_stage:
            self.tied_packed = _head_packed(self.embed_tokens, dense_copies)

    def remap_weight(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for a checkpoint name (after `model.` and with this stage's
        layer numbers) that the fused-projection rule does not cover; None: that rule applies."""
        return None

    def _quantized_param(self, name: str, param: nn.Parameter, qtype: str) -> nn.Parameter:
        """The parameter `name` as GGUF blocks of `qtype`: its layer switches to them on the first
        such tensor (a fused layer's shards must share one type)."""
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if not isinstance(module, (Linear, VocabParallelEmbedding)) or not name.endswith(".weight"):
            raise ValueError(f"{name}: a {qtype} tensor where pdserve keeps dense weights")
        if module.qtype is None:
            module.quantize_as(qtype)
        elif module.qtype != qtype:
            raise ValueError(f"{name}: the shards of one fused layer must share a GGUF type; got {qtype} after "
                             f"{module.qtype} (quantization='none' dequantizes them)")
        elif isinstance(module, Linear):
            module.load_form()                # (processed already: a weight update rewrites it)
        return module.weight


def _head_packed(head: VocabParallelEmbedding, dense_copies: bool) -> Packed | None:
    """The LM head's prepacked dense weight (a GGUF head's: of its dense copy, with `dense_copies`);
    a GGUF head also gets its blocks in its kernel set's form (`logit_blocks`)."""
    if head.qtype is None:
        return prepack(head.weight)
    head.logit_blocks = kernels_for(head.weight).pack_gguf(head.weight.data, head.qtype)
    if not dense_copies:
        return None
    head.dense = dequantize_gguf(head.weight.data, head.qtype, head.dtype)
    return prepack(head.dense)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
