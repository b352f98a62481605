"""Tensor-parallel serving (runtime/parallel): sharded artifacts give the unsharded model's greedy
tokens through ``LLM`` and the HTTP server, a killed rank gives a clear 503 naming it, and a
changed rank file is refused naming it.

The embedded model (SmolLM2-135M: 9 query heads, 3 KV heads) divides only into tp=3, so the real
weights run as 3 ranks (one thread each on this 2-core machine); tp=2 runs on a small random Qwen2
(8 heads, 4 KV heads, q/k/v biases), through LLM and through torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from infer.runtime import LLM, SamplingParams
from infer.runtime.artifact import ArtifactError, verify_artifact
from infer.runtime.parallel import distributed as d
from conftest import agree_until_a_near_tie
from test_server import free_port, launch_server, wait_ready

# varied prompts: short and long (over the 32-token step budget: chunked), three sharing a long
# prefix (prefix caching), code, digits
SHARED = "You are a careful assistant. Answer briefly and precisely, in one sentence, without lists. " * 3
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
           "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,", SHARED + "Question: what is the boiling point of water?",
           SHARED + "Question: who wrote Hamlet?", SHARED + "Question: how many legs does a spider have?",
           "A long time ago " * 12 + "the", "import numpy as np\n", "Q: What is 7 times 8?\nA:"]
MAX_TOKENS = [24, 20, 24, 16, 20, 20, 20, 12, 24, 16]
ENGINE = {"kv_cache_memory": 64 << 20, "max_num_batched_tokens": 32, "enable_prefix_caching": True,
          "max_num_seqs": 8}


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _build(source, tmp: Path, cache_dir: Path, *overrides: str) -> Path:
    from infer.pipeline.build import build
    from infer.pipeline.config import compose_recipe

    return build(compose_recipe([f"model.source={source}", f"output_dir={tmp}", f"cache_dir={cache_dir}",
                                 *overrides])).artifact


def _alive(pids) -> list[int]:
    return [p for p in pids if d.pid_alive(p)]


def _gone_within(pids, seconds: float) -> bool:
    return bool(d.wait_until(lambda: not _alive(pids), seconds, 0.1))


@pytest.fixture(scope="module")
def tp3_artifact(embedded_artifact, cache_dir, tmp_path_factory) -> Path:
    return _build(embedded_artifact, tmp_path_factory.mktemp("tp3") / "smollm2-tp3", cache_dir, "parallel.tp=3")


@pytest.fixture(scope="module")
def base(embedded_artifact):
    """The unsharded model (tp=1), with the same engine settings."""
    with LLM(embedded_artifact, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(base) -> list:
    return base.generate(PROMPTS, _params())


@pytest.fixture(scope="module")
def tiny(embedded_artifact, cache_dir, tmp_path_factory) -> dict[int, Path]:
    """A random Qwen2 (hidden 256, 8 heads, 4 KV heads, biased q/k/v, peaked logits) with the embedded
    model's tokenizer, built at tp=1 and tp=2."""
    import transformers

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.1,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(root / "src", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_artifact / name, root / "src" / name)
    return {tp: _build(root / "src", root / f"tp{tp}", cache_dir, f"parallel.tp={tp}", "tune.enabled=false",
                       "artifact.name=tiny") for tp in (1, 2)}


# ---------------------------------------------------------------------------- building

def test_the_embedded_model_splits_into_three_not_two(embedded_artifact, cache_dir, tmp_path):
    from infer.pipeline.build import BuildError

    with pytest.raises(BuildError, match=r"num_attention_heads=9 is not divisible by 2 .*: \[1, 3\]"):
        _build(embedded_artifact, tmp_path / "o", cache_dir, "parallel.tp=2")


# ---------------------------------------------------------------------------- the offline API

