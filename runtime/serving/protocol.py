"""The OpenAI wire format: request bodies checked field by field, responses and stream chunks built.

Validation is explicit rather than schema-driven so that every refusal is a 400 whose ``param``
names the offending field and says the allowed range, as the OpenAI API does. Every bound is
checked here before anything is tokenized or queued; the sampling bounds are the engine's own
(``engine/sampling_params.py``), and the OpenAPI schema of the request bodies
(``request_body_schemas``) is built from the same objects, so the schema and the 400s cannot
drift apart. Nothing here touches the engine's state: it needs only a tokenizer, the context
limit, the vocabulary size and the server's fan-out limit (see ``ModelInfo``).

Weighed for the structured-output fields: declaring the bodies as pydantic models (as vLLM does) would
give the schema for free, but its errors name a location path and a pydantic message rather than the
field and its allowed range, and the OpenAPI schema is already built from the same bound objects as
the checks. So the new fields are checked here too; JSON Schemas a client sends are checked with the
``jsonschema`` library against their meta-schema, and compiled (``engine/structured.py``) while the
request is parsed, in its worker thread.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field

from ..engine.sampling_params import (FLOAT_BOUNDS, LOGIT_BIAS, LOGPROBS, MAX_LOGIT_BIAS, MAX_STOP_LENGTH,
                                      MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SEED, TOKEN_ID, Range, SamplingParams)
from ..engine.structured import ENFORCED_KEYWORDS, MAX_WHITESPACE, GrammarError, StructuredOutput
from .tool_calls import ToolFormat, ToolSupport

MAX_N = 64  # n and best_of
N = Range(1, MAX_N, integer=True)
MAX_PROMPTS = 256  # prompts in one completions request
MAX_CHOICES = 256  # prompts x n: the sequences one request fans out to (and never more than --max-queue)
MAX_MESSAGES = 1024
CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per token of the context is refused untokenized
MAX_DETOKENIZE = 65536  # token ids in one /detokenize call
PRIORITY = Range(-(1 << 31), (1 << 31) - 1, integer=True)  # a request's priority: lower runs first (as vLLM)


class APIError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, why: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {why}" if not why.startswith(param) else why, param=param, code=code)


def parse_json_body(raw: bytes) -> dict:
    def no_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if b"\\u" in raw or b"\xed" in raw:  # the only ways a lone UTF-16 surrogate gets in, which no reply could encode
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                           "without its pair); send valid Unicode", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    return body


# ---------------------------------------------------------------------------------------- fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    """A finite JSON number (an integer of any size counts; comparing it with a float bound is exact)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _kind(v) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _shown(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(body: dict, name: str, rng: Range, allowed: str | None = None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {_kind(v)}")
    if v not in rng:
        raise bad(name, f"{_shown(v)} is out of range: must be {allowed or rng}")
    return v


def _num(body: dict, name: str, rng: Range):
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(name, f"must be a finite number, got {_kind(v)}")
    if v not in rng:
        raise bad(name, f"{_shown(v)} is out of range: must be {rng}")
    return float(v)


def _bool(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {_kind(v)}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad("stop", "must be a string or a list of strings")
    if len(v) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
    if not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_LENGTH for s in v):
        raise bad("stop", f"each stop string must be a string of 1 to {MAX_STOP_LENGTH} characters")
    return v


def _token_ids(body: dict, name: str, info: "ModelInfo", most: int) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > most:
        raise bad(name, f"must be a list of at most {most} token ids")
    if not all(_is_int(t) and 0 <= t < info.vocab_size for t in v):
        raise bad(name, f"must be token ids in [0, {info.vocab_size - 1}]")
    return v


def _unsupported(body: dict, name: str, ok, instead: str) -> None:
    v = body.get(name)
    if v is not None and not ok(v):
        raise APIError(400, f"{name}={_shown(v)} is not supported by this server; {instead}", param=name,
                       code="unsupported_parameter")


def _typed(body: dict, name: str, kind: type, what: str) -> None:
    v = body.get(name)
    if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
        raise bad(name, f"must be {what}, got {_kind(v)}")


# structured output as vLLM's clients send it: structured_outputs {json|regex|choice|grammar|json_object},
# or the older guided_* fields (one of them at most, or response_format)
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format",
           # the engine's extras, as vLLM names them
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "allowed_token_ids", "structured_outputs", "speculative", "priority", *GUIDED_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "logprobs", "echo", "best_of", "prompt_logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                         "add_generation_prompt", "modalities"}
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
DETOKENIZE_FIELDS = {"model", "tokens"}


# fields a router in front (vllm-router, SGLang's) adds to every request it forwards, at these values:
# taken as meaning nothing; any other value is an unknown parameter as before
ROUTER_DEFAULTS = {"no_stop_trim": False, "return_hidden_states": False, "continue_final_message": False,
                   "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True}


def check_known(body: dict, known: set[str]) -> None:
    for name, value in ROUTER_DEFAULTS.items():
        if name in body and body[name] is value and name not in known:
            del body[name]
    unknown = sorted(set(body) - known, key=str)
    if unknown:
        raise APIError(400, f"unknown parameter {_shown(unknown[0])}; known: {', '.join(sorted(known))}",
                       param=unknown[0], code="unknown_parameter")


# ----------------------------------------------------------------------------------- requests
@dataclass
class ModelInfo:
    """What request parsing needs from the model and the server: names, limits, and the tokenizer."""
    name: str
    version: str
    max_request_tokens: int  # prompt + output
    vocab_size: int
    tokenizer: object
    max_choices: int = MAX_CHOICES  # sequences one request may fan out to: min(MAX_CHOICES, --max-queue)
    grammars: object = None  # engine.structured.Grammars: compiles structured output (None: refused)
    tools: ToolSupport | None = None  # how the model takes tools (None: requests with tools are refused)

    @property
    def ids(self) -> set[str]:
        return {self.name, f"{self.name}-{self.version}", f"{self.name}:{self.version}"}

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt text tokenized at all; a longer one could not fit the context anyway."""
        return CHARS_PER_TOKEN * self.max_request_tokens

    @property
    def top_k(self) -> Range:
        return Range(-1, self.vocab_size, integer=True)


def fan_out_limit(max_queue: int) -> int:
    """The most sequences one request may fan out to on a server with this ``--max-queue``."""
    return MAX_CHOICES if max_queue < 0 else max(1, min(MAX_CHOICES, max_queue))


@dataclass
class GenRequest:
    """A parsed request: one or more prompts, each run ``n`` times with its own SamplingParams."""
    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: list[SamplingParams]  # one per choice: prompt index * n + i
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None
    discard_output: bool = False  # max_tokens=0 with echo: score the prompt, generate nothing
    extra: dict = field(default_factory=dict)
    tool_format: ToolFormat | None = None  # set when the reply may hold tool calls: how to parse them
    constrained: str | None = None  # the structured output's kind (counted in /metrics), or None
    priority: int = 0  # lower runs first (engine/scheduler.py)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _check_model(body: dict, info: ModelInfo) -> None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in info.ids):
        raise APIError(404, f"the model {_shown(model)} does not exist; this server serves {info.name!r} "
                       f"(version {info.version})", type="invalid_request_error", param="model",
                       code="model_not_found")


def _stream_opts(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad("stream_options", "must be an object such as {\"include_usage\": true}")
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not all(isinstance(v, bool) for v in opts.values()):
        raise bad("stream_options", "include_usage and continuous_usage_stats must be true or false")
    return opts.get("include_usage", False)


def _sampling_values(body: dict, info: ModelInfo) -> dict:
    """Every sampling field of the body, checked against its bound (the engine's own)."""
    values = {"stop": _stop(body)}
    for name, rng in FLOAT_BOUNDS.items():
        v = _num(body, name, rng)
        if v is not None:
            values[name] = v
    top_k = _int(body, "top_k", info.top_k, allowed=f"-1 or 0 (off), or an integer in [1, {info.vocab_size}] "
                                                     f"(the vocabulary size)")
    if top_k is not None:
        values["top_k"] = -1 if top_k == 0 else top_k  # 0 is "off" in some clients
    for name in ("ignore_eos", "skip_special_tokens", "speculative"):
        v = _bool(body, name)
        if v is not None:
            values[name] = v
    stop_ids = _token_ids(body, "stop_token_ids", info, MAX_STOP_TOKEN_IDS)
    if stop_ids is not None:
        values["stop_token_ids"] = stop_ids
    bias = _logit_bias(body, info)
    if bias:
        values["logit_bias"] = bias
    allowed = _token_ids(body, "allowed_token_ids", info, info.vocab_size)
    if allowed is not None:
        if not allowed:
            raise bad("allowed_token_ids", "is empty: give at least one token id (or leave it out)")
        values["allowed_token_ids"] = allowed
    return values


def _logit_bias(body: dict, info: ModelInfo) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (as strings) to a bias in [-100, 100] added to their logits."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers")
    out = {}
    for key, b in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < info.vocab_size):
            raise bad("logit_bias", f"key {_shown(key)} is not a token id in [0, {info.vocab_size - 1}]")
        if not _is_num(b) or b not in LOGIT_BIAS:
            raise bad("logit_bias", f"the bias of token {key} must be {LOGIT_BIAS}, got {_shown(b)}")
        out[int(key)] = float(b)
    return out


# ---------------------------------------------------------------------- structured output and tools
MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICE_ITEMS = 1024


def _schema(v, where: str, param: str):
    """A JSON Schema given as an object (or a JSON string of one), checked against the meta-schema and
    for keywords the grammar would not enforce."""
    from jsonschema import Draft202012Validator, exceptions

    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise APIError(400, f"{where} is not valid JSON: {str(e)[:200]}", param=param) from None
    if not isinstance(v, (dict, bool)):
        raise APIError(400, f"{where} must be a JSON Schema (an object), got {_kind(v)}", param=param)
    try:
        Draft202012Validator.check_schema(v)
    except exceptions.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "its top level"
        raise APIError(400, f"{where} is not a valid JSON Schema at {at}: {e.message[:200]}", param=param) from None
    except RecursionError:
        raise APIError(400, f"{where} is nested too deeply", param=param) from None
    try:
        from ..engine.structured import check_schema_keywords

        check_schema_keywords(v, where)
    except GrammarError as e:
        raise APIError(400, str(e), param=param, code="unsupported_schema") from None
    return v


def _guided(kind: str, v, where: str, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", _schema(v, where, param), param)
    if kind == "json_object":
        if v is not True:
            raise APIError(400, f"{where} must be true", param=param)
        return StructuredOutput("json_object", None, param)
    if kind == "choice":
        if (not isinstance(v, list) or not 1 <= len(v) <= MAX_CHOICE_ITEMS
                or not all(isinstance(c, str) and c for c in v)):
            raise APIError(400, f"{where} must be a list of 1 to {MAX_CHOICE_ITEMS} non-empty strings", param=param)
        return StructuredOutput("choice", v, param)
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{where} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters "
                       f"({'a regular expression' if kind == 'regex' else 'an EBNF/GBNF or Lark grammar'})",
                       param=param)
    return StructuredOutput(kind, v, param)


def _structured(body: dict) -> StructuredOutput | None:
    """The one output constraint a request sets: response_format, structured_outputs or a guided_* field."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema") or \
                set(rf) - {"type", "json_schema"}:
            raise bad("response_format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": '
                                         '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        if rf["type"] == "json_object":
            found.append(StructuredOutput("json_object", None, "response_format"))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or set(js) - {"name", "description", "schema", "strict"}:
                raise bad("response_format", "json_schema must be an object with name, schema, and optionally "
                                             "description and strict")
            found.append(StructuredOutput("json", _schema(js.get("schema", {"type": "object"}),
                                                          "response_format.json_schema.schema", "response_format"),
                                          "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or set(so) - set(STRUCTURED_KINDS):
            raise bad("structured_outputs", f"must be an object with one of {', '.join(STRUCTURED_KINDS)}")
        found += [_guided(k, so[k], f"structured_outputs.{k}", "structured_outputs")
                  for k in STRUCTURED_KINDS if so.get(k) is not None]
    found += [_guided(kind, body[name], name, name) for name, kind in GUIDED_FIELDS.items()
              if body.get(name) is not None]
    if len(found) > 1:
        raise bad(found[1].param, f"give one output constraint; {found[0].param} sets one already")
    return found[0] if found else None


def _tools(body: dict, info: ModelInfo):
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked; (tools, choice, parallel) or None."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _bool(body, "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise bad("tools", "must be a list of function tools")
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"{_shown(choice)} needs tools: give the functions in tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"must be a list of at most {MAX_TOOLS} function tools")
    names = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) or set(t) - {"type", "function"}:
            raise APIError(400, f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                                f'{{...}}}}}}', param="tools")
        if set(f) - {"name", "description", "parameters", "strict"}:
            extra = sorted(set(f) - {"name", "description", "parameters", "strict"})[0]
            raise APIError(400, f"{where}.function has an unknown key {_shown(extra)}; known: name, description, "
                                f"parameters, strict", param="tools")
        if not isinstance(f.get("name"), str) or not TOOL_NAME.match(f["name"]):
            raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ or -", param="tools")
        if f["name"] in names:
            raise APIError(400, f"{where}.function.name {f['name']!r} is given twice", param="tools")
        names.append(f["name"])
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise APIError(400, f"{where}.function.description must be a string", param="tools")
        if f.get("parameters") is not None:
            _schema(f["parameters"], f"{where}.function.parameters", "tools")
    if info.tools is None:
        raise APIError(400, "tools: this model's chat template does not render tools and it is not a ChatML model "
                       "(infer's tool template is ChatML); leave tools out", param="tools",
                       code="unsupported_parameter")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                     '{"name": ...}}')
        if name not in names:
            raise bad("tool_choice", f"names the function {_shown(name)}, which is not in tools "
                                     f"({', '.join(names)})")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                 '{"name": ...}}')
    return tools, choice, parallel is not False


def _compile(info: ModelInfo, so: StructuredOutput | None) -> StructuredOutput | None:
    """Compiles a constraint now (in the request's worker thread): one that does not compile is the
    client's 400 naming its field, and the engine thread never waits on a compiler."""
    if so is None:
        return None
    if info.grammars is None:
        raise APIError(400, f"{so.param}: this server does not constrain output", param=so.param,
                       code="unsupported_parameter")
    try:
        return info.grammars.compile(so)
    except GrammarError as e:
        raise APIError(400, str(e), param=so.param, code="invalid_structured_output") from None


def _sampling(values: dict, kind: str, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
              seed: int | None) -> SamplingParams:
    values = {**values, "max_tokens": max_tokens}
    if logprobs is not None:
        values["logprobs"] = logprobs
    if prompt_logprobs is not None:
        values["prompt_logprobs"] = prompt_logprobs
    if seed is not None:
        values["seed"] = seed
    try:
        return SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:  # checked above already: only a bound missing here gets this far
        msg = str(e)
        name = msg.split("=", 1)[0].strip() if "=" in msg else None
        if kind == "chat" and name == "logprobs":
            name = "top_logprobs"
        raise APIError(400, msg, param=name if name in values else None) from None


def _context_exceeded(param: str, what: str, info: ModelInfo) -> APIError:
    return APIError(400, f"{param} is {what}, over this server's context limit of {info.max_request_tokens} tokens "
                    f"(prompt and output together); shorten it", param=param, code="context_length_exceeded")


def _limits(info: ModelInfo, ids: list[int], param: str) -> None:
    if not ids:
        raise bad(param, "is empty: give at least one token")
    if len(ids) >= info.max_request_tokens:
        raise _context_exceeded(param, f"{len(ids)} tokens", info)


def _check_chars(info: ModelInfo, chars: int, param: str) -> None:
    """Refuses, before tokenizing, text that cannot fit the context at any plausible tokenization."""
    if chars > info.max_prompt_chars:
        raise APIError(400, f"{param} is {chars} characters, over the {info.max_prompt_chars} characters this server "
                       f"tokenizes at most ({CHARS_PER_TOKEN} per token of its context limit of "
                       f"{info.max_request_tokens} tokens); shorten it", param=param, code="context_length_exceeded")


def _max_tokens(body: dict, name: str, default: int | None, info: ModelInfo, prompt_len: int, allow_zero: bool) -> int:
    v = _int(body, name, Range(0 if allow_zero else 1, info.max_request_tokens - 1, integer=True))
    room = info.max_request_tokens - prompt_len
    if v is None:
        return room if default is None else min(default, room)
    if v > room:
        raise APIError(400, f"{name}={v} is too many: this server's context limit is {info.max_request_tokens} "
                       f"tokens and the prompt takes {prompt_len}, leaving {room}", param=name,
                       code="context_length_exceeded")
    return v


def _check_max_tokens_bound(body: dict, names: tuple[str, ...], info: ModelInfo, lo: int) -> None:
    """max_tokens within what any prompt leaves of the context, checked before tokenizing."""
    ctx = info.max_request_tokens
    for name in names:
        _int(body, name, Range(lo, ctx - 1, integer=True),
             allowed=f"an integer in [{lo}, {ctx - 1}]: prompt and output together fit the context limit "
                     f"of {ctx} tokens")


def _n_and_seed(body: dict):
    n = _int(body, "n", N) or 1
    seed = _int(body, "seed", SEED)
    return n, seed


def _check_fan_out(info: ModelInfo, prompts: int, n: int) -> None:
    if prompts * n > info.max_choices:
        param = "n" if n > 1 else "prompt"
        raise APIError(400, f"this request fans out to {prompts} prompt(s) x n={n} = {prompts * n} sequences; this "
                       f"server takes at most {info.max_choices} per request (the smaller of {MAX_CHOICES} and "
                       f"--max-queue); send fewer prompts or a smaller n", param=param, code="too_many_sequences")


def _choice_seed(seed: int | None, i: int) -> int | None:
    if seed is None or i == 0:
        return seed
    return (seed + i) % (1 << 63)


def tokenize_prompts(prompt, info: ModelInfo, n: int = 1) -> tuple[list[list[int]], list[str | None]]:
    """A completions ``prompt``: a string, a list of strings, a list of ids, or a list of id lists.

    Count, fan-out, length and token ids are checked before any text is tokenized."""
    tok = info.tokenizer

    def ids_ok(ids):
        return isinstance(ids, list) and ids and all(_is_int(t) for t in ids)

    if isinstance(prompt, str):
        items = [prompt]
    elif ids_ok(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids_ok(p) for p in prompt):
        items = prompt
    else:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")
    if len(items) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
    _check_fan_out(info, len(items), n)
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "is empty: give at least one token")
            _check_chars(info, len(p), "prompt")
        else:
            _limits(info, p, "prompt")
            badid = next((t for t in p if not 0 <= t < info.vocab_size), None)
            if badid is not None:
                raise bad("prompt", f"token id {_shown(badid)} is outside the vocabulary [0, {info.vocab_size})")
    ids, texts = [], []
    for p in items:
        if isinstance(p, str):
            ids.append(tok.encode(p))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def parse_completion(body: dict, info: ModelInfo) -> GenRequest:
    check_known(body, COMPLETION_FIELDS)
    _check_model(body, info)
    if "prompt" not in body:
        raise bad("prompt", "is required")
    _unsupported(body, "suffix", lambda v: v == "", "leave it out")
    _typed(body, "user", str, "a string")
    stream = bool(_bool(body, "stream"))
    include_usage = _stream_opts(body, stream)
    echo = bool(_bool(body, "echo"))
    logprobs = _int(body, "logprobs", LOGPROBS)
    prompt_logprobs = _int(body, "prompt_logprobs", LOGPROBS)
    n, seed = _n_and_seed(body)
    best_of = _int(body, "best_of", N)
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of={best_of} with n={n}: best_of other than n is not supported; leave it out",
                       param="best_of", code="unsupported_parameter")
    values = _sampling_values(body, info)
    structured = _structured(body)
    _check_max_tokens_bound(body, ("max_tokens",), info, 0 if echo else 1)
    prompts, texts = tokenize_prompts(body["prompt"], info, n)
    if _compile(info, structured) is not None:
        values["structured"] = structured
    for ids in prompts:
        _limits(info, ids, "prompt")
    if echo and logprobs is not None:
        prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
    params, discard = [], False
    for ids in prompts:
        mt = _max_tokens(body, "max_tokens", 16, info, len(ids), allow_zero=echo)
        if mt == 0:
            discard, mt = True, 1
        for i in range(n):
            params.append(_sampling(values, "completion", mt, logprobs, prompt_logprobs, _choice_seed(seed, i)))
    return GenRequest("completion", prompts, texts, params, n, stream, include_usage, echo=echo,
                      priority=_int(body, "priority", PRIORITY) or 0,
                      logprobs=logprobs, discard_output=discard, constrained=structured and structured.kind)


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def chat_messages(messages, info: ModelInfo | None = None) -> list[dict]:
    """``messages`` as the template takes them; count and total length bounded before rendering."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        role = m["role"]
        if role not in _ROLES:
            raise APIError(400, f"messages[{i}].role {_shown(role)} is not one of {', '.join(sorted(_ROLES))}",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and calls:
            content = ""  # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if calls is not None:
            msg["tool_calls"] = _message_tool_calls(calls, f"messages[{i}].tool_calls")
            chars += sum(len(c["function"]["name"]) + len(json.dumps(c["function"]["arguments"]))
                         for c in msg["tool_calls"])
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise APIError(400, f"messages[{i}].{key} must be a string", param="messages")
                    msg[key] = m[key]
        chars += len(content)
        if info is not None:
            _check_chars(info, chars, "messages")
        out.append(msg)
    return out


def _message_tool_calls(calls, where: str) -> list[dict]:
    """An assistant turn's tool calls, their arguments parsed from the JSON string OpenAI sends (chat
    templates take them as objects, as transformers passes them)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list of tool calls", param="messages")
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, f'{where}[{k}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                f'"arguments": "..."}}}}', param="messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(400, f"{where}[{k}].function.arguments is not valid JSON", param="messages") from None
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{k}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def render_chat(info: ModelInfo, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
    """The chat template applied; a template's refusal is the client's 400, and so is a result too long.

    With tools, or tool calls and results in the conversation, a model whose own template cannot render
    them gets infer's ChatML tool template (``ToolSupport``)."""
    template = None
    if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        if info.tools is None:
            raise APIError(400, "messages: tool calls and tool results need a chat template that renders them; "
                           "this model's does not", param="messages")
        template = info.tools.template
    try:
        extra = {"tools": tools, "template": template} if tools or template else {}
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # jinja2 TemplateError raised by the template itself (e.g. role order)
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
    _check_chars(info, len(text), "messages")
    return text


def parse_chat(body: dict, info: ModelInfo) -> GenRequest:
    check_known(body, CHAT_FIELDS)
    _check_model(body, info)
    if "messages" not in body:
        raise bad("messages", "is required")
    _unsupported(body, "modalities", lambda v: v == ["text"], "only [\"text\"]")
    for name, kind, what in (("user", str, "a string"), ("service_tier", str, "a string"),
                             ("metadata", dict, "an object"), ("store", bool, "true or false")):
        _typed(body, name, kind, what)
    stream = bool(_bool(body, "stream"))
    include_usage = _stream_opts(body, stream)
    want_logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "needs logprobs set to true")
    logprobs = (top or 0) if want_logprobs else None
    n, seed = _n_and_seed(body)
    _check_fan_out(info, 1, n)
    add_gen = _bool(body, "add_generation_prompt")
    values = _sampling_values(body, info)
    structured = _structured(body)
    tooling = _tools(body, info)
    calling = tooling is not None and tooling[1] != "none"
    if calling and structured is not None:
        raise bad(structured.param, "cannot be combined with tools (tool_choice other than \"none\"): the "
                                    "tool-call format is the output's constraint")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    _check_max_tokens_bound(body, ("max_tokens", "max_completion_tokens"), info, 1)
    text = render_chat(info, chat_messages(body["messages"], info), add_gen is not False,
                       tools=tooling[0] if tooling else None)
    ids = info.tokenizer.encode(text)
    _limits(info, ids, "messages")
    mt = _max_tokens(body, name, None, info, len(ids), allow_zero=False)
    if calling:
        try:
            tag = info.tools.structural_tag(*tooling, max_whitespace=MAX_WHITESPACE)
        except ValueError as e:
            raise APIError(400, f"tools: {str(e)[:300]}", param="tools") from None
        structured = StructuredOutput("structural_tag", tag, "tools")
    if _compile(info, structured) is not None:
        values["structured"] = structured
    params = [_sampling(values, "chat", mt, logprobs, None, _choice_seed(seed, i)) for i in range(n)]
    return GenRequest("chat", [ids], [text], params, n, stream, include_usage, logprobs=logprobs,
                      priority=_int(body, "priority", PRIORITY) or 0,
                      tool_format=info.tools.format if calling else None,
                      constrained="tools" if calling else structured and structured.kind)


