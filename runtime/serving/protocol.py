"""The OpenAI wire format: request bodies checked field by field, responses and stream chunks built.

Validation is explicit rather than schema-driven so that every refusal is a 400 whose ``param``
names the offending field, as the OpenAI API does. Nothing here touches the engine's state: it
needs only a tokenizer, the context limit and the vocabulary size (see ``ModelInfo``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams

MAX_N = 64
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


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


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}" if not why.startswith(param) else why, param=param)


def parse_json_body(raw: bytes) -> dict:
    def no_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


# ---------------------------------------------------------------------------------------- fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad(name, f"{v} is out of range {rng}")
    return v


def _num(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(name, f"must be a finite number, got {type(v).__name__}")
    return float(v)


def _bool(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {type(v).__name__}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad("stop", "must be a non-empty string or a list of non-empty strings")
    if len(v) > 16:
        raise bad("stop", f"at most 16 stop strings, got {len(v)}")
    return v


def _int_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad(name, "must be a list of non-negative integers")
    return v


def _unsupported(body: dict, name: str, ok) -> None:
    v = body.get(name)
    if v is not None and not ok(v):
        raise APIError(400, f"{name}={json.dumps(v)[:80]} is not supported by this server", param=name,
                       code="unsupported_parameter")


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "user",
           # the engine's extras, as vLLM names them
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "logprobs", "echo", "best_of", "prompt_logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                         "add_generation_prompt", "modalities"}


def _check_known(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")


# ----------------------------------------------------------------------------------- requests
@dataclass
class ModelInfo:
    """What request parsing needs from the model: names, limits, and the tokenizer."""
    name: str
    version: str
    max_request_tokens: int  # prompt + output
    vocab_size: int
    tokenizer: object

    @property
    def ids(self) -> set[str]:
        return {self.name, f"{self.name}-{self.version}", f"{self.name}:{self.version}"}


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

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _check_model(body: dict, info: ModelInfo) -> None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in info.ids):
        raise APIError(404, f"the model {model!r} does not exist; this server serves {info.name!r} "
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
    v = opts.get("include_usage", False)
    if not isinstance(v, bool):
        raise bad("stream_options", "include_usage must be true or false")
    return v


def _sampling(body: dict, kind: str, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
              seed: int | None) -> SamplingParams:
    values = {"max_tokens": max_tokens, "stop": _stop(body)}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = _num(body, name)
        if v is not None:
            values[name] = v
    top_k = _int(body, "top_k")
    if top_k is not None:
        values["top_k"] = -1 if top_k == 0 else top_k  # 0 is "off" in some clients
    for name in ("ignore_eos", "skip_special_tokens"):
        v = _bool(body, name)
        if v is not None:
            values[name] = v
    stop_ids = _int_list(body, "stop_token_ids")
    if stop_ids is not None:
        values["stop_token_ids"] = stop_ids
    if logprobs is not None:
        values["logprobs"] = logprobs
    if prompt_logprobs is not None:
        values["prompt_logprobs"] = prompt_logprobs
    if seed is not None:
        values["seed"] = seed
    try:
        return SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:
        msg = str(e)
        name = msg.split("=", 1)[0].strip() if "=" in msg else None
        if kind == "chat" and name == "logprobs":
            name = "top_logprobs"
        raise APIError(400, msg, param=name if name in body or name in values else None) from None


def _limits(info: ModelInfo, ids: list[int], param: str) -> None:
    if not ids:
        raise bad(param, "is empty: give at least one token")
    if len(ids) >= info.max_request_tokens:
        raise APIError(400, f"{param} is {len(ids)} tokens, over this server's context limit of "
                       f"{info.max_request_tokens} tokens (prompt and output together); shorten it",
                       param=param, code="context_length_exceeded")


def _max_tokens(body: dict, name: str, default: int | None, info: ModelInfo, prompt_len: int, allow_zero: bool) -> int:
    v = _int(body, name, 0 if allow_zero else 1)
    room = info.max_request_tokens - prompt_len
    if v is None:
        return room if default is None else min(default, room)
    if v > room:
        raise APIError(400, f"{name}={v} is too many: this server's context limit is {info.max_request_tokens} "
                       f"tokens and the prompt takes {prompt_len}, leaving {room}", param=name,
                       code="context_length_exceeded")
    return v


def _n_and_seed(body: dict):
    n = _int(body, "n", 1, MAX_N) or 1
    seed = _int(body, "seed", _SEED_MIN, _SEED_MAX)
    return n, seed


def _choice_seed(seed: int | None, i: int) -> int | None:
    if seed is None or i == 0:
        return seed
    return (seed + i) % (1 << 63)


def tokenize_prompts(prompt, info: ModelInfo) -> tuple[list[list[int]], list[str | None]]:
    """A completions ``prompt``: a string, a list of strings, a list of ids, or a list of id lists."""
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
    if len(items) > 256:
        raise bad("prompt", f"at most 256 prompts per request, got {len(items)}")
    ids, texts = [], []
    for p in items:
        if isinstance(p, str):
            ids.append(tok.encode(p))
            texts.append(p)
        else:
            badid = next((t for t in p if not 0 <= t < info.vocab_size), None)
            if badid is not None:
                raise bad("prompt", f"token id {badid} is outside the vocabulary [0, {info.vocab_size})")
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def parse_completion(body: dict, info: ModelInfo) -> GenRequest:
    _check_known(body, COMPLETION_FIELDS)
    _check_model(body, info)
    if "prompt" not in body:
        raise bad("prompt", "is required")
    _unsupported(body, "suffix", lambda v: v == "")
    _unsupported(body, "logit_bias", lambda v: v == {})
    stream = bool(_bool(body, "stream"))
    include_usage = _stream_opts(body, stream)
    echo = bool(_bool(body, "echo"))
    logprobs = _int(body, "logprobs", 0, 20)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, 20)
    n, seed = _n_and_seed(body)
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise APIError(400, "best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    prompts, texts = tokenize_prompts(body["prompt"], info)
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
            params.append(_sampling(body, "completion", mt, logprobs, prompt_logprobs, _choice_seed(seed, i)))
    return GenRequest("completion", prompts, texts, params, n, stream, include_usage, echo=echo,
                      logprobs=logprobs, discard_output=discard)


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        role = m["role"]
        if role not in _ROLES:
            raise APIError(400, f"messages[{i}].role {role!r} is not one of {', '.join(sorted(_ROLES))}",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def parse_chat(body: dict, info: ModelInfo) -> GenRequest:
    _check_known(body, CHAT_FIELDS)
    _check_model(body, info)
    if "messages" not in body:
        raise bad("messages", "is required")
    _unsupported(body, "logit_bias", lambda v: v == {})
    _unsupported(body, "tools", lambda v: v == [])
    _unsupported(body, "tool_choice", lambda v: v == "none")
    _unsupported(body, "response_format", lambda v: v == {"type": "text"})
    _unsupported(body, "modalities", lambda v: v == ["text"])
    stream = bool(_bool(body, "stream"))
    include_usage = _stream_opts(body, stream)
    want_logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "needs logprobs set to true")
    logprobs = (top or 0) if want_logprobs else None
    n, seed = _n_and_seed(body)
    add_gen = _bool(body, "add_generation_prompt")
    messages = chat_messages(body["messages"])
    try:
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen is not False)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # jinja2 TemplateError raised by the template itself (e.g. role order)
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
    ids = info.tokenizer.encode(text)
    _limits(info, ids, "messages")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = _max_tokens(body, name, None, info, len(ids), allow_zero=False)
    params = [_sampling(body, "chat", mt, logprobs, None, _choice_seed(seed, i)) for i in range(n)]
    return GenRequest("chat", [ids], [text], params, n, stream, include_usage, logprobs=logprobs)


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
