"""Structured outputs: grammars compiled by xgrammar, one matcher per constrained request, and the
token bitmask those matchers put on the logits before sampling.

- `compiler_for(model, gguf_file, vocab_size)`: one xgrammar GrammarCompiler per model and process
  (its TokenizerInfo is built once from the model's tokenizer, with the logits' width as the
  vocabulary); `compile` turns a StructuredOutputsParams into a CompiledGrammar, cached by its
  canonical text (xgrammar's own cache), or raises ValueError naming the field and the reason. The
  engine compiles a request's grammar when it is added, so a bad schema is refused before it is
  queued (HTTP 400), and the model runner of the same process then finds it compiled.
- `Constraints` (on the rank that samples): a matcher per constrained request, kept in step with
  the request's output tokens (advanced by the tokens sampled since the last step; rolled back, or
  rebuilt and replayed, when the output shrank, as after a preemption by recompute), and `apply`,
  which fills one bitmask row per constrained row and masks them in the batch's logits in one call
  (xgrammar's `apply_token_bitmask_inplace`). Requests
  without a constraint cost nothing: no matcher, and their mask rows are never applied. With
  speculative decoding, `apply_proposals` masks a request's verification rows: the matcher walks
  the proposals (each row's mask is the state after the proposals before it), stops at the first
  one the grammar refuses, and is rolled back, so only verified tokens ever stay in it. A
  constraint with `start_after` (a thinking model's `</think>`) covers only the output after the
  first place it holds those tokens: until then its rows are left free and its proposals are
  verified up to the one that completes them.

xgrammar was picked over llguidance because both are on the registry as wheels and xgrammar is the
default of vLLM and SGLang, with a CPU path for the mask (a dense int32 bitmask, 1 bit per token).
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from records.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# Up to how many tokens a matcher rolls back when a request's output shrank (a preempted request that
# recomputes keeps its tokens, so this is rare); beyond, the matcher is rebuilt and replays the output.
MAX_ROLLBACK_TOKENS = 16


class GrammarCompiler:
    """Compiles StructuredOutputsParams into xgrammar grammars for one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - only constrained requests need it

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max(1, min(8, os.cpu_count() or 1)))
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> Any:
        kind, text = spec.key
        try:
            # JSON without free whitespace (", " and ": " between items): a model cannot run on in
            # blank lines inside a constrained object, as small models otherwise do.
            if kind == "json":
                return self._compile_json(self.xgr.Grammar.from_json_schema(text, any_whitespace=False))
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "choice":
                return self.compiler.compile_grammar(self.xgr.Grammar.from_regex(_choice_regex(spec.choice)))
            if kind == "structural_tag":
                return self._compile_json(self.xgr.Grammar.from_structural_tag(text))
            return self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_first_line(e)}") from e

    def _compile_json(self, grammar: Any) -> Any:
        """Compile a grammar xgrammar built from JSON schemas, its strings kept to what JSON allows:
        xgrammar (0.2.9) writes a character of a string with minLength / maxLength as
        `_LOOSE_STRING_CHAR`, which lets a raw control character in (a sampled tool call's arguments
        once held U+0015, and json.loads refused them); its strings without bounds already exclude
        U+0000-U+001F."""
        text = str(grammar)
        if _LOOSE_STRING_CHAR not in text:
            return self.compiler.compile_grammar(grammar)
        return self.compiler.compile_grammar(self.xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR,
                                                                                     _JSON_STRING_CHAR)))


# A character of a length-bounded JSON string as xgrammar writes it, and as JSON allows it (no
# escapes in either: a bounded string counts characters, and xgrammar leaves escapes out of it).
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _choice_regex(choices: tuple[str, ...]) -> str:
    specials = set("\\.^$|?*+()[]{}")
    return "|".join("".join("\\" + c if c in specials else c for c in choice) for choice in choices)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[-1] if text else type(e).__name__
    # xgrammar prefixes its messages with "[time] file:line: "
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


