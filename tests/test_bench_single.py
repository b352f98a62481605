"""bench/single.py's bandwidth floor (the bytes a batch-1 decode step reads, from the checkpoint), and
the host every benchmark names."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from infer.bench.single import STEADY, bracketed, read_bandwidth, steady_shares, weight_bytes


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_what_a_decode_step_reads(tmp_path, tied):
    embed, proj, packed = torch.zeros(100, 8), torch.zeros(8, 8), torch.zeros(4, 2, dtype=torch.int32)
    tensors = {"model.embed_tokens.weight": embed, "model.layers.0.q_proj.weight": proj,
               "model.layers.0.o_proj.weight_packed": packed}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(100, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    head = 100 * 8  # tied: the embedding is the LM head, read whole; untied: lm_head is, one embedding row is not counted
    want = lambda width: (head + 64) * width + 8 * 4  # noqa: E731  float tensors at the compute width, int32 as stored
    assert weight_bytes(tmp_path, "bfloat16") == want(2)
    assert weight_bytes(tmp_path, "float32") == want(4)


def test_read_bandwidth_is_the_gib_over_the_median_round(monkeypatch):
    """What the figure is: 1 GiB read over the median round's time (rounds of 1, 2 and 4 s: 2 s), and on
    this host a rate a CPU's memory can have (1 GB/s to 1 TB/s: a 1 GiB read is past every cache)."""
    ticks = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0])
    with monkeypatch.context() as m:
        m.setattr("infer.bench.single.time.perf_counter", lambda: next(ticks))
        assert read_bandwidth(rounds=3) == 2**30 / 2.0
    gb_s = read_bandwidth(rounds=3) / 1e9
    assert 1 < gb_s < 1000, gb_s


@pytest.mark.parametrize("before, after, steady", [(30e9, 33e9, True), (30e9, 60e9, False), (60e9, 30e9, False)])
def test_bracketed_probes_around_the_run_and_says_whether_they_agree(monkeypatch, before, after, steady):
    """The run happens between the two probes; the floor is their mean; a run whose probes differ by more than
    STEADY (the host's bandwidth changed phase during it) is flagged, and steady_shares leaves its round out."""
    calls = []
    probes = iter([before, after])
    monkeypatch.setattr("infer.bench.single.read_bandwidth", lambda rounds=3: calls.append("probe") or next(probes))
    out, mean, ok = bracketed(lambda: calls.append("run") or "result")
    assert (out, calls, mean, ok) == ("result", ["probe", "run", "probe"], (before + after) / 2, steady)
    assert (max(before, after) / min(before, after) <= STEADY) == steady
    assert steady_shares([10.0, 20.0, 30.0], [20.0, 40.0, 30.0], [True, ok, True]) == ([0.5, 0.5, 1.0] if ok else [0.5, 1.0])


def test_every_benchmark_describes_its_host_in_one_shape():
    """One function describes the host for every benchmark's JSON: the tuning table's hardware() and
    what a figure also depends on; no benchmark writes its own."""
    from infer.bench.throughput import host_info
    from infer.runtime.tuning import hardware

    host = host_info()
    assert host.items() >= hardware().items()
    assert {"host", "flags", "native_class", "torch_threads", "mem_available_gb", "load_average"} <= set(host)
    bench = Path(__file__).resolve().parent.parent / "bench"
    assert [p.name for p in sorted(bench.glob("*.py")) if "def host_info(" in p.read_text()] == ["throughput.py"]
