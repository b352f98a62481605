"""CPU classes (kernels/isa.py): every class this host can execute is built with its own target and
checked against float64; a forced class is held to its instructions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.kernels import bf16_linear, extension, isa


def _classes():
    """Every class, those above this CPU's skipped with the reason (they cannot execute here)."""
    native = isa.native_class()
    top = -1 if native is None else isa.CLASSES.index(native)
    return [pytest.param(c, marks=pytest.mark.skipif(i > top, reason=f"this CPU's highest class is {native}: "
                                                                       f"{c} code cannot execute here"))
            for i, c in enumerate(isa.CLASSES)]


def _linear_module(monkeypatch, cls: str):
    monkeypatch.setenv("INFER_ISA", cls)
    module = extension.build("infer_bf16_linear", "bf16_linear.cpp", ["-fopenmp"])
    assert module is not None and module.available(), f"the {cls} build of bf16_linear.cpp failed"
    return module


@pytest.mark.parametrize("cls", _classes())
def test_each_class_builds_a_column_block_linear_that_matches_float64(monkeypatch, cls, fresh_seed):
    _check_linear(_linear_module(monkeypatch, cls), fresh_seed, cls)


def _check_linear(module, seed: int, cls: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    # narrow (32-column blocks) and wide (64) weights, each with a part-full last block; rows that take
    # the decode tiles (1-3), every prompt tile size and their remainders
    for n, k in ((96, 192), (130, 96), (1100, 576), (200, 1536)):
        w = (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen)
        packed = bf16_linear.pack(w)
        for rows in (1, 2, 3, 5, 8, 11, 16, 49):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                got = module.bf16_linear(x, packed, n, b)
                want = x.double() @ w.double().t() + (0 if b is None else b.double())
                # float32 sums rounded once to bfloat16: within bfloat16's rounding of the exact result
                err = ((got.double() - want).abs() / (want.abs() + 1e-2 * want.abs().max())).max().item()
                assert got.shape == (rows, n) and err < 1e-2, (cls, n, k, rows, b is not None, err)


@pytest.mark.parametrize("cls", _classes())
def test_each_class_builds_an_int4_linear_that_matches_float64(monkeypatch, cls, fresh_seed):
    from infer.kernels import int4_linear

    monkeypatch.setenv("INFER_ISA", cls)
    module = extension.build("infer_int4_linear", "int4_linear.cpp", ["-fopenmp"])
    assert module is not None and module.available(), f"the {cls} build of int4_linear.cpp failed"
    gen = torch.Generator().manual_seed(fresh_seed)
    for n, k, group, asym in ((100, 192, 32, True), (576, 576, 64, False), (40, 256, 256, True)):
        groups = k // group
        # the code extremes: u = 0 and 15 (q = -8 and 7) in every group, zero points at both ends too
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
        q[:, ::group], q[:, 1::group] = -8, 7
        scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
        zero = torch.randint(-8, 8, (n, groups), dtype=torch.int8, generator=gen) if asym else None
        if asym:
            zero[0], zero[1] = -8, 7
        cols = torch.arange(k) // group
        w = (q.double() - (zero.double()[:, cols] if asym else 0)) * scale.double()[:, cols]
        packed, scales, offsets = int4_linear.pack(q, scale, zero)
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 3, 5, 17):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            got = module.int4_linear(x, packed, scales, offsets, n, bias)
            want = x.double() @ w.t() + bias.double()
            magnitude = x.double().abs() @ w.abs().t()
            err = (got.double() - want).abs()
            assert (err <= want.abs() * 2.0 ** -7 + magnitude * 2.0 ** -10).all(), (cls, n, k, rows, (err / magnitude).max())


@pytest.mark.parametrize("name, source", [("infer_bf16_linear", "bf16_linear.cpp"),
                                          ("infer_bf16_attention", "bf16_attention.cpp")])
