"""ModelRunner: turns a SchedulerOutput into input tensors, runs the model once, samples.

Batch layout: decode requests (one new token) first, then prefill segments, so attention handles
all decodes in one batched call. With pipeline stages a step's requests run as several micro-batches
(`pipeline_micro_batches`, default pp_size), so that stage s + 1 works on one while stage s runs the
next. Logits are computed only for rows that sample (the last token of a
request whose KV is now complete; with speculative decoding, also each proposed token's row, which
engine/sample/rejection_sampler.py verifies) and for rows that want prompt logprobs.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model.layers.attention import Attention, AttentionBackend
from engine.model.parallel_state import ParallelState, get_parallel_state, pp_recv, pp_send
from engine.sample.penalties import TokenCounts
from engine.sample.rejection_sampler import Verification, verify
from engine.sample.sampler import SamplingRow, greedy_ids, sample, top_logprobs
from engine.sample.structured_output import Constraints
from engine.worker.cpu_decode import CpuDecodePlan
from engine.worker.cuda_graph import CudaGraphRunner
from engine.worker.encoder_cache import EncoderCache
from engine.worker.lora_slots import LoRASlots
from kernels.dispatch import get_kernels
from records.multimodal import mrope_positions
from records.step import ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput

# A pipeline micro-batch has at least this many tokens. Smaller ones do not pay: a stage reads all
# its weights once per micro-batch, and below about this many rows the matmuls are bound by those
# reads (decode), so splitting a decode step doubles each stage's time while it overlaps at most
# two stages (benchmarks/parallel.py: PP=2 decode-heavy, 0.70x of PP=1 split against 1.10x unsplit).
MIN_MICRO_BATCH_TOKENS = 128


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, seed: int = 0,
                 micro_batches: int = 1) -> None:
        self.model = model
        self.micro_batches = micro_batches       # per step, with pipeline stages
        self.block_size = block_size
        self.device = device
        self.kernels = get_kernels(device)
        self.attention = AttentionBackend(self.kernels, device)
        bind_kernels(model, self.kernels, self.attention)
        # The activations' dtype: that of the first floating-point parameter (GGUF layers hold uint8 blocks).
        self.model_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.kv_caches: list[torch.Tensor] = []     # per layer [2, num_blocks, block_size, kvh, d]
        # The cache's tensors: kv_caches itself, or with hybrid groups (records/kv_groups.py: KVGroups)
        # the slot tensors the layers share; blocks are copied, swapped and moved in these.
        self.kv_buffers: list[torch.Tensor] = []
        self.num_kv_groups = 1                      # tables interleaved in each request's block_ids
        self.cpu_caches: list[torch.Tensor] = []    # the swap pool, as kv_buffers
        self.tier_store: Any = None                 # engine/worker/kv_tier_store.py, set by the worker
        self._tier_failed: list[tuple] = []
        # Draws for requests without their own seed.
        self.generator = torch.Generator().manual_seed(seed)
        # Seeded requests' generators, made from their seed when first sampled and kept until they
        # finish (across preemptions, as the request's own stream), on whichever rank samples.
        self.generators: dict[str, torch.Generator] = {}
        self.token_counts: TokenCounts | None = None          # penalties' counts, made when first needed
        self.graph_runner: CudaGraphRunner | None = None     # decode steps replay CUDA graphs
        # CPU decode steps run as a flat plan of kernel calls (engine/worker/cpu_decode.py): built at the
        # first decode step (False: not yet built), once the KV cache exists; None where it does not apply.
        self.decode_plan: CpuDecodePlan | None | bool = False
        self._logits: torch.Tensor | None = None             # see _logits_buffer
        # Structured outputs' matchers (engine/sample/structured_output.py), set by the worker.
        self.constraints: Constraints | None = None
        # The adapter pool (engine/worker/lora_slots.py), set by the worker with LoRA enabled.
        self.lora: LoRASlots | None = None
        # A vision-language model's images' embeddings (engine/worker/encoder_cache.py), set by the
        # worker on the first pipeline stage.
        self.encoder: EncoderCache | None = None

    def set_kv_groups(self, groups: Any) -> None:
        """Hybrid KV groups (KVGroups): each attention layer reads its group's table and slots."""
        attns = [m for m in self.model.modules() if isinstance(m, Attention)]
        assert len(attns) == len(groups.layer_slots), "hybrid KV groups need every layer on this rank"
        for attn, (group, _) in zip(attns, groups.layer_slots, strict=True):
            attn.kv_group = group
        self.num_kv_groups = groups.num_groups

    def capture_cuda_graphs(self, sizes: tuple[int, ...], max_model_len: int) -> bool:
        """Capture the decode step for these batch sizes (after the KV cache exists). Only where the
        attention backend can (CUDA, Triton kernels: padded rows rely on its slot -1) and on a single
        rank, for a model whose decode step has no host reads (`cuda_graphs`, False for MoE: its
        expert counts size the grouped GEMMs); returns whether graphs are in use."""
        state = get_parallel_state()
        if (not sizes or not self.attention.can_capture_cuda_graphs or state.tp_size > 1 or state.pp_size > 1
                or not getattr(self.model, "cuda_graphs", True) or self.num_kv_groups > 1):
            return False
        max_blocks = -(-max_model_len // self.block_size)
        self.graph_runner = CudaGraphRunner(self.model, self.kv_caches, sizes, max_blocks, self.device)
        self.graph_runner.capture()
        return True

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on the driver rank, None on other ranks."""
        k = self.kernels
        k.swap_blocks(self.kv_buffers, self.cpu_caches, sched.swap_out)
        k.swap_blocks(self.cpu_caches, self.kv_buffers, sched.swap_in)
        k.copy_blocks(self.kv_buffers, sched.copy_blocks)
        if sched.tier_loads:     # after the swaps and copies: into new blocks nothing else writes
            self._tier_failed += self.tier_store.run(sched.tier_loads)
        for rid in sched.finished_ids:
            self.generators.pop(rid, None)
            if self.token_counts is not None:
                self.token_counts.release(rid)
        if self.constraints is not None:
            self.constraints.release(sched.finished_ids)
        if not sched.scheduled:
            return ModelRunnerOutput(sampled={})

        state = get_parallel_state()
        output = ModelRunnerOutput(sampled={})
        sends: list[tuple[Any, torch.Tensor]] = []      # (work, tensor) of async sends to wait on
        num = 1
        if state.pp_size > 1:
            tokens = sum(len(r.token_ids) for r in sched.scheduled)
            num = max(1, min(self.micro_batches, tokens // MIN_MICRO_BATCH_TOKENS))
        for group in self._micro_batches(sched.scheduled, num):
            part = self._run_micro_batch(group, state, sends)
            if part is not None:
                output.sampled.update(part.sampled)
                output.spec_sampled.update(part.spec_sampled)
                output.prompt_logprobs.update(part.prompt_logprobs)
                output.pooled.update(part.pooled)
                output.failed.update(part.failed)
        for work, _ in sends:
            work.wait()
        return output if state.is_last_stage and state.is_driver else None

    def take_tier_failed(self) -> list[tuple]:
        """The offload tier's loads that failed since the last call (the worker reports them)."""
        failed, self._tier_failed = self._tier_failed, []
        return failed

    @staticmethod
    def _micro_batches(scheduled: list[ScheduledRequest], num: int) -> list[list[ScheduledRequest]]:
        """The step's requests in `num` micro-batches of about equal token counts (pipeline
        parallelism: stage s runs micro-batch m + 1 while stage s + 1 runs m), each with its decodes
        first so attention handles them in one batched call. Deterministic: every rank splits the
        same SchedulerOutput the same way."""
        if num <= 1 or len(scheduled) < 2:
            return [sorted(scheduled, key=_batch_order)]
        groups: list[list[ScheduledRequest]] = [[] for _ in range(min(num, len(scheduled)))]
        loads = [0] * len(groups)
        for req in sorted(scheduled, key=lambda r: -len(r.token_ids)):
            i = loads.index(min(loads))
            groups[i].append(req)
            loads[i] += len(req.token_ids)
        return [sorted(g, key=_batch_order) for g in groups]

    def _run_micro_batch(self, batch: list[ScheduledRequest], state: ParallelState,
                         sends: list[tuple[Any, torch.Tensor]]) -> ModelRunnerOutput | None:
        """This rank's part of one micro-batch: receive the previous stage's activations, run its
        layers, then send them on (asynchronously: the next micro-batch starts at once) or, on the
        last stage, compute logits and sample (on the driver rank)."""
        input_ids, positions, meta, sample_rows, spec_rows, lp_rows, pool_rows = self._prepare(batch)
        if self.lora is not None:
            self.lora.prepare(batch)
        intermediate = None
        if not state.is_first_stage:             # the previous stage's (hidden, residual)
            cfg = self.model.config
            intermediate = pp_recv((2, input_ids.shape[0], cfg.hidden_size), self.model_dtype, self.device)
        hidden = None
        embeds = self.encoder.inputs_embeds(batch, input_ids) if self.encoder is not None else None
        if embeds is not None or positions.dim() > 1:      # an image's rows (M-RoPE's positions: [3, T])
            hidden = self.model(input_ids, positions, self.kv_caches, meta, intermediate, embeds)
        elif self.graph_runner is not None:
            hidden = self.graph_runner.run(input_ids, positions, meta)
        elif (meta.num_decode_tokens == input_ids.shape[0] and self.lora is None and self.device.type == "cpu"
              and not meta.groups):
            if self.decode_plan is False:
                self.decode_plan = CpuDecodePlan.build(self.model, self.kernels, self.kv_caches)
            if self.decode_plan is not None:
                hidden = self.decode_plan.run(input_ids, positions, self.kv_caches, meta)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, intermediate)   # [T, hidden]
        if not state.is_last_stage:
            hidden = hidden.contiguous()
            sends.append((pp_send(hidden), hidden))     # the tensor lives until its send is done
            return None

        # Embedding requests: this chunk's rows of final hidden states, summed (the scheduler pools).
        pooled = ({req.request_id: (hidden[idx[0]:idx[-1] + 1].float().sum(0).cpu(), len(idx))
                   for req, idx in pool_rows} if pool_rows and state.is_driver else {})
        row_index = ([i for _, i in sample_rows] + [i for _, idx in spec_rows for i in idx]
                     + [i for _, idx in lp_rows for i in idx])
        if not row_index:                                  # only partial prefill chunks here
            return ModelRunnerOutput(sampled={}, pooled=pooled) if pooled else None
        rows = hidden[torch.tensor(row_index, device=hidden.device)]
        if not spec_rows and not lp_rows and state.tp_size == 1 and all(_plain_greedy(r) for r, _ in sample_rows):
            # Every row takes its argmax and nothing else: from the model-dtype logits (a bf16 value
            # and its float32 copy order the same), without the float32 copy, the sampler's per-row
            # work or the full logits crossing to the host (tiny model, batch 256: 8.6 against 14.3 ms).
            ids = greedy_ids(self.model.compute_logits(rows, model_dtype=True)).tolist()
            return ModelRunnerOutput(sampled={req.request_id: SampledToken(t) for (req, _), t in zip(sample_rows, ids)},
                                     pooled=pooled)
        logits = self.model.compute_logits(rows, self._logits_buffer(len(row_index)))
        if not state.is_driver:                  # TP ranks > 0 only took part in the logits gather
            return None
        # The sampler runs where the logits are (on a GPU: no [rows, vocab] copy, no host softmax),
        # and so does verification (the same sampler); grammars' masks and prompt logprobs work on
        # the host.
        if logits.device.type != "cpu" and (lp_rows or any(
                r.sampling_params.structured_outputs is not None for r, _ in (*sample_rows, *spec_rows))):
            logits = logits.cpu()
        num_sample = len(sample_rows)
        output = ModelRunnerOutput(sampled={}, pooled=pooled)
        if sample_rows:
            sampling_rows = [self._sampling_row(r) for r, _ in sample_rows]
            if self.token_counts is None and any(r.params.needs_penalties for r in sampling_rows):
                self.token_counts = TokenCounts()
            masked: dict[int, str] = {}
            if self.constraints is not None:
                self.constraints.apply(logits, [(r.request_id, r.sampling_params.structured_outputs,
                                                 r.output_token_ids) for r, _ in sample_rows], masked)
            tokens, failed = sample(logits[:num_sample], sampling_rows, self.token_counts)
            for i, why in masked.items():
                tokens[i], failed[i] = None, why
            for i, ((req, _), token) in enumerate(zip(sample_rows, tokens)):
                if token is None:
                    output.failed[req.request_id] = failed[i]
                else:
                    output.sampled[req.request_id] = token
        # A request's own verification or prompt logprobs that raise fail that request only.
        offset = num_sample
        verifications: list[Verification] = []
        for req, idx in spec_rows:
            proposals, allowed = req.spec_token_ids, len(req.spec_token_ids)
            try:
                spec = req.sampling_params.structured_outputs
                if spec is not None and self.constraints is not None:
                    # Only the proposals the grammar allows are verified: the rest count as rejected.
                    allowed = self.constraints.apply_proposals(logits[offset:offset + len(idx)], req.request_id,
                                                               spec, req.output_token_ids, proposals)
            except Exception as e:  # noqa: BLE001
                output.failed[req.request_id] = f"verifying proposed tokens failed: {e!r}"
            verifications.append(Verification(self._sampling_row(req), proposals, allowed))
            offset += len(idx)
        if verifications:           # every request's rows drawn at once
            try:
                verified = verify(logits[num_sample:offset], verifications)
            except Exception as e:  # noqa: BLE001
                verified = [f"{e!r}"] * len(verifications)
            for (req, _), result in zip(spec_rows, verified):
                if req.request_id in output.failed:
                    continue
                if isinstance(result, str):
                    output.failed[req.request_id] = f"verifying proposed tokens failed: {result}"
                else:
                    output.spec_sampled[req.request_id] = result
        for req, idx in lp_rows:
            rows = logits[offset:offset + len(idx)]
            try:
                output.prompt_logprobs[req.request_id] = self._prompt_logprobs(req, rows)
            except Exception as e:  # noqa: BLE001
                output.failed[req.request_id] = f"computing prompt logprobs failed: {e!r}"
            offset += len(idx)
        return output

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """A float32 buffer for `rows` rows of this rank's logits, kept across steps (grown by
        half again when too small). Allocating them fresh each step cost more than the LM head at
        batch 256 on CPU: glibc maps allocations over 32 MiB anew each time, and the step then
        page-faults through them (benchmarks/step_overhead.py, docs/perf/journal.md §8)."""
        if self.model_dtype == torch.float32:
            return None
        head = self.model.lm_head if self.model.lm_head is not None else self.model.embed_tokens
        if self._logits is None or self._logits.shape[0] < rows:
            size = rows if self._logits is None else max(rows, self._logits.shape[0] * 3 // 2)
            self._logits = torch.empty(size, head.weight.shape[0], dtype=torch.float32, device=self.device)
        return self._logits

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[ScheduledRequest, int]] = []
        spec_rows: list[tuple[ScheduledRequest, list[int]]] = []    # the rows of 1 + k positions
        lp_rows: list[tuple[ScheduledRequest, list[int]]] = []
        pool_rows: list[tuple[ScheduledRequest, list[int]]] = []   # embedding requests' rows to pool
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        num_groups = self.num_kv_groups
        group_slots: list[list[int]] = [[] for _ in range(num_groups)] if num_groups > 1 else [slots]
        prefill_query_lens: list[int] = []
        prefill_seq_lens: list[int] = []
        # Gemma 3: each prefill segment's images, whose tokens attend to one another both ways.
        both_ways = getattr(self.model, "bidirectional_images", False)
        mrope = getattr(self.model, "mrope", None) is not None          # (its positions: _mrope_positions)
        prefill_spans: list[list[tuple[int, int]]] = []
        for req in batch:
            n = len(req.token_ids)
            base = len(input_ids)
            pos = range(req.start, req.start + n)
            input_ids.extend(req.token_ids)
            if not mrope:
                positions.extend(pos)
            table = req.block_ids
            if num_groups == 1:
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            else:         # group g's table: every num_groups-th entry from g
                for g, out in enumerate(group_slots):
                    out.extend(table[p // bs * num_groups + g] * bs + p % bs for p in pos)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(req.start + 1)
            else:
                prefill_tables.append(table)
                prefill_query_lens.append(n)
                prefill_seq_lens.append(req.start + n)
                if both_ways:
                    prefill_spans.append([(i.offset, i.offset + i.length) for i in req.images
                                          if i.offset < req.start + n and i.offset + i.length > req.start])
            if req.do_sample and req.spec_token_ids:
                spec_rows.append((req, list(range(base + n - 1 - len(req.spec_token_ids), base + n))))
            elif req.do_sample:
                sample_rows.append((req, base + n - 1))
            if req.prompt_logprobs_from is not None:
                # Logits at position p score prompt token p + 1.
                last = min(req.start + n, len(req.prompt_token_ids) - 1)
                lp_rows.append((req, [base + p - req.start for p in range(req.start, last)]))
            pooling = req.sampling_params.pooling if req.sampling_params is not None else None
            if pooling == "mean":
                pool_rows.append((req, list(range(base, base + n))))
            elif pooling == "last" and req.start + n == len(req.prompt_token_ids):
                pool_rows.append((req, [base + n - 1]))
            elif pooling == "cls" and req.start == 0:
                pool_rows.append((req, [base]))
        decode_seq_lens = None
        if decode_tables:
            decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
        metas = []
        for g, group_slot in enumerate(group_slots):
            decode_block_tables = None
            group_decode = decode_tables if num_groups == 1 else [t[g::num_groups] for t in decode_tables]
            if group_decode:
                width = max(len(t) for t in group_decode)
                decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in group_decode],
                                                   dtype=torch.long, device=self.device)
            tables = [torch.tensor(t if num_groups == 1 else t[g::num_groups], dtype=torch.long, device=self.device)
                      for t in prefill_tables]
            metas.append(self.attention.metadata(torch.tensor(group_slot, dtype=torch.long, device=self.device),
                                                 decode_block_tables, decode_seq_lens, tables, prefill_query_lens,
                                                 prefill_seq_lens, prefill_spans if any(prefill_spans) else None))
        meta = metas[0]
        if num_groups > 1:
            meta.groups = metas
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if mrope:
            positions = self._mrope_positions(batch)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos_t, meta, sample_rows, spec_rows, lp_rows, pool_rows

    @staticmethod
    def _mrope_positions(batch: list[ScheduledRequest]) -> list[int] | tuple[list[int], list[int], list[int]]:
        """The rotary positions of an M-RoPE model's step (records/multimodal.py: mrope_positions):
        [3][T] when an image's tokens are in it, else [T] (a text token's three are one)."""
        rows: tuple[list[int], list[int], list[int]] = ([], [], [])
        for req in batch:
            n = len(req.token_ids)
            parts = (mrope_positions(req.start, n, req.images) if req.images
                     else (range(req.start, req.start + n),) * 3)
            for row, part in zip(rows, parts, strict=True):
                row.extend(part)
        return rows[0] if rows[0] == rows[1] == rows[2] else rows

    def _sampling_row(self, req: ScheduledRequest) -> SamplingRow:
        generator = self.generator
        if req.seed is not None:
            generator = self.generators.get(req.request_id)
            if generator is None:
                generator = self.generators[req.request_id] = torch.Generator().manual_seed(req.seed)
                # A request resumed after tokens another replica generated (records/request.py:
                # Continuation) drew once per token there: skip as many, so its stream goes on
                # where the lost replica's stopped (a request's own tokens all come after this).
                for _ in req.output_token_ids:
                    torch.rand((), generator=generator, dtype=torch.float64)
        return SamplingRow(req.sampling_params, generator, req.prompt_token_ids,
                           req.output_token_ids, req.eos_token_ids, req.request_id)

    @staticmethod
    def _prompt_logprobs(req: ScheduledRequest, logits: torch.Tensor) -> list[dict[int, float]]:
        """Logprob (and top-N) of each prompt token scored by this chunk's logits."""
        logprobs = torch.log_softmax(logits, dim=-1)
        first = req.prompt_logprobs_from + 1
        targets = req.prompt_token_ids[first:first + logits.shape[0]]
        num = req.sampling_params.prompt_logprobs
        out = []
        for row, target in zip(logprobs, targets):
            entry = top_logprobs(row, num)
            entry[target] = row[target].item()
            out.append(entry)
        return out


