"""Structured output: a request's JSON schema, regex, choice list, grammar or tool-call format,
compiled by xgrammar and enforced token by token as a bit mask over the vocabulary.

Why xgrammar: it is vLLM's and SGLang's default engine, runs on the CPU, keeps a per-sequence
matcher that can roll back (the seam speculative decoding needs), ships the tool-call formats of
the model families this project loads (``get_model_structural_tag``), and its masks cost
microseconds per row once a grammar is compiled. llguidance would do as well; one engine is enough.

The tokenizer info is built from the artifact's own ``tokenizer.json`` through the ``tokenizers``
library (the runtime does not import transformers). Compiled grammars are cached by their spec.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

# JSON from a schema is compact (", " and ": " between items, no other whitespace): a small model given
# free whitespace fills it with newlines until max_tokens. Tool-call arguments allow this many in a row.
MAX_WHITESPACE = 4
# tokens a matcher can take back (speculative decoding rejects drafted tokens through rollback)
MAX_ROLLBACK_TOKENS = 16
CACHE_ENTRIES = 256

# JSON Schema keywords enforced token by token; anything else in a schema is refused, not ignored.
ENFORCED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format",
})
ANNOTATION_KEYWORDS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                 "deprecated", "readOnly", "writeOnly", "nullable"})
# keywords whose value is a map of names to schemas, or a list of schemas, or one schema
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class GrammarError(ValueError):
    """A spec that does not compile; ``param`` names the request field it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class StructuredOutput:
    """What a request's output must match: one ``kind`` of ``KINDS`` and its ``spec`` (a JSON schema as a
    dict or string, a regex, a list of choices, an EBNF/GBNF or Lark grammar, an xgrammar structural tag).
    ``param`` is the request field it came from, named in errors. ``compiled`` is set by ``Grammars``."""
    kind: str
    spec: object = None
    param: str = "structured_outputs"
    compiled: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r}: choose one of {', '.join(KINDS)}")

    def key(self) -> str:
        spec = self.spec.model_dump_json() if hasattr(self.spec, "model_dump_json") else self.spec
        return self.kind + "\0" + (spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))


def check_schema_keywords(schema, where: str = "schema") -> None:
    """Refuses a JSON Schema keyword the grammar would not enforce (xgrammar compiles some silently)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(where, f"a schema must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        if key not in ENFORCED_KEYWORDS and key not in ANNOTATION_KEYWORDS:
            raise GrammarError(where, f"the keyword {key!r} is not supported (it would not be enforced); supported: "
                                      f"{', '.join(sorted(ENFORCED_KEYWORDS))}")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}.{key}.{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{where}.{key}[{i}]")
        elif key in _SCHEMA_ONE and isinstance(value, (dict, bool)):
            check_schema_keywords(value, f"{where}.{key}")


def _is_lark(grammar: str) -> bool:
    """EBNF/GBNF rules read ``name ::= ...``; Lark's ``name: ...``."""
    return "::=" not in grammar


class Grammars:
    """Compiles specs for one tokenizer; thread-safe, compiled results cached (LRU) by spec."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(self.tokenizer_json))
                # xgrammar's own detection of the vocabulary's encoding, from the tokenizer.json text
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
                vocab = tok.get_vocab(with_added_tokens=True)
                encoded = [""] * max(vocab.values(), default=-1) + [""]
                for piece, i in vocab.items():
                    encoded[i] = piece
                info = xgr.TokenizerInfo(encoded[:self.vocab_size], vocab_type=meta["vocab_type"],
                                         vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids,
                                         add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, so: StructuredOutput) -> StructuredOutput:
        """Sets ``so.compiled``; GrammarError naming ``so.param`` when the spec does not compile."""
        if so.compiled is not None:
            return so
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(so, self.compiler())
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        so.compiled = hit
        return so

    def _compile(self, so: StructuredOutput, c):
        try:
            if so.kind == "json":
                schema = json.loads(so.spec) if isinstance(so.spec, str) else so.spec
                check_schema_keywords(schema, so.param)
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if so.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                import xgrammar as xgr

                alternatives = " | ".join(json.dumps(c_) for c_ in so.spec)
                return c.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {alternatives}"))
            if so.kind == "grammar":
                return c.compile_lark(so.spec) if _is_lark(so.spec) else c.compile_grammar(so.spec)
            return c.compile_structural_tag(so.spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            text = str(e).strip().splitlines()
            message = next((ln for ln in text if ln.strip()), type(e).__name__)
            if "]" in message and message.startswith("["):  # xgrammar's "[time] file.cc:line: " prefix
                message = message.split(": ", 1)[-1]
            raise GrammarError(so.param, f"does not compile: {message[:300]}") from None


class Constraint:
    """One sequence's matcher and its row of the bit mask (int32 words, bit set: token allowed)."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.filled_at = -1  # the sequence length the mask was filled for

    def fill(self, length: int) -> None:
        if self.filled_at != length:
            self.matcher.fill_next_token_bitmask(self.bitmask, 0)
            self.filled_at = length

    def allows(self, token: int) -> bool:
        """Whether the filled mask allows ``token`` next."""
        return bool((int(self.bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, tokens: int) -> None:
        self.matcher.rollback(tokens)
        self.filled_at = -1

    @property
    def finished(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> None:
    """Sets the logits of tokens each constrained row's grammar forbids to -inf, in place."""
    import xgrammar as xgr

    masks = torch.cat([c.bitmask for c in constraints]).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, masks)
    else:
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, masks)
        logits[rows] = sub


class MaskFiller:
    """Fills the constrained rows' masks in a worker thread while the model's forward runs."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="infer-grammar")
        self.fill_seconds: deque[float] = deque(maxlen=100_000)  # per step with constrained rows (benchmarks)

    def start(self, seqs) -> Future | None:
        jobs = [(s.constraint, len(s)) for s in seqs if s.constraint is not None]
        if not jobs:
            return None

        def run():
            t0 = time.perf_counter()
            for constraint, length in jobs:
                constraint.fill(length)
            self.fill_seconds.append(time.perf_counter() - t0)

        return self._pool.submit(run)
