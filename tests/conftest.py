"""Shared fixtures: one build of the embedded model per test session, in a private cache."""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import sys
from pathlib import Path

# Triton decides at import time (in @triton.jit, triton.language's own helpers included) whether kernels
# are interpreted, and transformers imports triton as a side effect; so the choice is made here, before
# any test module is collected. The kernel tests run CPU tensors through the interpreter on every host;
# bench/device_check.py is what runs the compiled kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _amx_modes():
    """Both linear/attention paths where the host can run both: AMX forced off (what every non-AMX
    host runs) and on. On a host without AMX the AMX case is skipped, and the reason says so."""
    from infer.kernels.resolver import cpu_has_amx

    return [pytest.param(False, id="no-amx"),
            pytest.param(True, id="amx", marks=pytest.mark.skipif(
                not cpu_has_amx(), reason="this CPU has no AMX: only the no-amx path can run here, and it did"))]


AMX_MODES = _amx_modes()


@pytest.fixture(autouse=True)
def fresh_seed(request) -> int:
    """Seeds torch and random afresh for every test and prints the seed (and names it in a failure
    report): ``INFER_TEST_SEED=N`` gives a failing test the same random inputs again."""
    seed = int(os.environ.get("INFER_TEST_SEED") or secrets.randbelow(2**31))
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed} (INFER_TEST_SEED={seed} reproduces it)")
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("random inputs", f"rerun with INFER_TEST_SEED={seeds[0]} for the same inputs"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("infer-cache")


@pytest.fixture(scope="session")
def embedded_artifact(tmp_path_factory, cache_dir) -> Path:
    """The default recipe built into a temporary directory (float32)."""
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    out = tmp_path_factory.mktemp("artifacts") / "smollm2"
    # untuned: a table measured during the test run would switch kernels from run to run (tests/test_tune.py
    # and test_build.py cover the tuned build)
    build(compose_recipe([f"output_dir={out}", f"cache_dir={cache_dir}", "tune.enabled=false"]))
    return out


@pytest.fixture(scope="session")
def tiny_artifact(embedded_artifact, tmp_path_factory, cache_dir) -> Path:
    """A 2-layer random Llama (seed 0) with the embedded model's tokenizer and chat template, float32: loads in
    seconds, for tests of serving machinery rather than of the model."""
    import shutil

    import torch
    import transformers

    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    src = tmp_path_factory.mktemp("tiny-src")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_artifact / name, src / name)
    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    build(compose_recipe([f"model.source={src}", "artifact.name=tiny", f"output_dir={out}", f"cache_dir={cache_dir}",
                          "tune.enabled=false"]))
    return out


@pytest.fixture(scope="session")
def embedded_llm(embedded_artifact):
    from infer.runtime import LLM

    return LLM(embedded_artifact, kv_cache_memory=512 << 20)


@pytest.fixture(scope="session")
def hf_reference(embedded_artifact):
    """transformers' own model on the artifact's files: the reference, never the thing tested."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_artifact, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(embedded_artifact)
    return model, tok


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs a console script of this package the way a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    bin_dir = Path(sys.executable).parent
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


def need(module: str):
    """Imports ``module``, a package an extra of infer declares. Missing on an install that has that extra
    (another of its packages is there, or an extra that pulls it in, such as dev), the install is broken: a
    failure. On an install without the extra (core only), a skip that says which extra to install."""
    import importlib
    import re
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = e
    name = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731 - a distribution's canonical name
    extras: dict[str, list[Requirement]] = {}
    for line in metadata.requires("infer") or []:
        req = Requirement(line)
        for extra in re.findall(r'extra == "([^"]+)"', str(req.marker or "")):
            extras.setdefault(extra, []).append(req)

    def present(extra: str) -> bool:  # evidence: another of its packages (not pytest, which runs every test)
        for req in extras.get(extra, []):
            if name(req.name) in ("infer", "pytest", name(module)):
                continue
            try:
                metadata.version(req.name)
                return True
            except metadata.PackageNotFoundError:
                continue
        return False

    wanted = [x for x, reqs in extras.items() if any(name(r.name) == name(module) for r in reqs)]
    pulling = {x for x, reqs in extras.items() for r in reqs if name(r.name) == "infer" and set(wanted) & r.extras}
    installed = [x for x in [*wanted, *sorted(pulling)] if present(x)]
    if installed:
        pytest.fail(f"{module} is missing although infer[{installed[0]}], which declares it, is installed "
                    f"({type(missing).__name__}: {missing}); reinstall: pip install -e '.[{installed[0]}]'")
    pytest.skip(f"{module} is not installed: a core-only install; pip install -e '.[{wanted[0] if wanted else 'dev'}]'")


def agree_until_a_near_tie(got, want, tie: float = 0.1) -> float:
    """Two greedy runs of the same prompts (``generate`` outputs with ``logprobs`` >= 1): the largest difference
    of the chosen tokens' logprobs over each answer's common prefix. Where the answers part, the reference
    ``want`` must have had a near tie there (``got``'s token within ``tie`` of its best logprob, among its top
    candidates): rounding may flip a tie, and nothing after it is comparable."""
    worst = 0.0
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            if a["token_id"] != b["token_id"]:
                top = dict(b["top"])
                assert a["token_id"] in top and b["logprob"] - top[a["token_id"]] < tie, \
                    f"the answers part where the reference has no near tie: {a} vs {b}"
                break
            worst = max(worst, abs(a["logprob"] - b["logprob"]))
    return worst


def hf_greedy(ref, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (``ref``: a causal LM), ``max_tokens`` each, no EOS."""
    out = []
    for prompt in prompts:
        x = torch.tensor([prompt])
        with torch.no_grad():
            gen = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def greedy_gaps(llm, ref, prompts, max_tokens: int = 16) -> list[tuple[float, float]]:
    """Greedy-decodes ``prompts`` through the engine and scores each answer with the float reference model
    ``ref`` (transformers): per prompt, (the worst gap between the reference's best logprob and the chosen
    token's, the worst difference between the engine's logprob of the chosen token and the reference's)."""
    from infer.runtime import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0))
    gaps = []
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logp = ref(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        chosen = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        gap = (logp.max(-1).values - chosen).max().item()
        off = (torch.tensor([a["logprob"] for a in out.logprobs]) - chosen).abs().max().item()
        print("engine: worst argmax gap", gap, "logprob diff", off)
        gaps.append((gap, off))
    return gaps