def _plain_greedy(req: ScheduledRequest) -> bool:
    """The sampler would only take this row's argmax: greedy, no penalties, logit bias, allowed or
    bad tokens, no logprobs, and no min_tokens mask left (engine/sample/sampler.py)."""
    p = req.sampling_params
    return (p.is_greedy and not p.needs_penalties and not p.logit_bias and p.allowed_token_ids is None
            and not p.bad_words_token_ids and p.logprobs is None
            and p.structured_outputs is None
            and len(req.output_token_ids) >= p.min_tokens)


def bind_kernels(model: nn.Module, kernels: Any, attention: AttentionBackend) -> None:
    """Give every layer that calls kernels (those with a `kernels` class attribute) this kernel set,
    and every attention layer (a `backend` class attribute) this backend, chosen once per model, so
    the forward pass does not look them up per call (an environment read and a device check, about
    150 times per step of the embedded model)."""
    for module in model.modules():
        if hasattr(type(module), "kernels"):
            module.kernels = kernels
        if hasattr(type(module), "backend"):
            module.backend = attention


def _batch_order(req: ScheduledRequest) -> tuple[bool, int]:
    """Decodes first (one batched attention call), shortest context first: the pure-torch reference
    splits a length-sorted decode batch into groups of similar length to pad less (kernels/reference.py;
    the C++ CPU kernel and the Triton one read each sequence's own blocks and need no order)."""
    is_decode = len(req.token_ids) == 1
    return not is_decode, req.start if is_decode else 0