def test_the_avx2_build_holds_no_avx512_instruction(monkeypatch, name, source):
    if isa.native_class() is None:
        pytest.skip("this CPU has no AVX2: the avx2 build cannot load here")
    monkeypatch.setenv("INFER_ISA", "avx2")
    module = extension.build(name, source, ["-fopenmp"])
    assert module is not None and module.available(), f"the avx2 build of {source} failed"
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", module.__file__], capture_output=True,
                             text=True, check=True).stdout
    assert "vfmadd" in listing and "ymm" in listing  # the widening kernel is there, on 256-bit vectors
    assert "zmm" not in listing and "vdpbf16ps" not in listing


PEAK_INSTRUCTION = {"amx": "tdpbf16ps", "avx512bf16": "vdpbf16ps zmm", "avx512": "vfmadd231ps zmm",
                    "avx2": "vfmadd231ps ymm"}  # what each class's bfloat16 linears multiply with


@pytest.mark.parametrize("cls", _classes())
def test_the_peak_loop_runs_the_instruction_the_class_linears_use(monkeypatch, cls):
    """bench/cpu_class.py's share of peak is taken against this loop: on `amx` the linears run on tiles, so the
    peak is tdpbf16ps's (30x vdpbf16ps's on a 2-core Xeon), not a vector instruction's."""
    monkeypatch.setenv("INFER_ISA", cls)
    module = extension.build("infer_peak", "peak.cpp", ["-fopenmp"])
    assert module is not None, f"the {cls} build of peak.cpp failed"
    flops, instruction = module.arithmetic_peak(2_000_000)
    assert instruction == PEAK_INSTRUCTION[cls]
    assert 1e9 < flops < 1e15
    # bench/amx_tiles.py's loop of the AMX linears' tile blocking: it runs on amx, nowhere else
    tiles = module.amx_tile_loop(10_000, 4, 16)
    assert (tiles > 1e9) == (cls == "amx") and (tiles == 0) == (cls != "amx")
    if cls == "amx":
        with pytest.raises(RuntimeError, match="offset is 0 .. 63"):
            module.amx_tile_loop(10, 4, 64)


def test_the_prefetch_distance_is_compiled_in(monkeypatch, fresh_seed):
    """The linears' prefetch setting (kernels/isa.py, kernels/csrc/prefetch.h) reaches the build: this CPU's
    own default leaves prefetch instructions in the bfloat16 linear where it is a distance and none where it
    is 0, and the build matches float64; INFER_PREFETCH_BYTES changes the flags (and so the build key). The
    other setting's build is not compiled here (~35 s): the decoding kernels compile the prefetching path on
    every CPU, and it changes no arithmetic."""
    if isa.native_class() is None:
        pytest.skip("this CPU has no AVX2: no linear kernel builds here")
    monkeypatch.delenv("INFER_PREFETCH_BYTES", raising=False)
    ahead = isa.prefetch_bytes()
    assert ahead == (0 if isa.cpu_vendor() == "AuthenticAMD" else 2048)
    module = _linear_module(monkeypatch, isa.native_class())
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", module.__file__], capture_output=True,
                             text=True, check=True).stdout
    assert ("prefetcht0" in listing) == (ahead > 0)
    _check_linear(module, fresh_seed, f"prefetch {ahead}")
    default_flags = isa.compile_flags()
    monkeypatch.setenv("INFER_PREFETCH_BYTES", str(2048 - ahead))
    assert f"-DINFER_PREFETCH_BYTES={2048 - ahead}" in isa.compile_flags() and isa.compile_flags() != default_flags


def test_a_prefetch_distance_that_is_not_whole_cache_lines_is_refused(monkeypatch):
    for bad in ("100", "-64", "2k"):
        monkeypatch.setenv("INFER_PREFETCH_BYTES", bad)
        with pytest.raises(ValueError, match="whole number of 64-byte cache lines"):
            isa.prefetch_bytes()


