"""bench/vllm_serve.py's rounds, without vLLM: every engine gets the same prompts for a (round, rate), and no
two (round, rate)s share prompts (a server answers prompts it saw at the previous rate from its prefix cache)."""

from __future__ import annotations

from types import SimpleNamespace

from infer.bench import vllm_serve


def test_each_rate_and_round_draws_fresh_prompts_the_same_for_every_engine(monkeypatch, tmp_path):
    seen = []  # (engine, round, rate, seed)
    state = {}
    monkeypatch.setattr(vllm_serve, "_start", lambda cmd, log, env: state.update(engine=cmd[0]) or cmd[0])
    monkeypatch.setattr(vllm_serve, "_wait_ready", lambda url, proc, log: None)
    monkeypatch.setattr(vllm_serve, "_stop", lambda proc: None)
    monkeypatch.setattr(vllm_serve, "served_model", lambda port: "m")

    def client(python, port, model, tokenizer, dataset, n, rate, out, seed=0):
        seen.append((state["engine"], out.name.rsplit("-", 1)[1], rate, seed))
        return {k: 1.0 for k in vllm_serve.METRICS}

    monkeypatch.setattr(vllm_serve, "run_client", client)
    args = SimpleNamespace(rounds=3, rates=["1", "4", "inf"], vllm_python="py", port=1, artifact="a", requests=8)
    servers = {"infer": (["infer"], None), "vllm": (["vllm"], None)}
    runs = vllm_serve.serve_rounds(args, servers, [], tmp_path)
    assert len(seen) == 2 * 3 * 3 and all(len(runs[r][s]) == 3 for r in args.rates for s in servers)
    by_engine = {e: sorted((rnd, rate, seed) for en, rnd, rate, seed in seen if en == e) for e in ("infer", "vllm")}
    assert by_engine["infer"] == by_engine["vllm"]  # the same prompts for both engines
    seeds = [seed for _, _, seed in by_engine["infer"]]
    assert len(set(seeds)) == len(seeds) == 9  # no (round, rate) repeats another's prompts