def parse_tokenize(body: dict, info: ModelInfo) -> dict:
    """``/tokenize``: the same bounds as a prompt, checked before tokenizing."""
    check_known(body, TOKENIZE_FIELDS)
    add_special = body.get("add_special_tokens", False)
    if not isinstance(add_special, bool):
        raise bad("add_special_tokens", "must be true or false")
    add_gen = _bool(body, "add_generation_prompt")
    if "messages" in body:
        text = render_chat(info, chat_messages(body["messages"], info), add_gen is not False)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
        _check_chars(info, len(text), "prompt")
    else:
        raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
    ids = info.tokenizer.encode(text, add_special_tokens=add_special)
    return {"tokens": ids, "count": len(ids), "max_model_len": info.max_request_tokens}


def parse_detokenize(body: dict, info: ModelInfo) -> list[int]:
    check_known(body, DETOKENIZE_FIELDS)
    ids = _token_ids(body, "tokens", info, MAX_DETOKENIZE)
    if ids is None:
        raise bad("tokens", "is required: a list of token ids")
    return ids


# ---------------------------------------------------------------------------------- the OpenAPI schema
def _token_id_schema(info: ModelInfo | None) -> dict:
    return {"type": "integer", "minimum": 0, "maximum": info.vocab_size - 1 if info else TOKEN_ID.hi}