def test_a_forced_class_sets_the_target_and_a_class_above_the_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("INFER_ISA", "avx2")
    if isa.native_class() is not None:
        assert isa.active() == "avx2" and isa.compile_flags()[0] == "-march=x86-64-v3"
        assert not isa.at_least("avx512")
    monkeypatch.setenv("INFER_ISA", "sse2")
    with pytest.raises(ValueError, match="choose one of avx2, avx512, avx512bf16, amx"):
        isa.active()
    above = [c for c in isa.CLASSES if isa.CLASSES.index(c) > isa.CLASSES.index(isa.native_class() or "avx2")]
    if above:
        monkeypatch.setenv("INFER_ISA", above[-1])
        with pytest.raises(ValueError, match="highest class is"):
            isa.active()
    monkeypatch.delenv("INFER_ISA")
    monkeypatch.setenv("INFER_AMX", "0")
    assert isa.active() != "amx"


def test_the_resolver_names_the_class_it_chose():
    from infer.kernels.resolver import resolve

    described = resolve("auto", dtype=torch.bfloat16).describe(torch.bfloat16)
    assert described["isa"] == isa.active()
    if isa.at_least("avx2"):
        assert described["linear"] in ("blocks", "amx") and described.get("step_layers") == "cpp", described


# The test files of the kernels whose code differs by class (attention, bfloat16, int8 and int4 linears, layer ops, the
# one-call step with its prompt chunks, the plan's routes, the sampler's draw): the suite runs them at this CPU's own class; each class below it runs
# them again in a process started with INFER_ISA set, so every host checks every path it can execute against its
# reference (the one-call step against the Python loop's bits).
KERNEL_TESTS = ("test_kernels.py", "test_packed_linear.py", "test_int8_linear.py", "test_int4_linear.py",
                "test_layer_ops.py", "test_fused_step.py", "test_plan.py", "test_sampler.py")


def _lower_classes(at_own: str = "the suite itself ran these tests"):
    """Every class below this CPU's own; its own class skipped for ``at_own``, those above as not executable."""
    native = isa.native_class()
    top = -1 if native is None else isa.CLASSES.index(native)
    return [pytest.param(c, marks=pytest.mark.skipif(i >= top, reason=(
        f"{c} is this CPU's own class: {at_own}" if i == top else
        f"this CPU's highest class is {native}: {c} code cannot execute here"))) for i, c in enumerate(isa.CLASSES)]


@pytest.mark.parametrize("cls", _lower_classes())
def test_the_kernel_tests_pass_under_each_lower_class(cls):
    here = Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=here, env={**os.environ, "INFER_ISA": cls}, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    print(tail)
    assert run.returncode == 0, f"INFER_ISA={cls}: {tail}"
    assert " passed" in run.stdout, tail


@pytest.mark.parametrize("cls", _lower_classes("there is no second build to load beside it"))
def test_a_lower_class_step_loads_beside_the_native_one(monkeypatch, cls):
    """Each class's build of step_layers.cpp registers its own StepWeights (pybind11 module_local): without it, a
    second build loaded in the same process (a benchmark forcing a class beside the engine at the host's own)
    failed to import with "type StepWeights is already registered" and its build was marked failed on disk."""
    from infer.kernels import step_layers

    native = step_layers.load()
    assert native is not None, "the host's own step_layers build failed"
    monkeypatch.setenv("INFER_ISA", cls)
    lower = step_layers.load.__wrapped__()
    assert lower is not None and lower is not native, f"the {cls} build of step_layers.cpp did not load beside the native one"
    norms = [torch.ones(4, dtype=torch.bfloat16)] * 3
    assert len(native.StepWeights(norms)) == len(lower.StepWeights(norms)) == 3


def test_the_ahead_of_time_build_covers_each_class_and_refuses_unknown_words():
    """python -m infer.kernels build --all-classes (make install): what each class builds, and its usage."""
    from infer.kernels.__main__ import _kernels, main

    assert set(_kernels("avx2")) == {"layer_ops", "paged_attention", "bf16_linear", "int4_linear", "int8_linear",
                                     "bf16_attention", "sample_rows", "step_layers"}
    assert set(_kernels("amx")) == set(_kernels("avx2")) | {"amx_linear", "amx_attention"}
    assert set(_kernels(None)) == {"layer_ops", "paged_attention"}  # below AVX2: the portable kernels only
    assert main(["build", "--every-class"]) == 2
