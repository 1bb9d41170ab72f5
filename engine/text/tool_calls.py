"""Tool calling (OpenAI's `tools`): the tools in the prompt and the grammar that enforces a tool
choice; engine/text/tool_parser.py reads the calls out of the model's text, whole or as it streams.

A model family writes its calls in its own format; two are read here:
- "hermes" (Hermes, Qwen 2.5/3, SmolLM3 and most ChatML fine-tunes): any text, then one or more
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- "llama3_json" (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`, several
  separated by `;` (after `<|python_tag|>`, a special token the detokenizer drops);
- "mistral" (Mistral 7B v0.3, Nemo, Small 3.1): any text, then `[TOOL_CALLS]` (a special token,
  so the text of such requests keeps special tokens) and a JSON list of `{"name", "arguments"}`;
  call ids are 9 letters and digits, which Mistral's templates insist on when the calls come back.

`ToolFormat.of(tokenizer)` picks the format from the chat template and whether the template
renders tools itself. A template that ignores `tools` (SmolLM2's, the embedded model's) gets them in
a system message in Hermes' words, and the conversation's earlier calls and results as Hermes text,
as llama.cpp's server does for such models; vLLM sends the tools to the template only, where a
template without tool support drops them without a word.

`tool_choice` "required" or a named function is enforced by a grammar: xgrammar's structural tag
for the format (`constraint`), so the output is a well-formed call to an offered tool with
arguments valid under its `parameters` schema. "auto" leaves the model free, except that a tool
declared `strict: true` (OpenAI's promise that arguments follow the schema) puts the same tag on
in its triggered form: text stays free, but a call once begun must be valid.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.text.tool_parser import (
    FORMATS,
    HERMES_BEGIN,
    HERMES_END,
    MISTRAL_BEGIN,
    PYTHON_TAG,
    ToolCall,
    parse_tool_calls,
)

# xgrammar's builtin structural tags for each format (xgrammar.builtin_structural_tag).
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "llama3_json": "llama"}
# Runs of whitespace inside constrained arguments: as the json constraint's any_whitespace=False,
# this keeps a small model from running on in blank lines inside a call.
_MAX_WHITESPACE = 1

_SEPARATOR = {"hermes": "\n", "llama3_json": "; "}     # between parallel calls
_BEGIN = {"hermes": HERMES_BEGIN, "mistral": MISTRAL_BEGIN}   # call tags that may be special tokens

_SYSTEM_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>\n{tools}\n</tools>\n\n")
# How a template without tool support is told to call them, in each format's words.
_SYSTEM = {
    "hermes": _SYSTEM_HEAD + (
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'),
    "llama3_json": _SYSTEM_HEAD + (
        "To call a function, respond only with a JSON object in the format "
        '{{"name": <function-name>, "parameters": <args-json-object>}}; separate several with "; ".'),
    "mistral": _SYSTEM_HEAD + (
        "To call functions, respond with [TOOL_CALLS] followed by a JSON list of "
        '{{"name": <function-name>, "arguments": <args-json-object>}} objects.'),
}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls (`name`, one of FORMATS), whether its chat template renders
    `tools` and tool messages itself (`native`), and whether the call tag is one of the tokenizer's
    special tokens (`special_tag`: then the text must keep special tokens for calls to be read)."""
    name: str
    native: bool
    special_tag: bool = False

    @staticmethod
    def of(tokenizer: Any, override: str | None = None) -> ToolFormat:
        """The format of a tokenizer's chat template; `override` (one of FORMATS) names it instead."""
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):           # named templates: "default", "tool_use", ...
            template = " ".join(str(t) for t in template.values())
        native = _renders_tools(tokenizer)
        if override is not None and override not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {FORMATS}; got {override!r}")
        name = override or "hermes"
        if override is None and native and HERMES_BEGIN not in template:
            if MISTRAL_BEGIN in template:
                name = "mistral"
            elif PYTHON_TAG in template or "ipython" in template:
                name = "llama3_json"
        special = name in _BEGIN and _BEGIN[name] in (getattr(tokenizer, "all_special_tokens", None) or ())
        return ToolFormat(name, native, special)

    # --- prompt ------------------------------------------------------------------------------------
    def template_inputs(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. A native template gets the tools and the calls'
        arguments as objects (what the templates index into); any other gets the tools in a system
        message and the calls and results as text in this format (results in Hermes'
        `<tool_response>` tags)."""
        if self.native:
            return [_arguments_as_objects(m) for m in messages], tools or None
        out: list[dict[str, Any]] = []
        for m in messages:
            role, content = m.get("role"), m.get("content") or ""
            if role == "assistant" and m.get("tool_calls"):
                calls = self._calls_text(m["tool_calls"])
                out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
            elif role == "tool":
                response = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("tool_results"):      # consecutive results: one user turn
                    out[-1]["content"] += "\n" + response
                else:
                    out.append({"role": "user", "content": response, "tool_results": True})
            else:
                out.append({"role": role, "content": content})
        for m in out:
            m.pop("tool_results", None)
        if tools:
            system = _SYSTEM[self.name].format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out, None

    def _calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls as the model would have written them."""
        objects = [_call_object(c) for c in calls]
        if self.name == "hermes":
            return "\n".join(f"{HERMES_BEGIN}\n{json.dumps(o, ensure_ascii=False)}\n{HERMES_END}" for o in objects)
        if self.name == "mistral":
            return MISTRAL_BEGIN + json.dumps(objects, ensure_ascii=False)
        return "; ".join(json.dumps({"name": o["name"], "parameters": o["arguments"]}, ensure_ascii=False)
                         for o in objects)

    # --- grammar -----------------------------------------------------------------------------------
    def constraint(self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool
                   ) -> str | None:
        """The xgrammar structural tag (JSON text) that enforces `tool_choice` over `tools`: None
        when nothing is enforced ("none", or "auto" without a strict tool). ValueError when
        tool_choice names no offered tool."""
        from xgrammar.builtin_structural_tag import get_model_structural_tag  # noqa: PLC0415
        from xgrammar.structural_tag import TagsWithSeparatorFormat, TriggeredTagsFormat  # noqa: PLC0415

        if tool_choice == "none" or not tools:
            return None
        if tool_choice in (None, "auto") and not any(t["function"].get("strict") for t in tools):
            return None
        if self.name == "mistral":
            return _mistral_tag(tools, tool_choice or "auto", parallel_tool_calls)
        tag = get_model_structural_tag(_XGRAMMAR_MODEL[self.name], tools, tool_choice or "auto",
                                       reasoning="disabled", max_whitespace_cnt=_MAX_WHITESPACE,
                                       parallel_tool_calls=parallel_tool_calls)
        if tool_choice == "required" and isinstance(tag.format, TriggeredTagsFormat):
            # xgrammar's "required" lets text follow the calls; OpenAI's answers with calls only
            # (content null), so only calls and the format's separator between them here.
            tag.format = TagsWithSeparatorFormat(tags=tag.format.tags, separator=_SEPARATOR[self.name],
                                                 at_least_one=True, stop_after_first=not parallel_tool_calls)
        return tag.model_dump_json()

    # --- parsing ---------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output in this format (engine/text/tool_parser.py)."""
        return parse_tool_calls(self.name, text)


def _mistral_tag(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> str:
    """The structural tag for Mistral's `[TOOL_CALLS][{"name", "arguments"}, ...]` (xgrammar has
    none built in): the list's items are calls to the offered tools (to the named one only when
    forced), at most one with parallel_tool_calls off."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat  # noqa: PLC0415

    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    items = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f["parameters"] if f.get("parameters") is not None and f.get("strict") is not False
        else {"type": "object"}}, "required": ["name", "arguments"], "additionalProperties": False}
        for f in functions]
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel or isinstance(tool_choice, dict):
        calls["maxItems"] = 1
    content = JSONSchemaFormat(json_schema=calls, max_whitespace_cnt=_MAX_WHITESPACE)
    tag = TagFormat(begin=MISTRAL_BEGIN, content=content, end="")
    if tool_choice == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=[MISTRAL_BEGIN], tags=[tag])).model_dump_json()
    return StructuralTag(format=tag).model_dump_json()


def _renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts `tools` in the prompt (it renders differently with one)."""
    probe = [{"type": "function", "function": {"name": "probe_tool_x", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(messages, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return plain != with_tools


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' `arguments` (JSON text in OpenAI's shape) are objects: the
    templates render them with `tojson` or iterate over them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for c in calls:
        function = dict(c.get("function") or {})
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except ValueError:
                pass                         # left as the text it is
        converted.append({**c, "function": function})
    return {**message, "tool_calls": converted}


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": args}


