"""What an evaluation measures on: one definition for infer-eval and for infer-build's eval stage
(whose recipe section, pipeline.config.EvalSpec, extends it with the gates and the baseline)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class EvalError(ValueError):
    """An evaluation that cannot run; the message names the input and the fix."""


@dataclass
class EvalSettings:
    """What an evaluation measures on: the same for infer-build's gates and infer-eval."""

    data: str = "pydoc_topics"  # pydoc_topics (its evaluation split) | a .txt / .jsonl file | a dataset directory
    seq_len: int = 512
    stride: int = 512
    max_windows: int = 16
    # chat prompts, rendered through the chat template: greedy agreement, and KLD / top-1 over the baseline's
    # answers. default (eval/tasks/chat_prompts.jsonl, 48) | a .txt (one a line) | a .jsonl ('prompt')
    prompts: str = "default"
    max_prompts: int = 16
    greedy_tokens: int = 32
    tasks: list[str] = field(default_factory=list)  # lm-eval tasks, e.g. [infer_lastword, infer_mc]
    task_limit: int | None = None  # documents per task (None: all)

    @classmethod
    def from_spec(cls, spec) -> "EvalSettings":
        """From a recipe's ``eval`` section (an EvalSpec or a plain dict)."""
        get = (lambda k, d: spec.get(k, d)) if isinstance(spec, dict) else (lambda k, d: getattr(spec, k, d))
        base = cls()
        return cls(**{k: (list(get(k, v)) if k == "tasks" else get(k, v)) for k, v in asdict(base).items()})

    def check(self) -> None:
        if self.seq_len < 2 or not 1 <= self.stride <= self.seq_len:
            raise EvalError(f"seq_len={self.seq_len}, stride={self.stride}: need seq_len >= 2 and 1 <= stride <= seq_len")
        if self.max_windows < 1:
            raise EvalError(f"max_windows={self.max_windows}: must be >= 1")
        if self.greedy_tokens < 1 or self.max_prompts < 0:
            raise EvalError("greedy_tokens must be >= 1 and max_prompts >= 0")
