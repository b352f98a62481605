"""Tokenizer and chat template, read from an artifact without transformers.

``tokenizer.json`` is run by the ``tokenizers`` library; the chat template in
``tokenizer_config.json`` is rendered by a sandboxed jinja2, as transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..artifact import CHAT_TEMPLATE, CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, path: str | Path, model_config: dict | None = None):
        """``model_config``: the artifact's parsed config.json (read here when not given)."""
        path = Path(path)
        self._tok = _HFTokenizer.from_file(str(path / TOKENIZER))
        cfg_path = path / TOKENIZER_CONFIG
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        gen_path = path / GENERATION_CONFIG
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        model_cfg = model_config if model_config is not None else json.loads((path / CONFIG).read_text())

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        self.bos_token = token_str(cfg.get("bos_token"))
        self.eos_token = token_str(cfg.get("eos_token"))
        eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids.append(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(ids)))
        template_file = path / CHAT_TEMPLATE  # where transformers 5 saves it
        self.chat_template: str | None = (template_file.read_text() if template_file.is_file()
                                          else cfg.get("chat_template"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        self._env = env
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        self._other_templates: dict[str, object] = {}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template: str | None = None) -> str:
        """Renders messages ({"role", "content"}, tool calls and results) into the prompt text the model
        was tuned on; ``tools`` as transformers passes them; ``template`` instead of the artifact's."""
        if template is not None:
            compiled = self._other_templates.get(template)
            if compiled is None:
                compiled = self._other_templates[template] = self._env.from_string(template)
        elif self._template is None:
            raise ValueError("this artifact has no chat template; send a raw prompt instead")
        else:
            compiled = self._template
        extra = {"tools": tools} if tools else {}
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra,
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-emitting or splitting characters.

    Decoding token by token breaks multi-byte characters and byte-level spaces; decoding a short
    window ending at the new token and diffing it against the same window without it does not.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character or a token that renders as nothing: wait for more
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
