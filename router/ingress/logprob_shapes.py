"""Logprobs as the responses write them: OpenAI's legacy completions shape (tokens, token_logprobs,
top_logprobs, text_offset), its chat shape (per token its logprob, bytes and top_logprobs) and
vLLM's `prompt_logprobs`. The engine ranks each entry already (records/outputs.py: `Logprob`), so
nothing here sorts. A token is named by its text, or, with vLLM's `return_tokens_as_token_ids`, as
"token_id:<id>" (exact where a token alone is not valid UTF-8).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from records.outputs import Logprob


def token_id_name(token_id: int, lp: Logprob | None = None) -> str:
    return f"token_id:{token_id}"


class LogprobShapes:
    """One request's logprobs writer. `token_text(token_id, logprob)`: a token's text (the
    preparer's); `as_ids`: name generated and echoed tokens "token_id:<id>" (vLLM's
    return_tokens_as_token_ids; prompt_logprobs' decoded_token stays text, as in vLLM)."""

    def __init__(self, token_text: Callable[[int, Logprob | None], str], as_ids: bool = False) -> None:
        self.token_text = token_text
        self.name = token_id_name if as_ids else token_text

    def completion(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                   prompt_ids: list[int] = (), prompt_logprobs: list[dict[int, Logprob] | None] = ()
                   ) -> dict[str, Any]:
        """OpenAI's legacy shape; with echo the prompt's tokens come first (the first has no logprob:
        None, as in vLLM and OpenAI)."""
        name = self.name
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, entry in [*zip(prompt_ids, prompt_logprobs), *zip(token_ids, logprobs or [])]:
            if entry is None:
                tokens.append(text := name(tid, None))
                token_lps.append(None)
                tops.append(None)
            else:
                tokens.append(text := name(tid, entry.get(tid)))
                token_lps.append(entry[tid].logprob if tid in entry else None)
                tops.append({name(t, lp): lp.logprob for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, entries: list[dict[int, Logprob] | None], num: int) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token null (the first, which nothing predicts) or
        {token id: {logprob, rank, decoded_token}} for the `num` most likely tokens and the prompt's
        own. The engine ranks only the top `num`: a prompt token outside them has rank null."""
        out: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            out.append({str(tid): {"logprob": lp.logprob, "rank": rank if rank <= num else None,
                                   "decoded_token": self.token_text(tid, lp)}
                        for rank, (tid, lp) in enumerate(entry.items(), start=1)})
        return out

    def chat(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, num_top: int
             ) -> dict[str, Any]:
        """OpenAI's chat shape: the chosen token's logprob and the `num_top` most likely tokens."""
        name, content = self.name, []
        for tid, entry in zip(token_ids, logprobs or []):
            chosen = entry.get(tid)
            text = name(tid, chosen)
            top = []
            for t, lp in list(entry.items())[:num_top]:
                other = name(t, lp)
                top.append({"token": other, "logprob": lp.logprob, "bytes": list(other.encode())})
            content.append({"token": text, "logprob": chosen.logprob if chosen else None,
                            "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}