def _described(schema: dict, text: str) -> dict:
    return {**schema, "description": text}


def _messages_schema(info: ModelInfo | None) -> dict:
    chars = {"maxLength": info.max_prompt_chars} if info else {}
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string", **chars}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": sorted(_ROLES)},
                              "content": {"anyOf": [{"type": "string", **chars},
                                                    {"type": "array", "items": part}]}}}
    return _described({"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": message},
                      f"at most {MAX_MESSAGES} messages, rendered with the artifact's chat template; their text "
                      f"at most {CHARS_PER_TOKEN} characters per token of the context limit, before tokenizing")


def request_body_schemas(info: ModelInfo | None) -> dict[str, dict]:
    """JSON Schema of each POST body, from the bounds the validators above use (``info``: the loaded
    model's limits; None while loading, when only the model-independent bounds are shown)."""
    ctx = info.max_request_tokens if info else None
    token = _token_id_schema(info)
    ids = {"type": "array", "items": token, "minItems": 1, **({"maxItems": ctx - 1} if ctx else {})}
    text = {"type": "string", "minLength": 1, **({"maxLength": info.max_prompt_chars} if info else {})}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
    choices = info.max_choices if info else MAX_CHOICES
    fan = f"; prompts x n at most {choices} (the smaller of {MAX_CHOICES} and --max-queue)"

    def tokens_bound(lo: int) -> dict:
        return {"type": "integer", "minimum": lo, **({"maximum": ctx - 1} if ctx else {}),
                "description": "prompt + max_tokens must fit the context limit"}

    top_k = (info.top_k if info else Range(-1, TOKEN_ID.hi, integer=True)).json_schema()
    common = {
        "model": {"type": "string"},
        "max_tokens": tokens_bound(1),
        "temperature": _described(FLOAT_BOUNDS["temperature"].json_schema(), "0 is greedy"),
        "top_p": FLOAT_BOUNDS["top_p"].json_schema(),
        "n": _described(Range(1, min(MAX_N, choices), integer=True).json_schema(), f"choices per prompt{fan}"),
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"},
                                          "continuous_usage_stats": {"type": "boolean"}},
                           "description": "only with stream: true"},
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}]},
        "seed": _described(SEED.json_schema(), "choice i of n uses seed + i"),
        "presence_penalty": FLOAT_BOUNDS["presence_penalty"].json_schema(),
        "frequency_penalty": FLOAT_BOUNDS["frequency_penalty"].json_schema(),
        "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                       "additionalProperties": LOGIT_BIAS.json_schema(),
                       "description": "token id (as a string) to a bias added to its logit"},
        "allowed_token_ids": {"type": "array", "items": token, "minItems": 1,
                              "description": "only these tokens may be generated"},
        "response_format": {"anyOf": [
            {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"],
             "additionalProperties": False},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "additionalProperties": False, "properties": {
                     "name": {"type": "string"}, "description": {"type": "string"}, "schema": {"type": "object"},
                     "strict": {"type": "boolean"}}}}}],
            "description": "JSON output: any object, or one matching a JSON Schema (the keywords enforced: "
                           + ", ".join(sorted(ENFORCED_KEYWORDS)) + "; any other is refused)"},
        "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
                               "properties": {"json": {"type": "object"}, "regex": {"type": "string"},
                                              "choice": {"type": "array", "items": {"type": "string"}},
                                              "grammar": {"type": "string", "description": "EBNF/GBNF or Lark"},
                                              "json_object": {"const": True}},
                               "description": "vLLM's structured output field; one constraint per request"},
        **{name: {"description": f"vLLM's older form of structured_outputs.{kind}"}
           for name, kind in GUIDED_FIELDS.items()},
        "user": {"type": "string"},
        "top_k": _described(top_k, "-1 or 0: off"),
        "min_p": FLOAT_BOUNDS["min_p"].json_schema(),
        "repetition_penalty": _described(FLOAT_BOUNDS["repetition_penalty"].json_schema(), "1 is off"),
        "ignore_eos": {"type": "boolean"},
        "stop_token_ids": {"type": "array", "items": token, "maxItems": MAX_STOP_TOKEN_IDS},
        "skip_special_tokens": {"type": "boolean"},
        "speculative": _described({"type": "boolean"}, "false: this request never drafts (infer-run --speculative)"),
        "priority": _described(PRIORITY.json_schema(), "lower runs first (vLLM's priority scheduling); default 0"),
    }
    completion = {
        **common,
        "prompt": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": min(MAX_PROMPTS, choices),
                                    "items": {"anyOf": [text, ids]}}, ids],
                   "description": f"a string, a list of strings, a list of token ids, or a list of such lists; "
                                  f"at most {MAX_PROMPTS} prompts{fan}"},
        "max_tokens": _described(tokens_bound(0), "0 only with echo (scores the prompt); "
                                                  "prompt + max_tokens must fit the context limit"),
        "suffix": {"const": "", "description": "not supported: only \"\""},
        "logprobs": LOGPROBS.json_schema(),
        "echo": {"type": "boolean"},
        "best_of": _described(Range(1, min(MAX_N, choices), integer=True).json_schema(), "only equal to n"),
        "prompt_logprobs": LOGPROBS.json_schema(),
    }
    chat = {
        **common,
        "messages": _messages_schema(info),
        "max_completion_tokens": tokens_bound(1),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _described(LOGPROBS.json_schema(), "needs logprobs: true"),
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {
            "type": "object", "required": ["type", "function"], "additionalProperties": False,
            "properties": {"type": {"const": "function"}, "function": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"name": {"type": "string", "pattern": TOOL_NAME.pattern},
                               "description": {"type": "string"}, "parameters": {"type": "object"},
                               "strict": {"type": "boolean"}}}}}},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "function"],
                                   "properties": {"type": {"const": "function"},
                                                  "function": {"type": "object", "required": ["name"],
                                                               "properties": {"name": {"type": "string"}}}}}],
                        "description": "required or a named function: the reply is tool calls whose arguments "
                                       "match the function's parameters"},
        "parallel_tool_calls": {"type": "boolean"},
        "store": {"type": "boolean"},
        "metadata": {"type": "object"},
        "service_tier": {"type": "string"},
        "add_generation_prompt": {"type": "boolean"},
        "modalities": {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
    }
    assert set(completion) == COMPLETION_FIELDS and set(chat) == CHAT_FIELDS  # every accepted field documented

    def body(props: dict, required: list[str], **extra) -> dict:
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False, **extra}

    return {
        "/v1/completions": body(completion, ["prompt"]),
        "/v1/chat/completions": body(chat, ["messages"]),
        "/tokenize": body({"model": {"type": "string"}, "prompt": {**text, "minLength": 0},
                           "messages": _messages_schema(info), "add_special_tokens": {"type": "boolean"},
                           "add_generation_prompt": {"type": "boolean"}}, [],
                          anyOf=[{"required": ["prompt"]}, {"required": ["messages"]}]),
        "/detokenize": body({"model": {"type": "string"},
                             "tokens": {"type": "array", "items": token, "maxItems": MAX_DETOKENIZE}}, ["tokens"]),
    }


# ---------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


class TokenText:
    """Token id -> its text, cached (used for logprobs)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 200_000:
                self.cache[token_id] = s
        return s


def completion_logprobs(entries: list[tuple[int, dict | None]], tt: TokenText, offset: int) -> dict:
    """Legacy completions format. ``entries``: (token id, engine logprob record or None)."""
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, rec in entries:
        s = tt(token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if rec is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(rec["logprob"])
            tops.append({tt(t): lp for t, lp in rec.get("top", [])} or {s: rec["logprob"]})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[tuple[int, dict | None]], tt: TokenText) -> dict:
    content = []
    for token_id, rec in entries:
        s = tt(token_id)
        content.append({
            "token": s, "logprob": rec["logprob"] if rec else None, "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode("utf-8"))}
                             for t, lp in (rec or {}).get("top", [])],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def now() -> int:
    return int(time.time())
