"""LLM: the offline API, vLLM's shapes: LLM(model).generate(prompts, params) / .chat(messages) /
.embed(prompts); beam search with SamplingParams(use_beam_search=True, best_of=k, n=...)."""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import records.clock as clock
from engine.beam_search import BeamSearch, check_beam_params, run_offline
from engine.llm_engine import LLMEngine
from engine.text.backend_tokenizer import hf_tokenizer
from engine.text.tokenizer import apply_chat_template
from engine.text.tool_calls import ToolFormat
from records.config_resolution import engine_config
from records.lora import LoRARequest
from records.outputs import CompletionOutput, RequestOutput
from records.request import NewRequest
from records.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An engine in this process. `model=None` loads the embedded default (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args` are `engine_config`'s keywords (records/config_resolution.py; vLLM's names:
        dtype, block_size, max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
        enable_prefix_caching, disable_hybrid_kv_cache_manager, num_kv_blocks, kv_cache_memory_bytes,
        preemption_mode,
        swap_space_bytes, kv_offloading_size (GiB of host memory for evicted prefix blocks),
        kv_offloading_disk_path / kv_offloading_disk_size (GiB), scheduling_policy, seed,
        tensor_parallel_size, pipeline_parallel_size,
        speculative_config={"method": "ngram" | "draft_model", "num_speculative_tokens": k,
        "model": draft path (draft_model), "prompt_lookup_min": 2, "prompt_lookup_max": 4})."""
        config = engine_config(model, **engine_args)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        self._tool_format: ToolFormat | None = None     # how the model writes tool calls, on first chat
        # Garbage collection (or interpreter exit) lets go of the engine's resources too: with
        # TP x PP > 1 its Ray worker actors and their placement group, which would otherwise keep
        # their CPUs/GPUs until the driver exits. The finalizer holds the executor, not self.
        self._finalizer = weakref.finalize(self, _shutdown_executor, self.llm_engine.executor)

    def shutdown(self) -> None:
        """Stop the engine's workers and free what they hold (Ray worker actors and their placement
        group with TP x PP > 1; the KV cache and model in this process). Idempotent; the LLM cannot
        generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- weight updates (RL: engine/weight_updates.py; vLLM's and SGLang's names) -------------------
    @property
    def weight_version(self) -> str:
        """The version of the weights serving now ("0" as loaded; each update's, or its count)."""
        return self.llm_engine.weights.version

    def update_weights(self, weights: list[tuple[str, Any]], version: str | None = None,
                       lora_request: LoRARequest | None = None) -> str:
        """Load HF-named whole tensors into every rank (checked first: ValueError naming a tensor
        the checkpoint does not have with that shape, nothing changed); returns the new version.
        With `lora_request`: PEFT-named tensors of that adapter (an RL policy trained as LoRA)."""
        return self.llm_engine.weights.from_tensors(list(weights), version, lora_request)

    def update_weights_from_disk(self, path: str, version: str | None = None,
                                 lora_request: LoRARequest | None = None) -> str:
        """`update_weights` from a safetensors checkpoint directory of the same model (with
        `lora_request`: a PEFT adapter directory whose tensors replace that adapter's)."""
        return self.llm_engine.weights.from_disk(path, version, lora_request)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, backend: str = "gloo") -> None:
        """Join a trainer's weight-update group (engine/worker/weight_sync.py: WeightUpdateGroup; the
        trainer is rank 0, this engine's ranks rank_offset on); blocks until every member joined."""
        self.llm_engine.weights.join_group(master_address, master_port, rank_offset, world_size, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Receive the trainer's broadcast of these tensors, in this order (check_weights first)."""
        return self.llm_engine.weights.from_group(names, dtypes, shapes, version, lora_request)

    def check_weights(self, shapes: dict[str, list[int]], lora_request: LoRARequest | None = None) -> None:
        """ValueError naming a tensor that an update of these names and shapes would be refused for."""
        self.llm_engine.weights.check(shapes, lora_request)

    def get_tokenizer(self) -> Any:
        """The model's HF tokenizer."""
        return hf_tokenizer(self.llm_engine.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: SamplingParams'
        defaults, with the model's generation_config.json sampling fields over them (vLLM's
        `generation_config="auto"`; "vllm" leaves SamplingParams' own)."""
        return SamplingParams(**dict(self.llm_engine.config.model_config.sampling_defaults))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a str or {"prompt_token_ids": [...]}); outputs in input order.
        A vision-language model's prompt may carry images: {"prompt": "... <image> ...",
        "multi_modal_data": {"image": image or [images]}} (PIL images, encoded bytes or base64 data
        URLs), one placeholder per image. `lora_request`: the adapter to run every prompt under, or
        one per prompt (None: the base model); the LLM needs enable_lora=True.

        All prompts are validated before any runs: a bad one raises ValueError and none are queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._with_lora(self._params_list(sampling_params, len(prompts)), lora_request)
        parsed, images = [], []
        for prompt in prompts:
            mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            if mm:
                ids, inputs = self._images(prompt, mm)
                parsed.append((prompt.get("prompt"), ids))
                images.append(inputs)
            else:
                parsed.append(self._parse_prompt(prompt))
                images.append(())
        return self._run(parsed, params, use_tqdm, images)

    def _images(self, prompt: dict[str, Any], mm: Any) -> tuple[list[int], tuple]:
        """A prompt's token ids and images (records/multimodal.py) from its `multi_modal_data`."""
        if not isinstance(mm, dict) or set(mm) != {"image"}:
            raise ValueError(f"multi_modal_data must be {{'image': image or [images]}}; got "
                             f"{sorted(mm) if isinstance(mm, dict) else type(mm).__name__}")
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("multi_modal_data needs the prompt as text ('prompt'): the model's processor "
                             "puts each image's tokens where its placeholder is")
        images = mm["image"] if isinstance(mm["image"], (list, tuple)) else [mm["image"]]
        if not images:
            raise ValueError("multi_modal_data.image must name at least one image")
        return self.llm_engine.image_processor().process(prompt["prompt"], list(images))

    def _beam_search(self, parsed: list[tuple[str | None, list[int]]], params: list[SamplingParams]
                     ) -> list[RequestOutput]:
        """Beam search for each prompt (engine/beam_search.py), all prompts' beams scored in the
        same engine steps; each output holds the best n beams, best first."""
        engine = self.llm_engine
        max_len = engine.config.model_config.max_model_len
        searches = [(ids, BeamSearch(sp, engine.eos_token_ids, len(ids), max_len))
                    for (_, ids), sp in zip(parsed, params)]

        def score(batch: list[tuple[list[int], SamplingParams]]) -> list[dict[int, float]]:
            ids = [f"beam-{next(self._counter)}" for _ in batch]
            for rid, (tokens, sp) in zip(ids, batch):
                engine.add_request(rid, None, tokens, sp)
            tops: dict[str, dict[int, float]] = {}
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            tops[out.request_id] = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
            except BaseException:
                engine.abort_request(ids)
                raise
            return [tops[rid] for rid in ids]

        run_offline(searches, params, score)
        tokenizer = engine.tokenizer
        outputs = []
        for (prompt, ids), (_, search), sp in zip(parsed, searches, params):
            beams = [CompletionOutput(i, tokenizer.decode(h.token_ids, skip_special_tokens=sp.skip_special_tokens)
                                      if tokenizer is not None else "", h.token_ids, h.cumulative_logprob,
                                      h.logprobs, finish_reason=h.finish_reason,
                                      stop_reason=h.token_ids[-1] if h.finish_reason == "stop" else None)
                     for i, h in enumerate(search.results())]
            outputs.append(RequestOutput(f"beam-{next(self._counter)}", prompt, ids, beams, True))
        return outputs

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`, a Jinja template) to each
        conversation (vLLM's options: the generation prompt, or `continue_final_message`;
        `chat_template_kwargs` as more template variables),
        with `tools` (OpenAI's shape) where given: `ToolFormat.of(llm.get_tokenizer()).parse(text)`
        reads the calls out of an output (engine/text/tool_calls.py)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if self._tool_format is None and getattr(tokenizer, "chat_template", None):
            self._tool_format = ToolFormat.of(tokenizer)     # renders the template twice: once per LLM
        fmt = self._tool_format
        parsed = []
        for conv in conversations:
            conv_tools = tools
            if fmt is not None:
                conv, conv_tools = fmt.template_inputs(list(conv), tools)  # type: ignore[arg-type]
            parsed.append((None, apply_chat_template(tokenizer, conv, conv_tools,  # type: ignore[arg-type]
                                                     add_generation_prompt, continue_final_message,
                                                     chat_template_kwargs, chat_template)))
        return self._run(parsed, self._with_lora(self._params_list(sampling_params, len(parsed)), lora_request),
                         use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling: str | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """An embedding of each prompt (its `embedding`): the final hidden states (after the model's
        last norm) pooled as `pooling` says ("last", "mean" or "cls"; default: the model's own,
        records/model_source.py model_pooling) and L2-normalized unless `normalize` is False. They
        run in the same batches as generations; mean and CLS pooling take no prefix-cache hits."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        mode, norm = self.llm_engine.config.model_config.pooling
        params = SamplingParams(max_tokens=1, pooling=pooling or mode, detokenize=False,
                                normalize=norm if normalize is None else normalize)
        params = self._with_lora([params] * len(prompts), lora_request)
        return self._run([self._parse_prompt(p) for p in prompts], params, use_tqdm)

    def _params_list(self, params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        # A dict (vLLM takes none either) would otherwise be listed as its keys.
        params = list(params) if isinstance(params, (list, tuple)) else [params]
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them; got "
                             f"{type(bad).__name__} (build one: SamplingParams(**{{...}}))")
        if len(params) != n:
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n}; got {len(params)}")
        return params

    @staticmethod
    def _with_lora(params: list[SamplingParams],
                   lora: LoRARequest | Sequence[LoRARequest | None] | None) -> list[SamplingParams]:
        """Each prompt's params with its adapter (`lora_request`: one for all or one per prompt)."""
        if lora is None:
            return params
        loras = [lora] * len(params) if isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != len(params):
            raise ValueError(f"lora_request must be one LoRARequest or a list of {len(params)}; got {len(loras)}")
        return [p if r is None else dataclasses.replace(p, lora_request=r) for p, r in zip(params, loras)]

    @staticmethod
    def _parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError(f"prompts must be str or dict with 'prompt' or 'prompt_token_ids'; "
                         f"got {type(prompt).__name__}")

    def _run(self, parsed: list[tuple[str | None, list[int] | None]], params: list[SamplingParams],
             use_tqdm: bool, images: list[tuple] | None = None) -> list[RequestOutput]:
        """Run the prompts to the end (`images`: each prompt's, records/multimodal.py)."""
        engine = self.llm_engine
        images = images or [()] * len(parsed)
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        if engine.tokenizer is not None:
            parsed = [(p, ids if ids is not None else engine.tokenizer.encode(p)) for p, ids in parsed]
        for (_, ids), sp in zip(parsed, params):
            engine.validate(ids or [], sp)  # all or nothing: validate before queueing any
            if sp.use_beam_search:
                check_beam_params(sp)
        beams = [i for i, sp in enumerate(params) if sp.use_beam_search]
        if any(images[i] for i in beams):
            raise ValueError("use_beam_search: beam search over prompts with images is not supported")
        if beams:       # beam search runs over the engine; the other prompts as usual, beside
            searched = self._beam_search([parsed[i] for i in beams], [params[i] for i in beams])
            rest = [i for i in range(len(params)) if i not in set(beams)]
            plain = self._run([parsed[i] for i in rest], [params[i] for i in rest], use_tqdm,
                              [images[i] for i in rest]) if rest else []
            merged = dict(zip(beams, searched)) | dict(zip(rest, plain))
            return [merged[i] for i in range(len(params))]
        ids = [str(next(self._counter)) for _ in parsed]
        # Only the final outputs are read below: the engine builds no other (its output_kind).
        final = {id(sp): dataclasses.replace(sp, output_kind="final_only") for sp in params}
        arrival = clock.monotonic()
        for rid, (prompt, token_ids), sp, inputs in zip(ids, parsed, params, images):      # (validated above)
            engine.enqueue(NewRequest(rid, prompt, token_ids, final[id(sp)], arrival, images=inputs))
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm  # noqa: PLC0415

            bar = tqdm(total=len(ids), desc="Generating", unit="req")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def _shutdown_executor(executor: Any) -> None:
    try:
        executor.shutdown()
    except Exception:  # noqa: BLE001 - at interpreter exit Ray may already be gone
        pass
