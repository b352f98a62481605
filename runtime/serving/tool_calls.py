"""Tool calls: which format a model writes them in, a template for ChatML models whose own cannot
render tools, and the parsers that turn the model's text back into OpenAI ``tool_calls``.

The formats are declared once in ``FORMATS``: each names the xgrammar structural tag that holds
the model to it (``tool_choice`` "required" or a named function: arguments always parse against
the function's schema; "auto": free text, or calls whose arguments parse) and its parser.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

# A ChatML template that renders tools, tool calls and tool results in the Hermes / Qwen2.5 style
# (<tool_call>{"name", "arguments"}</tool_call>), for models whose own template ignores ``tools``.
CHATML_TOOLS_TEMPLATE = (
    "{%- set first = messages[0] if messages else none -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first and first.role == 'system' -%}{{- first.content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You may call one or more functions to answer. The functions, as JSON signatures, are listed "
    "between <tools> and </tools>:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call a function, reply with one JSON object per call, holding the function name and "
    "its arguments, between <tool_call> and </tool_call>:\\n<tool_call>\\n{\"name\": <function name>, "
    "\"arguments\": <arguments object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- if m.content -%}{{- m.content + '\\n' -}}{%- endif -%}"
    "{%- for call in m.tool_calls -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' -}}"
    "{{- call.function.arguments | tojson -}}{{- '}\\n</tool_call>\\n' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _call(name: str, arguments) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the rest is content."""
    calls, kept = [], []
    pos = 0
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue  # not a call: it stays in the content
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(_call(obj["name"], obj.get("arguments", {})))
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """Llama 3.x: the reply is one or more ``{"name": ..., "parameters": {...}}`` objects (after an
    optional ``<|python_tag|>``), separated by ``;`` or whitespace; anything else is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        pos = end
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    return (None, calls) if calls else (text, [])


@dataclass(frozen=True)
class ToolFormat:
    name: str
    grammar_model: str  # xgrammar's get_model_structural_tag key for this format
    marker: str  # text that starts a call: streamed content stops before it
    parse: Callable[[str], tuple[str | None, list[dict]]]


FORMATS = {
    "hermes": ToolFormat("hermes", "qwen_3", "<tool_call>", parse_hermes),  # Qwen2.5, Hermes, ChatML models
    "llama3_json": ToolFormat("llama3_json", "llama", '{"name"', parse_llama3_json),  # Llama 3.1-3.3
}


@dataclass(frozen=True)
class ToolSupport:
    """How this artifact's model takes tools: the format it writes calls in, and the template
    that renders them (None: the model's own)."""
    format: ToolFormat
    template: str | None
    source: str  # said in the load log

    @staticmethod
    def for_template(chat_template: str | None) -> "ToolSupport | None":
        t = chat_template or ""
        if "tools" in t and "<tool_call>" in t:
            return ToolSupport(FORMATS["hermes"], None, "the model's chat template (hermes <tool_call> format)")
        if "tools" in t and "<|start_header_id|>" in t:
            return ToolSupport(FORMATS["llama3_json"], None, "the model's chat template (Llama 3 JSON format)")
        if "<|im_start|>" in t:
            return ToolSupport(FORMATS["hermes"], CHATML_TOOLS_TEMPLATE,
                               "infer's ChatML tool template (hermes <tool_call> format): the model's own ignores tools")
        return None

    def structural_tag(self, tools: list[dict], tool_choice, parallel: bool, max_whitespace: int):
        """xgrammar's structural tag for this format. With "required" the reply is calls only (one, or
        several on their own lines with parallel_tool_calls), then the end: xgrammar's own "required"
        lets free text follow the calls, where a small model wanders until max_tokens."""
        import xgrammar as xgr
        from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

        tag = xgr.get_model_structural_tag(self.format.grammar_model, tools=tools, tool_choice=tool_choice,
                                           reasoning="disabled", parallel_tool_calls=parallel,
                                           max_whitespace_cnt=max_whitespace)
        if tool_choice != "required":
            return tag
        return StructuralTag(format=TagsWithSeparatorFormat(tags=tag.format.tags, separator="\n", at_least_one=True,
                                                            stop_after_first=not parallel))


def content_before_marker(text: str, marker: str) -> str:
    """The part of streamed text that is surely content: up to a call's marker, and short of a tail
    that could still grow into one."""
    at = text.find(marker)
    if at >= 0:
        return text[:at]
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
