"""The paged engine: one replica's scheduler, KV cache and model.

    from engine import LLM, SamplingParams
    llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    out = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
"""
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
