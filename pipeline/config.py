"""The recipe schema: every key a recipe may set, its type, its default and its allowed values.

Each default is stated here once: Hydra composes a recipe from ``recipes/`` on top of these
dataclasses' defaults (``recipe_defaults``, first in recipes/build.yaml), so a recipe's YAML holds only
what differs and any key can be overridden on the command line; ``validate`` merges the result onto this
schema so that an unknown key or a bad value fails before any stage runs, with the key and the valid
choices named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from infer.eval.settings import EvalSettings
from infer.runtime.engine.speculative import MAX_NUM_TOKENS, SpeculativeConfig


class RecipeError(ValueError):
    """A recipe that cannot be built; the message names the key and the fix."""


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class QuantMethod(str, Enum):
    none = "none"
    gptq = "gptq"
    awq = "awq"
    w8a8 = "w8a8"
    fp8 = "fp8"


@dataclass
class ModelSpec:
    # embedded:<name> | a local HF directory | a .gguf file | a hub id (org/name)
    source: str = "embedded:smollm2-135m-instruct"
    revision: str | None = None  # hub revision (branch, tag or commit)
    dtype: DType = DType.float32


@dataclass
class QuantSpec:
    method: QuantMethod = QuantMethod.none  # the defaults are an unquantized recipe's
    bits: int = 16
    group_size: int = -1  # -1: one group per output channel
    symmetric: bool = True
    act_order: bool = False
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    # SmoothQuant's alpha (w8a8 only), 0: no SmoothQuant; a list of candidates is built and gated in
    # order, the first passing kept (pipeline/gate.py, choose_and_build)
    smoothing_strength: Any = 0.8
    dampening_frac: float = 0.01  # GPTQ Hessian dampening
    # the most GiB of the model's weights the quantize stage holds in memory; a larger checkpoint's layers wait on
    # disk (compressed-tensors' disk offload, in the stage's temporary directory) and are read in as calibrated.
    # None: 40% of this machine's RAM. Not part of the stage key: where the weights wait does not change a byte.
    memory_gib: float | None = None
    # layers quantized at wide_bits (int8 per channel, weight-only) instead of bits: a second config group
    wide_layers: list[str] = field(default_factory=list)
    wide_bits: int = 8
    # accuracy-gated mixed precision: widen the layers whose quantization hurts most (gptq/awq: to int8,
    # wide_layers; fp8/w8a8: to float, added to ignore), until the eval gates pass or the artifact is
    # size_budget_pct larger than the plain quantized one (pipeline/quantize.py, auto_steps)
    auto: bool = False
    size_budget_pct: float = 10.0
    auto_steps: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])  # shares of the budget, in turn


@dataclass
class CalibSpec:
    data: str = "pydoc_topics"  # pydoc_topics | a .txt / .jsonl file | a dataset directory
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    # share of the windows rendered through the model's chat template (user/assistant turns, special
    # tokens); the rest raw text. What a chat model is asked is what its quantization should see.
    chat_fraction: float = 0.5


@dataclass
class TuneSpec:
    # the tune stage (pipeline/tune.py, runtime/tuning_measure.py): times the runtime's kernel alternatives per
    # batch-size bucket on the build machine and writes tuning.json into the artifact
    enabled: bool = True
    batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    table: str | None = None  # reuse this tuning.json instead of measuring (a byte-identical CI build)


@dataclass
class GateSpec:
    # None: no such gate. Against the baseline (eval.baseline), on held-out text:
    ppl_increase_pct: float | None = None  # max perplexity increase, percent
    top1_agreement_min: float | None = None  # min share of tokens whose top-1 matches the baseline's
    mean_kld_max: float | None = None  # max mean KL divergence from the baseline's next-token distributions
    # and on the chat prompts (eval.prompts, through the chat template):
    greedy_agreement_min: float | None = None  # min greedy agreement with the baseline's answers
    chat_top1_agreement_min: float | None = None  # min top-1 agreement over the baseline's answers
    chat_mean_kld_max: float | None = None  # max mean KL divergence over the baseline's answers


@dataclass
class EvalSpec(EvalSettings):
    """The recipe's ``eval`` section: what is measured (infer.eval.settings.EvalSettings: data,
    windows, prompts, tasks), and here whether, against what, and which gates decide."""
    # Evaluation runs before publish when enabled, or when any gate or task is set.
    enabled: bool = False
    # unquantized: this recipe with quant.method=none (built as cached stages) | none | an artifact directory
    baseline: str = "unquantized"
    baseline_dtype: DType | None = None  # the unquantized baseline's dtype; None: model.dtype
    junit: str | None = None  # write JUnit XML (one test case per gate) here; not part of the artifact
    gates: GateSpec = field(default_factory=GateSpec)


@dataclass
class KVCacheSpec:
    # the KV cache format the artifact states (pipeline/kv_cache.py): bfloat16 (the model's own 16-bit cache,
    # nothing measured) | int8 (gated: a failure is a build error) | auto (the narrowest format whose gates pass)
    dtype: str = "bfloat16"
    mean_kld_max: float = 0.002  # against the model's own cache, the model in float32, every position
    top1_agreement_min: float = 0.98
    window_tokens: int = 2048  # held-out windows (eval.data) this long: long contexts, where quantized keys tell
    windows: int = 2


@dataclass
class SpeculativeSpec:
    # the speculative decoding infer-run uses unless told otherwise (manifest serving.speculative; --speculative
    # overrides it): off | ngram (prompt lookup; a draft artifact is named at run time, --speculative-draft DIR)
    method: str = "off"
    # the runtime's defaults (runtime/engine/speculative.py SpeculativeConfig)
    num_tokens: int = SpeculativeConfig.num_tokens  # the most draft tokens a step verifies
    adaptive: bool = SpeculativeConfig.adaptive  # k per step from the sequence's acceptance
    # a verify row's cost in decode steps, which the adaptive k weighs: null measures it where it is served
    verify_cost: float | None = SpeculativeConfig.verify_cost


@dataclass
class ParallelSpec:
    tp: int = 1  # tensor-parallel ranks; > 1 adds the shard stage after quantize (pipeline/shard.py)


@dataclass
class ArtifactSpec:
    name: str = "model"
    version: str = "0.1.0"


@dataclass
class BuildConfig:
    recipe: str = "smollm2_135m"
    output_dir: str = "artifacts/${artifact.name}-${artifact.version}"
    cache_dir: str = "${oc.env:INFER_CACHE_DIR,${oc.env:HOME}/.cache/infer}"
    model: ModelSpec = field(default_factory=ModelSpec)
    quant: QuantSpec = field(default_factory=QuantSpec)
    calib: CalibSpec = field(default_factory=CalibSpec)
    tune: TuneSpec = field(default_factory=TuneSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    kv_cache: KVCacheSpec = field(default_factory=KVCacheSpec)
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    artifact: ArtifactSpec = field(default_factory=ArtifactSpec)


def _keys(cls, prefix: str = "") -> list[str]:
    hints = get_type_hints(cls)
    out: list[str] = []
    for f in fields(cls):
        t = hints[f.name]
        out += _keys(t, f"{prefix}{f.name}.") if is_dataclass(t) else [prefix + f.name]
    return out


ALL_KEYS = _keys(BuildConfig)
_VERSION = re.compile(r"^\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def validate(cfg: DictConfig | dict) -> BuildConfig:
    """Typed, checked recipe; raises RecipeError naming the first bad key."""
    raw = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"]) if "hydra" in raw else raw
    try:  # resolve ${...} on the plain strings, so ${model.dtype} reads float32, not DType.float32
        raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=True))
    except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside a Hydra run: left for later
        pass
    try:
        merged = OmegaConf.merge(OmegaConf.structured(BuildConfig), raw)
    except ConfigKeyError as e:
        section = e.full_key.rsplit(".", 1)[0] if "." in str(e.full_key) else ""
        valid = [k for k in ALL_KEYS if k.startswith(section + ".")] if section else ALL_KEYS
        raise RecipeError(f"unknown recipe key '{e.full_key}'; valid keys here: {', '.join(valid)}") from None
    except ValidationError as e:
        raise RecipeError(f"bad value for recipe key '{e.full_key}': {e.msg}") from None
    built: BuildConfig = OmegaConf.to_object(merged)
    _check(built)
    return built


def _check(c: BuildConfig) -> None:
    def bad(key, value, why):
        raise RecipeError(f"bad value for recipe key '{key}': {value!r} ({why})")

    if not c.model.source:
        bad("model.source", c.model.source, "name a checkpoint: embedded:smollm2-135m-instruct, a directory, a .gguf file or a hub id")
    if not _NAME.match(c.artifact.name):
        bad("artifact.name", c.artifact.name, "letters, digits, '.', '_' and '-' only")
    if c.parallel.tp < 1:
        bad("parallel.tp", c.parallel.tp, "the number of tensor-parallel ranks: 1 (no sharding) or more")
    if not _VERSION.match(c.artifact.version):
        bad("artifact.version", c.artifact.version, "a semantic version such as 1.2.0")
    q = c.quant
    if q.method != QuantMethod.none:
        allowed_bits = {QuantMethod.gptq: (4, 8), QuantMethod.awq: (4,), QuantMethod.w8a8: (8,), QuantMethod.fp8: (8,)}[q.method]
        if q.bits not in allowed_bits:
            bad("quant.bits", q.bits, f"{q.method.value} takes bits in {list(allowed_bits)}")
        if q.group_size != -1 and (q.group_size < 8 or q.group_size & (q.group_size - 1)):
            bad("quant.group_size", q.group_size, "a power of two >= 8, or -1 for per-channel")
        strengths = q.smoothing_strength if isinstance(q.smoothing_strength, list) else [q.smoothing_strength]
        if not strengths or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a < 1.0
                                    for a in strengths):
            bad("quant.smoothing_strength", q.smoothing_strength,
                "a number in [0, 1) (0: no SmoothQuant) or a list of such candidates, e.g. [0, 0.5, 0.8]")
        if q.wide_bits != 8:
            bad("quant.wide_bits", q.wide_bits, "valid choices: 8")
        if not 0.0 < q.size_budget_pct <= 100.0:
            bad("quant.size_budget_pct", q.size_budget_pct, "a percentage in (0, 100]")
        steps = list(q.auto_steps)
        if not steps or any(not 0.0 < x <= 1.0 for x in steps) or steps != sorted(set(steps)):
            bad("quant.auto_steps", q.auto_steps, "increasing shares of the size budget in (0, 1], e.g. [0.25, 0.5, 1.0]")
        if not 0.0 <= q.dampening_frac < 1.0:
            bad("quant.dampening_frac", q.dampening_frac, "must be in [0, 1)")
        if q.memory_gib is not None and not q.memory_gib > 0:
            bad("quant.memory_gib", q.memory_gib, "GiB of weights held in memory, > 0 (null: 40% of this machine's RAM)")
        if c.calib.samples < 1:
            bad("calib.samples", c.calib.samples, "must be >= 1")
        if c.calib.seq_len < 16:
            bad("calib.seq_len", c.calib.seq_len, "must be >= 16")
        if not 0.0 <= c.calib.chat_fraction <= 1.0:
            bad("calib.chat_fraction", c.calib.chat_fraction, "a share in [0, 1]: 0 raw text only, 1 chat only")
    kv = c.kv_cache
    if kv.dtype not in ("auto", "bfloat16", "int8"):
        bad("kv_cache.dtype", kv.dtype, "valid choices: auto, bfloat16, int8")
    if kv.window_tokens < 2048 or kv.windows < 1:
        bad("kv_cache.window_tokens", kv.window_tokens, "windows of at least 2048 tokens (long contexts), at least one")
    if kv.mean_kld_max < 0 or not 0.0 <= kv.top1_agreement_min <= 1.0:
        bad("kv_cache.mean_kld_max", kv.mean_kld_max, "mean_kld_max >= 0 and top1_agreement_min a share in [0, 1]")
    if kv.dtype != "bfloat16" and c.parallel.tp > 1:
        bad("kv_cache.dtype", kv.dtype, "the KV gate measures in one process, not on tensor-parallel ranks: build "
            "with bfloat16 and serve with `infer-run --kv-cache-dtype int8` (each rank then holds its heads in int8)")
    s = c.speculative
    if s.method not in ("off", "ngram"):
        bad("speculative.method", s.method, "off or ngram (a draft artifact is named where it is served: infer-run "
                                            "--speculative draft --speculative-draft DIR)")
    if not 1 <= s.num_tokens <= MAX_NUM_TOKENS:
        bad("speculative.num_tokens", s.num_tokens, f"draft tokens a step, in [1, {MAX_NUM_TOKENS}]")
    if s.verify_cost is not None and not 0.0 < s.verify_cost <= 1.0:
        bad("speculative.verify_cost", s.verify_cost, "a verify row's cost in decode steps, in (0, 1], or null: "
                                                   "measured where it is served")
    if any(b < 1 for b in c.tune.batch_buckets):
        bad("tune.batch_buckets", c.tune.batch_buckets, "batch sizes must be >= 1")
    if c.eval.seq_len < 2 or c.eval.stride < 1 or c.eval.stride > c.eval.seq_len:
        bad("eval.stride", c.eval.stride, "need seq_len >= 2 and 1 <= stride <= seq_len")
    if c.eval.max_windows < 1:
        bad("eval.max_windows", c.eval.max_windows, "must be >= 1")
    if c.eval.greedy_tokens < 1 or c.eval.max_prompts < 0:
        bad("eval.greedy_tokens", c.eval.greedy_tokens, "greedy_tokens must be >= 1 and max_prompts >= 0")
    g = c.eval.gates
    if g.top1_agreement_min is not None and not 0.0 <= g.top1_agreement_min <= 1.0:
        bad("eval.gates.top1_agreement_min", g.top1_agreement_min, "a share in [0, 1]")
    if g.greedy_agreement_min is not None and not 0.0 <= g.greedy_agreement_min <= 1.0:
        bad("eval.gates.greedy_agreement_min", g.greedy_agreement_min, "a share in [0, 1]")
    if g.chat_top1_agreement_min is not None and not 0.0 <= g.chat_top1_agreement_min <= 1.0:
        bad("eval.gates.chat_top1_agreement_min", g.chat_top1_agreement_min, "a share in [0, 1]")
    if g.chat_mean_kld_max is not None and g.chat_mean_kld_max < 0:
        bad("eval.gates.chat_mean_kld_max", g.chat_mean_kld_max, "must be >= 0")
    if g.mean_kld_max is not None and g.mean_kld_max < 0:
        bad("eval.gates.mean_kld_max", g.mean_kld_max, "must be >= 0")


def to_plain(c: BuildConfig) -> dict[str, Any]:
    """The recipe as plain JSON-able data (enums as strings)."""
    return OmegaConf.to_container(OmegaConf.structured(c), enum_to_str=True)


# Hydra's base config: every key at its default, as plain values rather than a typed node, so that a bad
# key or value reaches validate(), which names the key and the valid choices.
ConfigStore.instance().store(name="recipe_defaults", node=to_plain(BuildConfig()))


def compose_recipe(overrides: list[str] | tuple[str, ...] = ()) -> BuildConfig:
    """The recipe that ``infer-build OVERRIDES...`` would build, for use from Python."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="infer.recipes", version_base=None):
        raw = compose(config_name="build", overrides=list(overrides))
    return validate(raw)


def baseline_dtype(cfg: BuildConfig):
    return cfg.eval.baseline_dtype or cfg.model.dtype


def baseline_config(cfg: BuildConfig) -> BuildConfig:
    """The same recipe, unquantized, at the baseline dtype; never itself gated."""
    return replace(cfg, quant=QuantSpec(),
                   model=replace(cfg.model, dtype=baseline_dtype(cfg)), eval=EvalSpec(),
                   artifact=replace(cfg.artifact, name=f"{cfg.artifact.name}-baseline"))