def test_llm_tp3_gives_the_unsharded_greedy_tokens(tp3_artifact, base, reference, caplog):
    caplog.set_level("INFO", logger="infer.parallel")
    with LLM(tp3_artifact, **ENGINE) as llm:
        procs = llm.engine.ranks.procs
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        cores = len(os.sched_getaffinity(0))
        threads = max(1, cores // 3)  # the machine's cores split between its 3 ranks, at least one each
        assert torch.get_num_threads() == threads
        assert f"{threads} thread(s) per rank ({cores} cores / 3 ranks" in caplog.text
        outs = llm.generate(PROMPTS, _params())
        # the whole-sequence forward (evaluation's) runs on every rank too
        ids = torch.tensor([llm.tokenizer.encode(PROMPTS[1]) + outs[1].token_ids])
        sharded_logits = llm.engine.model.logits(ids)[0]
    assert all(p.poll() == 0 for p in procs), [p.returncode for p in procs]  # told to stop, not killed
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.text for o in outs] == [o.text for o in reference]
    assert max(o.num_cached_tokens for o in outs) >= 32  # the shared prefix came from the cache
    assert max(len(o.prompt_token_ids) for o in outs) > ENGINE["max_num_batched_tokens"]  # chunked
    # how close, on the real weights: the row-parallel sums round differently from one matmul
    full_logits = base.engine.model.logits(ids)[0]
    diff = (sharded_logits - full_logits).abs().max().item()
    top2 = full_logits.topk(2, -1).values
    assert diff < 1e-3, diff
    assert (sharded_logits.argmax(-1) == full_logits.argmax(-1)).all()
    assert (top2[:, 0] - top2[:, 1]).min().item() > 10 * diff  # greedy picks were never near a tie


def test_llm_tp2_on_a_small_qwen2_and_no_orphans(tiny):
    with LLM(tiny[1], **ENGINE) as base:
        want = base.generate(PROMPTS, _params())
    llm = LLM(tiny[2], **ENGINE)
    pids = [p.pid for p in llm.engine.ranks.procs]
    got = llm.generate(PROMPTS, _params())
    llm.close()
    assert _gone_within(pids, 15)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    late = llm.generate(PROMPTS[:1], _params()[0])[0]  # after close: that request fails, saying why
    assert late.finish_reason == "error" and "tensor-parallel group is closed" in late.error


def test_tp2_on_an_int8_kv_cache_gives_tp1s_tokens(tiny):
    """kv_cache_dtype=int8 at tp=2: every rank allocates its KV heads' cache in int8 (each reports it) and
    the greedy tokens are tp=1's on the int8 cache, up to a near tie (the row-parallel sums round otherwise)."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20) for _ in PROMPTS]
    with LLM(tiny[1], **ENGINE, kv_cache_dtype="int8") as base:
        want = base.generate(PROMPTS, params)
    with LLM(tiny[1], **ENGINE) as base:
        plain = base.generate(PROMPTS, params)
    with LLM(tiny[2], **ENGINE, kv_cache_dtype="int8") as llm:
        assert llm.engine.runner.kv_cache.dtype == torch.int8
        assert [r["kv_dtype"] for r in llm.engine.ranks.ranks.values()] == ["int8"]
        got = llm.generate(PROMPTS, params)
    off = agree_until_a_near_tie(got, want)
    # a rounding difference upstream can move a value across an int8 step: the scale is int8's own error
    int8_error = agree_until_a_near_tie(want, plain, tie=1.0)
    print("tp2 - tp1 on int8 caches, largest logprob difference before any tie:", off, "int8 - 16-bit cache:",
          int8_error)
    assert off < max(1e-3, int8_error / 4), (off, int8_error)


# ---------------------------------------------------------------------------- the HTTP server

def _complete(url: str, prompt: str, max_tokens: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def _rank_pids(log: str) -> list[int]:
    m = re.search(r"started on this machine \(pid ([\d, ]+)\)", log)
    assert m, log
    return [int(p) for p in m.group(1).split(", ")]


def test_server_tp3_matches_and_a_killed_rank_gives_503_naming_it(tp3_artifact, reference, tmp_path):
    server = launch_server(tp3_artifact, tmp_path, "--kv-cache-memory", "64M", "--max-num-batched-tokens", "32",
                           "--max-num-seqs", "8")
    try:
        wait_ready(server, 300)
        pids = _rank_pids(server.log())
        assert "1 thread(s) per rank" in server.log()
        results: dict[int, httpx.Response] = {}

        def send(i):
            results[i] = _complete(server.url, PROMPTS[i], MAX_TOKENS[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert all(results[i].status_code == 200 for i in range(len(PROMPTS))), [r.text for r in results.values()]
        texts = [results[i].json()["choices"][0]["text"] for i in range(len(PROMPTS))]
        assert texts == [o.text for o in reference]
        assert [results[i].json()["usage"]["completion_tokens"] for i in range(len(PROMPTS))] == MAX_TOKENS

        # a long request in flight, then rank 1 is killed outright
        inflight: dict = {}
        t = threading.Thread(target=lambda: inflight.setdefault("r", _complete(server.url, PROMPTS[0], 1000)))
        t.start()
        time.sleep(1.0)
        os.kill(pids[0], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the in-flight request hung after its rank died"
        assert inflight["r"].status_code >= 500 and "rank 1" in inflight["r"].text, inflight["r"].text
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "tensor-parallel rank 1" in health.json()["error"] and "SIGKILL" in health.json()["error"]
        refused = _complete(server.url, "Hello", 4)
        assert refused.status_code == 503 and "rank 1" in refused.text
        assert _gone_within(pids[1:], 15)  # rank 2, out of step, was stopped too
    finally:
        assert server.stop() is not None
    assert _gone_within(pids, 15)


def test_workers_exit_when_rank0_is_killed(tiny, tmp_path):
    server = wait_ready(launch_server(tiny[2], tmp_path, "--kv-cache-memory", "64M"), 180)
    pids = _rank_pids(server.log())
    assert _alive(pids) == pids
    server.proc.kill()  # SIGKILL: no atexit, no stop message
    server.proc.wait(10)
    assert _gone_within(pids, 15), "a worker outlived rank 0"


def test_torchrun_launch_serves_the_same(tiny, tmp_path):
    """``torchrun --nproc-per-node 2 --no-python infer-run ART``: env:// rendezvous, rank 0 serves."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    bin_dir = Path(sys.executable).parent
    log_path = tmp_path / "torchrun.log"
    with LLM(tiny[1], **ENGINE) as base:
        want = base.generate(PROMPTS[:3], _params()[:3])
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(bin_dir / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
                                 "--no-python", str(bin_dir / "infer-run"), str(tiny[2]), "--port", str(port),
                                 "--kv-cache-memory", "64M", "--max-num-batched-tokens", "32"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"torchrun-launched infer-run not ready:\n{log_path.read_text()}")
        assert "launched by the environment (env://" in log_path.read_text()
        texts = [_complete(url, PROMPTS[i], MAX_TOKENS[i]).json()["choices"][0]["text"] for i in range(3)]
        assert texts == [o.text for o in want]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


