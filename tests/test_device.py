"""Device placement on the CPU: the device setting, the kernels it allows, and that what the runner
and the sampler make lands on the runner's device. This machine has no GPU, so device="cpu" is the
one checked end to end here; the CUDA cases marked below run where a GPU is (bench/device_check.py's
engine section compares a CUDA engine's tokens with a CPU engine's)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels.resolver import resolve, resolve_device

CPU = torch.device("cpu")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: this checks the error "
                             "a machine without one gives")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent here: device='cpu' is "
                                "checked by the tests above; bench/device_check.py checks a CUDA engine on a GPU")


def test_the_device_setting_resolves():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="choose one of auto, cpu, cuda"):
        resolve_device("gpu")


@NO_CUDA
def test_device_cuda_without_cuda_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"device=cuda but torch sees no CUDA device .*--device cpu"):
        resolve_device("cuda")


@NO_CUDA
def test_infer_run_device_cuda_without_cuda_exits_2_before_loading(monkeypatch, capsys):
    from infer.runtime import cli

    monkeypatch.setattr(cli, "verify_artifact", lambda path: path)  # no artifact is read before the device check
    with pytest.raises(SystemExit) as exit_:
        cli.main(["/nonexistent", "--device", "cuda", "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "infer-run: error: device=cuda but torch sees no CUDA device" in err and "--device cpu" in err


def test_infer_run_device_options_reach_the_engine_config():
    from infer.runtime.cli import engine_config, parse_args

    default = engine_config(parse_args(["a"]))
    assert default.device == "auto" and default.cuda_graphs is True
    cfg = engine_config(parse_args(["a", "--device", "cpu", "--no-cuda-graphs"]))
    assert cfg.device == "cpu" and cfg.cuda_graphs is False
    with pytest.raises(SystemExit):
        parse_args(["a", "--device", "tpu"])


def test_kernels_for_a_cuda_device():
    cuda = torch.device("cuda")  # a name only: resolving kernels runs nothing on it
    assert resolve("auto", device=cuda).backend == "triton"  # (the tests run triton's interpreter)
    assert resolve("torch", device=cuda).backend == "torch"
    with pytest.raises(ValueError, match="kernels=cpp .* cannot read CUDA tensors.*--device cpu"):
        resolve("cpp", device=cuda)
    assert resolve("auto", device=CPU).backend in ("cpp", "torch")  # unchanged on the CPU


@pytest.fixture
def runner():
    from runner_helpers import tiny_model

    from infer.runtime.engine.model_runner import ModelRunner

    kernels = resolve("torch")
    return ModelRunner(tiny_model(kernels), 40, 4, kernels, device=CPU)


def test_the_runner_keeps_its_cache_on_its_device_and_moves_each_step_once(runner, monkeypatch):
    from runner_helpers import batch

    from infer.runtime.engine.model_runner import ModelRunner, StepInputs

    assert runner.device == CPU and runner.kv_cache.device == CPU and not runner.pin
    with pytest.raises(ValueError, match="the model is on cpu"):
        ModelRunner(runner.model, 40, 4, runner.model.kernels, device="cuda")
    b = batch([5, 6, 3], 4, [True, False, True])
    inputs = runner.prepare(b)
    tensors = {k: v for k, v in vars(inputs).items() if isinstance(v, torch.Tensor)}
    assert all(t.device == CPU and not t.is_pinned() for t in tensors.values())  # built on the host
    moved = inputs.to(runner.device)
    for name, t in vars(moved).items():
        if isinstance(t, torch.Tensor):
            assert t.device == runner.device, name
            assert (t is tensors[name]) == (name in StepInputs.HOST_FIELDS or runner.device == CPU), name
    copies = []
    original = StepInputs.to
    monkeypatch.setattr(StepInputs, "to", lambda self, device: copies.append(device) or original(self, device))
    out = runner.execute(b)
    assert copies == [runner.device]  # one move a step
    assert out.logits.device == runner.device and out.logits.shape == (3, 97)


def test_the_sampler_reads_back_once_a_step(monkeypatch):
    from infer.runtime.engine.sampler import sample
    from infer.runtime.engine.sampling_params import SamplingParams
    from infer.runtime.engine.sequence import Sequence

    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(**p)) for i, p in
            enumerate([dict(temperature=0), dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3),
                       dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5)])]
    logits = torch.randn(3, 50)
    logits[0, 7] = 30.0
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _o=original, _n=name: reads.append(_n) or _o(self))
    result = sample(logits, seqs)
    assert reads == ["tolist"]  # token ids and fault flags in one copy
    assert result.token_ids[0] == 7 and all(0 <= t < 50 for t in result.token_ids) and not result.errors
    nan = logits.clone()
    nan[1, 3] = float("nan")
    reads.clear()
    assert set(sample(nan, seqs).errors) == {1} and reads == ["tolist"]


def _tiny_checkpoint(path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _placement(model) -> set[torch.device]:
    return {t.device for t in [*model.parameters(), *model.buffers()]}


def test_load_model_puts_every_weight_and_table_on_the_device(tmp_path):
    from infer.runtime.model import load_model

    model = load_model(_tiny_checkpoint(tmp_path / "ckpt"), kernels="torch", device=CPU)
    assert _placement(model) == {CPU} and model.device == CPU
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied


@NEEDS_CUDA
def test_load_model_on_cuda(tmp_path):
    from infer.runtime.model import load_model

    cuda = resolve_device("cuda")
    model = load_model(_tiny_checkpoint(tmp_path / "ckpt"), kernels="torch", device=cuda)
    assert _placement(model) == {cuda} and model.lm_head.weight is model.embed_tokens.weight


def test_measuring_without_a_gpu_records_nothing_about_graphs(tmp_path):
    """On a machine without CUDA the tuning table makes no GPU claim (no ``gpu`` section, no GPU in
    its hardware); where CUDA is present runtime/tuning_measure.gpu_check adds one, or fails the build."""
    from infer.runtime import tuning_measure

    from infer.kernels.triton_ops import interpreting

    table = tuning_measure.measure(_tiny_checkpoint(tmp_path / "ckpt"), [1], sections=())
    if torch.cuda.is_available():  # (tests run triton's interpreter unless TRITON_INTERPRET=0)
        assert table["gpu"]["cuda_graphs"]["validated"] is (not interpreting())
    else:
        assert "gpu" not in table and "gpu" not in table["hardware"]