_compilers: dict[tuple[str, str | None, int], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(model: str, gguf_file: str | None, vocab_size: int, tokenizer: Any = None) -> GrammarCompiler:
    """The process's compiler for this model, built on first use from `tokenizer` (the engine
    passes its own) or the model's tokenizer loaded here (a GGUF file's takes seconds to convert)."""
    key = (model, gguf_file, vocab_size)
    with _compilers_lock:
        if key not in _compilers:
            if tokenizer is None:
                from engine.text.tokenizer import load_tokenizer  # noqa: PLC0415

                tokenizer = load_tokenizer(model, gguf_file)
            if tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
            _compilers[key] = GrammarCompiler(tokenizer, vocab_size)
        return _compilers[key]


class Constraints:
    """The sampling rank's matchers, one per constrained request (by request id)."""

    def __init__(self, model: str, gguf_file: str | None, vocab_size: int) -> None:
        self.model, self.gguf_file, self.vocab_size = model, gguf_file, vocab_size
        self.matchers: dict[str, tuple[Any, int]] = {}     # request id -> (matcher, tokens it has accepted)
        # request id -> (where its constrained part starts, or None while its start_after has not
        # appeared; how much of the output was searched for it)
        self.starts: dict[str, tuple[int | None, int]] = {}
        self.compiler: GrammarCompiler | None = None      # the process's, looked up on first use

    def apply(self, logits: torch.Tensor, rows: list[tuple[str, StructuredOutputsParams, list[int]]],
              failed: dict[int, str]) -> None:
        """Mask `logits` [num_rows, vocab] (float32, in place): for each constrained row (index, its
        request id, constraint and output tokens so far), every token its grammar does not allow next
        becomes -inf. A row whose matcher cannot follow its own output is put in `failed`."""
        constrained = [(i, rid, spec, out) for i, (rid, spec, out) in enumerate(rows) if spec is not None]
        if not constrained:
            return
        compiler = self._compiler()
        # One bitmask row per row of the batch (all tokens allowed until filled); xgrammar's own
        # kernel masks the filled rows of the logits in one call.
        bitmask = compiler.xgr.allocate_token_bitmask(len(rows), compiler.info.vocab_size)
        index = []
        for i, rid, spec, out in constrained:
            start = self._constrained_start(rid, spec, out)
            if start is None:                  # still before its start_after: free
                continue
            try:
                matcher = self._synced(rid, spec, out, compiler, start)
            except ValueError as e:
                failed[i] = str(e)
                continue
            if matcher.is_terminated():        # past its end (ignore_eos): nothing left to constrain
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            index.append(i)
        if index:
            compiler.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=index)

    def apply_proposals(self, logits: torch.Tensor, rid: str, spec: StructuredOutputsParams, out: list[int],
                        proposals: list[int]) -> int:
        """Mask the k + 1 verification rows `logits` of one request (row j follows `out` plus
        proposals[:j]) and return how many proposals the grammar allows in a row: rows past the
        first proposal it refuses are left as they are, and the caller verifies only the allowed
        prefix. The matcher is rolled back to `out`, so the tokens that verification rejects never
        reach it; ValueError when it cannot follow `out` itself."""
        start = self._constrained_start(rid, spec, out)
        if start is None:
            # Free until start_after: the proposals are verified up to the one that completes it, so
            # the tokens after it are always sampled under the constraint, a step later. Only the
            # output's last tokens can begin a marker that the proposals complete.
            tail = out[max(0, len(out) - len(spec.start_after) + 1):]
            end = _find_end(tail + list(proposals), spec.start_after)
            return len(proposals) if end is None else end - len(tail) - 1
        compiler = self._compiler()
        matcher = self._synced(rid, spec, out, compiler, start)
        bitmask = compiler.xgr.allocate_token_bitmask(logits.shape[0], compiler.info.vocab_size)
        rows, advanced = [], 0
        for j in range(len(proposals) + 1):
            if matcher.is_terminated():          # past its end: nothing left to constrain
                break
            matcher.fill_next_token_bitmask(bitmask, j)
            rows.append(j)
            if j == len(proposals) or not matcher.accept_token(proposals[j]):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        if rows:
            compiler.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return advanced

    def _compiler(self) -> GrammarCompiler:
        if self.compiler is None:
            self.compiler = compiler_for(self.model, self.gguf_file, self.vocab_size)
        return self.compiler

    def _constrained_start(self, rid: str, spec: StructuredOutputsParams, out: list[int]) -> int | None:
        """Where in `out` the constraint starts: 0, or just after the first `spec.start_after` in
        it; None while that has not appeared. The search resumes where the last one stopped; an
        output that shrank below it (a preemption by recompute) is searched anew, and a start that
        moved drops the matcher."""
        marker = spec.start_after
        if not marker:
            return 0
        start, searched = self.starts.get(rid, (None, 0))
        if start is None or start > len(out) or searched > len(out):
            found = _find_end(out, marker, 0 if searched > len(out) else max(0, searched - len(marker) + 1))
            if found != start:
                self.matchers.pop(rid, None)
            start = found
            self.starts[rid] = (start, len(out))
        return start

    def _synced(self, rid: str, spec: StructuredOutputsParams, out: list[int], compiler: GrammarCompiler,
                start: int = 0) -> Any:
        """The request's matcher, having accepted exactly its output tokens `out[start:]`."""
        length = len(out) - start
        entry = self.matchers.get(rid)
        if entry is not None and entry[1] > length:
            matcher, accepted = entry
            if accepted - length <= MAX_ROLLBACK_TOKENS:
                matcher.rollback(accepted - length)
                entry = (matcher, length)
            else:
                entry = None
        if entry is None:
            matcher = compiler.xgr.GrammarMatcher(compiler.compile(spec))
            entry = (matcher, 0)
        matcher, accepted = entry
        for token in out[start + accepted:]:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                self.matchers.pop(rid, None)
                raise ValueError(f"structured_outputs: token {token} does not follow the grammar")
        self.matchers[rid] = (matcher, length)
        return matcher

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.starts.pop(rid, None)


def _find_end(tokens: list[int], marker: tuple[int, ...], begin: int = 0) -> int | None:
    """The index just past the first `marker` in `tokens` that starts at `begin` or later; None if
    there is none."""
    n = len(marker)
    first = marker[0]
    i = begin
    while True:
        try:
            i = tokens.index(first, i, len(tokens) - n + 1)
        except ValueError:
            return None
        if tuple(tokens[i:i + n]) == marker:
            return i + n
        i += 1