# ---------------------------------------------------------------------------- verification

def test_a_changed_rank_file_is_refused_naming_it(tiny, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny[2], art)
    digest = d.manifest_digest(verify_artifact(art))
    with open(art / "rank1.safetensors", "r+b") as f:
        f.seek(-4, 2)
        last = f.read(1)
        f.seek(-4, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ArtifactError, match=r"rank1\.safetensors: sha256 differs from the manifest"):
        verify_artifact(art)
    # a worker checks its own file too (on another machine rank 0 never saw it)
    with pytest.raises(ArtifactError, match=r"rank1\.safetensors: missing or differs from the manifest on rank 1"):
        d.verify_rank(art, 1, digest)
    d.verify_rank(art, 0, digest)  # rank 0's file is intact
    with pytest.raises(ArtifactError, match=r"differs from rank 0's"):
        d.verify_rank(art, 0, "0" * 64)
    cli = subprocess.run([str(Path(sys.executable).parent / "infer-run"), str(art), "--prompt", "hi"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 2 and "rank1.safetensors" in cli.stderr, cli.stderr


def test_a_gated_tp2_build_evaluates_across_its_ranks(tiny, cache_dir, tmp_path):
    """The build's eval and gates run on the sharded artifact (the whole-sequence forward on every
    rank included), here against the tp=1 build as the baseline: the same model, so every agreement is 1."""
    result = _build(tiny[1].parent / "src", tmp_path / "gated", cache_dir, "parallel.tp=2", "tune.enabled=false",
                    "artifact.name=tiny", "eval.max_windows=2", "eval.seq_len=128", "eval.stride=128",
                    "eval.max_prompts=3", "eval.greedy_tokens=8", f"eval.baseline={tiny[1]}",
                    "eval.gates.greedy_agreement_min=1.0", "eval.gates.top1_agreement_min=1.0")
    doc = json.loads((result / "eval.json").read_text())
    comp = doc.get("evaluation", doc)["comparison"]
    assert comp["greedy_agreement"] == 1.0 and comp["top1_agreement"] == 1.0, comp
    assert comp["mean_kld"] < 1e-5 and max(comp["layer_hidden_error"]) < 1e-4, comp
