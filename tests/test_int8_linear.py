"""The 8-bit-weight linears (kernels/csrc/int8_linear.cpp, the active CPU class's build) against float64:
W8A16 (int8 per-channel weights, bfloat16 activations), W8A8 (dynamic per-token int8 activations, exact
int32 sums), at the code extremes +127 / -128 (where an int16-saturating product, AVX2's vpmaddubsw, would
be wrong), and FP8 (e4m3 weights decoded in registers, dynamic per-token e4m3 activations: every e4m3 byte,
and the activations' rounding against torch's own conversion); partial column blocks, a bias, decode rows
and prompt-chunk rows; and the refusals."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import int8_linear, isa

MODULE = int8_linear.load()
needs_kernel = pytest.mark.skipif(MODULE is None, reason="this CPU has no AVX2 + FMA: the kernel is never loaded "
                                                         "here; int8 layers run torch's ops (test_quant_runtime)")


def test_the_int8_kernels_are_built_on_every_class_from_avx2():
    assert (MODULE is not None) == isa.at_least("avx2")


@needs_kernel
def test_the_w8a8_kernel_never_uses_a_saturating_product():
    """vpmaddubsw adds two u8 x s8 products in int16 with saturation: wrong at the code extremes."""
    import subprocess

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", MODULE.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert "vpmaddubsw" not in listing
    assert ("vpdpbusd" in listing) == MODULE.has_vnni() and ("vpmaddwd" in listing or MODULE.has_vnni())
    if isa.active() == "avx2":
        assert "zmm" not in listing  # the class's own target: no AVX-512 instruction
    # AMX-INT8 tiles for prompt chunks exactly where the class is amx (forced lower, the build holds none)
    assert ("tdpbusd" in listing) == (isa.active() == "amx") == MODULE.prompt_tiles("w8a8", 64)
    # and AMX-BF16 tiles for W8A16 / FP8 prompt chunks (their blocks widened to bfloat16 pairs)
    assert ("tdpbf16ps" in listing) == (isa.active() == "amx") == MODULE.prompt_tiles("w8a16", 64)
    assert MODULE.prompt_tiles("fp8", 64) == MODULE.prompt_tiles("w8a16", 64)
    assert not MODULE.prompt_tiles("w8a8", 96) and not MODULE.prompt_tiles("w8a16", 48)  # no whole tiles of K


@needs_kernel
@pytest.mark.parametrize("k", [128, 96])
def test_each_8_bit_linear_names_the_tiles_its_prompt_chunks_run_on(k):
    """The plan's name for a linear says AMX tiles exactly where the kernel takes them (int8_linear.cpp's
    prompt_tiles, the one statement of each scheme's condition): on amx, K = 128 for all three; K = 96 for
    W8A16 and FP8 (whole tiles of 16 pairs) but not W8A8 (whole 64-byte rows); below amx, none."""
    from infer.runtime.model.quant_linear import FP8BlocksLinear, Int8BlocksLinear, W8A8BlocksLinear

    weight = torch.randn(64, k, generator=torch.Generator().manual_seed(0)) * 0.02
    amx = isa.active() == "amx"
    for cls, kind, tiles, expected in ((Int8BlocksLinear, "w8a16", "amx-bf16", amx),
                                       (W8A8BlocksLinear, "w8a8", "amx-int8", amx and k % 64 == 0),
                                       (FP8BlocksLinear, "fp8", "amx-bf16", amx)):
        linear = cls(_quantized(weight, kind), None, torch.bfloat16)
        assert MODULE.prompt_tiles(kind, k) == expected, (kind, k)
        assert (f"(prompt chunks on {tiles})" in linear.kernel_name) == expected, linear.kernel_name


def _weight(n, k, gen):
    """Random int8 codes with both extremes in every row, and per-channel scales."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[:, 0], q[:, 1], q[: n // 2, 2:6] = -128, 127, -128  # pairs and quads of -128 x -128 products
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return q, scale


SHAPES = [
    (1, 576, 576, False),  # a decode row, the embedded model's shapes
    (1, 3072, 576, True),  # wide blocks (64 columns)
    (3, 100, 192, True),  # a partial 32-column block, a bias
    (15, 1088, 1536, False),  # wide blocks with a partial one; the last row count split in advance
    (16, 40, 256, True),  # the first that takes work items from the counter
    (70, 96, 64, False),  # prompt-chunk rows in tiles, and their remainders
    (33, 3072, 576, True),  # AMX-INT8 (where the class is amx): one row in a second row tile, wide blocks
    (100, 100, 1536, False),  # AMX-INT8: a partial 32-column block, row tiles of 32 and a rest of 4
    (300, 96, 2048, True),  # AMX-INT8: rows in two row blocks (256 and 44: int8_linear.cpp's kAmxRowBlockBytes)
]


@needs_kernel
@pytest.mark.parametrize("m, n, k, bias", SHAPES)
def test_w8a16_matches_float64(m, n, k, bias, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, scale = _weight(n, k, gen)
    w = q.double() * scale.double()[:, None]
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x[0, :2] = torch.tensor([-3.0, 3.0]).to(torch.bfloat16)  # with the extreme codes
    b = torch.randn(n, generator=gen) if bias else None
    want = x.double() @ w.t() + (b.double() if bias else 0)
    packed, scales = int8_linear.pack_w8a16(q, scale)
    got = MODULE.int8_linear(x, packed, scales, n, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # products exact in float32, float32 sums (error under K 2^-24 x |x| . |w|), one rounding to bfloat16:
    # mostly the exact result's own rounding, else within one bfloat16 step of it
    err = (got.double() - want).abs()
    rounding = (want.to(torch.bfloat16).double() - want).abs()
    magnitude = x.double().abs() @ w.abs().t()
    assert (err <= rounding + 1e-6).float().mean() >= 0.99, (err - rounding).max()
    assert (err <= want.abs() * 2.0 ** -8 + magnitude * k * 2.0 ** -24 + 1e-30).all(), (err / magnitude).max()


def _torch_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    """runtime/model/quant_linear.py's W8A8Linear arithmetic on exact int32 sums, and its activation codes."""
    from infer.runtime.model.compressed_tensors import Args
    from infer.runtime.model.quant_linear import quantize_activations

    codes, xs = quantize_activations(x, Args(8, "int", "token", dynamic=True), None)
    acc = codes.int() @ q.int().t()  # exact (torch._int_mm is not on a CPU without VNNI: kernels/isa.py)
    return (acc.float() * (xs * scale.reshape(1, -1).float())), codes, xs


@needs_kernel
@pytest.mark.parametrize("m, n, k, bias", SHAPES)
def test_w8a8_computes_the_declared_scheme(m, n, k, bias, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, scale = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:2]] *= 30  # activation outliers
    x = x.to(torch.bfloat16)
    x[0, :6] = -3.0  # the row's absmax, negative: x / scale is -127.5 exactly (3 / (3 / 127.5) in float32),
    x[0, 6:] = x[0, 6:].clamp(-2.9, 2.9)  # which rounds to code -128, against the -128 weights;
    x[0, 6] = 3.0  # and +127.5, clamped to +127
    b = torch.randn(n, generator=gen) if bias else None
    packed, scales, colsums = int8_linear.pack_w8a8(q, scale)
    got = MODULE.w8a8_linear(x, packed, scales, colsums, n, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    ref, codes, xs = _torch_w8a8(x, q, scale)
    assert codes.min() == -128 and codes.max() >= 127
    # the same float32 operations on the same exact int32 sums: bit for bit, the bias in float32 before the rounding
    want32 = ref if b is None else ref + b
    if b is None:
        assert torch.equal(got, want32.to(torch.bfloat16))
    else:  # fma(sum, s, b) against (sum x s) + b: one float32 rounding apart at most
        assert ((got.float() - want32).abs() <= want32.abs() * 2.0 ** -8 + want32.abs().max() * 2.0 ** -20).all()
    # and the declared scheme in float64: codes x scales times weight codes x scales
    y64 = (codes.double() * xs.double()) @ (q.double() * scale.double()[:, None]).t() + (b.double() if bias else 0)
    assert ((got.double() - y64).abs() <= y64.abs() * 2.0 ** -8 + y64.abs().max() * 2.0 ** -20).all()


@needs_kernel
@pytest.mark.parametrize("m, k", [(2, 4096 + 8), (40, 4096 + 64)])  # decode rows; a prompt chunk (AMX-INT8 on amx)
def test_w8a8_sums_are_exact_at_the_code_extremes(m, k):
    """Every product -128 x -128 (or 127 x -128): int16 pair sums of 32768 and int32 sums of K x 16384, which
    an int16-saturating instruction or a float32 sum would not carry exactly (K: sums past 2^24 and 2^26, where
    float32 cannot hold every integer)."""
    n = 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2, ::3] = 127
    scale = torch.ones(n)
    x = torch.full((m, k), -1.5).to(torch.bfloat16)  # codes -128 throughout (-127.5 exactly, rounded to even)
    x[1::2, ::2] = 1.5  # codes +127 on half of every other row
    packed, scales, colsums = int8_linear.pack_w8a8(q, scale)
    got = MODULE.w8a8_linear(x, packed, scales, colsums, n, None)
    ref, codes, xs = _torch_w8a8(x, q, scale)
    assert codes[0].eq(-128).all() and codes[1, ::2].eq(127).all()
    exact = codes.long() @ q.long().t()  # int64
    assert torch.equal(got, (exact.float() * xs).to(torch.bfloat16))
    assert torch.equal(got, ref.to(torch.bfloat16))


def _tie_rows(gen, scheme):
    """Rows whose every value's quotient x / scale tests the rounding: row r's absmax A is the r-th of the 128
    bfloat16 mantissas (exponents at random), the rest of the row every bfloat16 magnitude in [A 2^-7, A], signs at
    random; K padded with zeros to a multiple of 64. Returns x and how many quotients lie within 2^-18 of a
    rounding boundary (a half-integer for int8 codes, a midpoint between e4m3 values for fp8)."""
    mantissas = 1 + torch.arange(128, dtype=torch.float64) / 128
    rows = []
    for r in range(128):
        e = int(torch.randint(-12, 12, (1,), generator=gen))
        a = mantissas[r] * 2.0**e
        values = torch.cat([mantissas * 2.0 ** (e - d) for d in range(8)])
        values = values[values <= a]
        signs = torch.where(torch.rand(len(values), generator=gen) < 0.5, -1.0, 1.0)
        rows.append(torch.cat([a.reshape(1), values * signs]))
    k = -(-max(len(v) for v in rows) // 64) * 64
    x = torch.zeros(128, k, dtype=torch.float64)
    for r, v in enumerate(rows):
        x[r, :len(v)] = v
    x = x.to(torch.bfloat16)
    half_range = 127.5 if scheme == "w8a8" else 448.0
    scale = (x.float().abs().amax(1, keepdim=True) / half_range).double()  # float32 scales, as torch divides by
    quotient = x.double() / scale
    if scheme == "w8a8":
        boundary = quotient.floor() + 0.5
    else:  # e4m3: 3 mantissa bits, steps of 2^-9 below 2^-6
        step = torch.where(quotient.abs() < 2.0**-6, 2.0**-9, 2.0 ** (quotient.abs().log2().floor() - 3))
        boundary = (quotient / step).floor() * step + step / 2
    near = ((quotient - boundary).abs() <= quotient.abs() * 2.0**-18) & (x != 0)
    return x, int(near.sum())


@needs_kernel
@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_activation_codes_round_as_torch_divides_near_every_boundary(scheme, fresh_seed):
    """Each x / scale is the float32 quotient torch's division gives (the kernel multiplies by 1 / scale and
    corrects twice by the remainder), so its code is torch's, also where the quotient falls within float32 ulps of
    a rounding boundary: every bfloat16 absmax mantissa against every value below it, read back through an
    identity weight (y = code x row scale: codes one apart give different bfloat16 outputs)."""
    gen = torch.Generator().manual_seed(fresh_seed)
    x, near = _tie_rows(gen, scheme)
    assert near >= 100, near  # the sweep does reach the boundaries
    k = x.shape[1]
    if scheme == "w8a8":
        q = torch.eye(k, dtype=torch.int8)
        packed, scales, colsums = int8_linear.pack_w8a8(q, torch.ones(k))
        got = MODULE.w8a8_linear(x, packed, scales, colsums, k, None)
        want = _torch_w8a8(x, q, torch.ones(k))[0].to(torch.bfloat16)
    else:
        eye = torch.zeros(k, k, dtype=torch.uint8)
        eye[torch.arange(k), torch.arange(k)] = 0x38  # e4m3 1.0
        packed, scales = int8_linear.pack_fp8(eye.view(torch.float8_e4m3fn), torch.ones(k))
        got = MODULE.fp8_linear(x, packed, scales, k, None)
        codes, xs = _torch_fp8(x)
        want = (codes.float() * xs).to(torch.bfloat16)
    assert torch.equal(got, want), (got != want).sum()


def _fp8_weight(n, k, gen):
    """Random e4m3 weights with every one of the 254 finite codes (subnormals, +-448) present, per-channel scales."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes[codes.bitwise_and(0x7F) == 0x7F] = 0x7E  # no NaN (0x7F, 0xFF): +-448 instead
    flat = codes.view(-1)
    every = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    flat[:len(every)] = every[:flat.numel()]
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return codes.view(torch.float8_e4m3fn), scale


def _torch_fp8(x: torch.Tensor):
    """runtime/model/quant_linear.py's activation codes for FP8_DYNAMIC (torch's own float32 -> e4m3)."""
    from infer.runtime.model.compressed_tensors import Args
    from infer.runtime.model.quant_linear import quantize_activations

    return quantize_activations(x, Args(8, "float", "token", dynamic=True), None)


@needs_kernel
# odd K: a padded pair (the last: AMX tiles on amx, 48 pairs)
@pytest.mark.parametrize("m, n, k, bias", SHAPES + [(2, 64, 97, True), (9, 100, 97, False), (40, 96, 95, True)])
def test_fp8_computes_the_declared_scheme(m, n, k, bias, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, scale = _fp8_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:2]] *= 30  # activation outliers: the other codes small
    x = x.to(torch.bfloat16)
    # and subnormal codes: under 2^-6 once divided by the row's scale (absmax / 448), whatever the draw
    x[:, 2:4] = (x.float().abs().amax(1, keepdim=True) / 448 * torch.tensor([2.0 ** -7, -2.0 ** -8])).to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    packed, scales = int8_linear.pack_fp8(q, scale)
    assert packed.dtype == torch.uint8
    got = MODULE.fp8_linear(x, packed, scales, n, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    codes, xs = _torch_fp8(x)
    assert (codes.float().abs() < 2.0 ** -6).any() and (codes.float().abs() == 448).any()
    # the declared scheme in float64: (codes x row scale) . (weight codes x column scale) + bias. The products
    # of two e4m3 values are exact in float32 and the sums float32 (under K 2^-24 x |x| . |w|), rounded once
    # to bfloat16; a kernel that rounded an activation to another code would be off by a 2^-4 step of it
    xq = codes.double() * xs.double()
    w = q.double() * scale.double()[:, None]
    want = xq @ w.t() + (b.double() if bias else 0)
    err = (got.double() - want).abs()
    rounding = (want.to(torch.bfloat16).double() - want).abs()
    magnitude = xq.abs() @ w.abs().t()
    assert (err <= rounding + magnitude * k * 2.0 ** -24 + 1e-30).float().mean() >= 0.99, (err - rounding).max()
    assert (err <= want.abs() * 2.0 ** -8 + magnitude * k * 2.0 ** -24 + 1e-30).all(), (err / magnitude).max()


@needs_kernel
def test_fp8_decodes_every_code_and_rounds_activations_as_torch_does():
    """One-hot rows read single weights: every e4m3 byte decodes to its value (times the scales), and each
    bfloat16 activation a row may hold rounds to torch's e4m3 code (ties to even, subnormals, +-448)."""
    every = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    k = 256
    q = torch.zeros(len(every), k, dtype=torch.uint8)
    q[:, 0] = every  # column n reads code n through x = e_0
    packed, scales = int8_linear.pack_fp8(q.view(torch.float8_e4m3fn), torch.ones(len(every)))
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 448.0, -448.0  # row scale 1: the code of x[0] is 448 exactly
    got = MODULE.fp8_linear(x, packed, scales, len(every), None)
    want = every.view(torch.float8_e4m3fn).float() * 448.0
    assert torch.equal(got[0].float(), want.to(torch.bfloat16).float())
    # activations: every finite bfloat16 in [-448, 448], a row of them at a time beside +-448 (row scale 1), read
    # back one at a time through a one-hot weight column
    values = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values) & (values.float().abs() <= 448)]
    rows = values[: (len(values) // 254) * 254].view(-1, 254)
    x = torch.cat([torch.full((len(rows), 1), 448.0), rows.float(), torch.zeros(len(rows), 1)], 1).to(torch.bfloat16)
    eye = torch.zeros(256, 256, dtype=torch.uint8)
    eye[torch.arange(256), torch.arange(256)] = 0x38  # e4m3 1.0
    packed, scales = int8_linear.pack_fp8(eye.view(torch.float8_e4m3fn), torch.ones(256))
    got = MODULE.fp8_linear(x, packed, scales, 256, None)
    codes, xs = _torch_fp8(x)
    assert torch.equal(xs, torch.ones_like(xs))
    assert torch.equal(got.float(), codes.float().to(torch.bfloat16).float())


@needs_kernel
def test_int8_linears_refuse_what_they_were_not_packed_for():
    q, scale = _weight(64, 128, torch.Generator().manual_seed(0))
    p16, s16 = int8_linear.pack_w8a16(q, scale)
    p8, s8, c8 = int8_linear.pack_w8a8(q, scale)
    x = torch.randn(2, 128).to(torch.bfloat16)
    cases = {
        r"x has 64 features, the packed weight 128": lambda: MODULE.int8_linear(x[:, :64].contiguous(), p16, s16, 64,
                                                                                 None),
        r"100 output features do not match": lambda: MODULE.w8a8_linear(x, p8, s8, c8, 100, None),
        r"x must be a \[M, K\] bfloat16": lambda: MODULE.int8_linear(x.float(), p16, s16, 64, None),
        r"packed by kernels/int8_linear.py": lambda: MODULE.int8_linear(x, p8, s8, 64, None),
        r"scales must be float32": lambda: MODULE.w8a8_linear(x, p8, s8[:10], c8, 64, None),
        r"colsums must be int32": lambda: MODULE.w8a8_linear(x, p8, s8, c8.float(), 64, None),
        r"bias must be a contiguous float32 \[N\]": lambda: MODULE.int8_linear(x, p16, s16, 64, torch.zeros(63)),
    }
    for pattern, call in cases.items():
        with pytest.raises(RuntimeError, match=pattern):
            call()
    with pytest.raises(ValueError, match="K must be a multiple of 4"):
        int8_linear.pack_w8a8(torch.zeros(8, 102, dtype=torch.int8), torch.ones(8))


def _unpack_blocks(linear) -> torch.Tensor:
    """A column-block PackedLinear's [N, K] bfloat16 weight (kernels/bf16_linear.py's pack, undone)."""
    p = linear.packed_weight
    return p.permute(0, 2, 1, 3).reshape(p.shape[0] * p.shape[2], -1)[:linear.out_features].float()


def _quantized(weight: torch.Tensor, kind: str):
    """Round-to-nearest QuantWeight of a float [N, K] weight: W8A16, W8A8 (dynamic per token), FP8_DYNAMIC or
    W4A16 g64."""
    from infer.runtime.model.compressed_tensors import Args, QuantWeight

    if kind == "w4a16":
        n, k = weight.shape
        scale = weight.view(n, k // 64, 64).abs().amax(-1) / 7
        q = torch.round(weight.view(n, k // 64, 64) / scale[..., None]).clamp(-8, 7).to(torch.int8).view(n, k)
        return QuantWeight(Args(4, "int", "group", True, 64), None, q, scale)
    if kind == "fp8":  # FP8_DYNAMIC: e4m3 per channel, dynamic per-token e4m3 activations
        scale = weight.abs().amax(1, keepdim=True) / 448
        q = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return QuantWeight(Args(8, "float", "channel"), Args(8, "float", "token", dynamic=True), q, scale)
    scale = weight.abs().amax(1, keepdim=True) / 127
    q = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
    inputs = Args(8, "int", "token", dynamic=True) if kind == "w8a8" else None
    return QuantWeight(Args(8, "int", "channel"), inputs, q, scale)


@needs_kernel
def test_a_mixed_model_steps_in_one_call_with_the_python_loops_bits(embedded_artifact):
    """bfloat16, W8A16, W8A8, FP8 and W4A16 linears side by side (as quant.auto builds them), layer by layer in
    turn: the model stays in the one-call C++ step (kernels/csrc/step_layers.cpp dispatches each linear on
    its packed weight), which gives the Python layer loop's tokens and logprobs bit for bit."""
    import random

    from infer.runtime import LLM, SamplingParams
    from infer.runtime.model.fused_step import FusedStep
    from infer.runtime.model.quant_linear import make_linear, quantized_modules

    llm = LLM(embedded_artifact, dtype="bfloat16", kv_cache_memory=16 << 20, tuning="off", amx=False,
              enable_prefix_caching=False)
    model = llm.engine.model
    if model.fused_step is None:
        pytest.skip("no fused step for the bfloat16 model on this host (test_fused_step covers why)")
    kinds = ("w8a16", "w8a8", "fp8", "w4a16", None)
    for i, layer in enumerate(model.layers[:5]):  # every kind in every slot; the other layers stay bfloat16
        for j, (parent, attr) in enumerate(((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))):
            kind = kinds[(i + j) % len(kinds)]
            if kind is not None:
                setattr(parent, attr, make_linear(_quantized(_unpack_blocks(getattr(parent, attr)), kind), None,
                                                  torch.bfloat16))
    assert set(quantized_modules(model).values()) == {"cpu-int8-blocks", "cpu-w8a8-blocks", "cpu-fp8-blocks",
                                                      "cpu-int4-blocks"}
    assert FusedStep.declines(model) is None
    fused = FusedStep(model, llm.engine.kernels)
    steps = []

    def counting(x, positions, ctx):
        out = fused(x, positions, ctx)
        if out is not None:
            steps.append(ctx.decodes_only)
        return out

    model.fused_step = counting
    prompts = [[random.randrange(100, 49000) for _ in range(random.randint(5, 40))] for _ in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    got = llm.generate(prompts, params)
    model.fused_step = None
    want = llm.generate(prompts, params)
    assert sum(steps) >= 7, steps  # the decode steps went through the fused call
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [a["logprob"] for a in g.logprobs] == [b["logprob"] for b in w.logprobs]


@needs_kernel
def test_streamed_quantized_weights_move_to_one_huge_page_arena_unchanged(fresh_seed):
    """place_streamed (what the loader calls) puts every blocks linear's streamed buffers, 8-bit and int4, in one
    2 MiB-aligned arena, and each layer then gives the very same bits."""
    from infer.kernels import hugepages
    from infer.runtime.model.quant_linear import make_linear, place_streamed

    gen = torch.Generator().manual_seed(fresh_seed)
    model = torch.nn.ModuleList(make_linear(_quantized(torch.randn(96, 128, generator=gen), kind), None, torch.bfloat16)
                                for kind in ("w8a16", "w8a8", "fp8", "w4a16"))
    assert {m.backend for m in model} == {"cpu-int8-blocks", "cpu-w8a8-blocks", "cpu-fp8-blocks", "cpu-int4-blocks"}
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    before = [m(x) for m in model]
    moved = place_streamed(model)
    buffers = [getattr(m, name) for m in model for name in m.streamed if getattr(m, name) is not None]
    assert moved >= sum(b.numel() * b.element_size() for b in buffers) and len(buffers) >= 9
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == 1
    assert min(b.data_ptr() for b in buffers) % hugepages.HUGE == 0
    for m, want in zip(model, before):
        assert torch.equal(m(x), want), m.backend


@pytest.mark.parametrize("split", [False, True])
def test_the_torch_w8a8_linear_sums_exactly_with_or_without_vnni(monkeypatch, split, fresh_seed):
    """runtime's cpu-w8a8 (torch._int_mm): where oneDNN has no VNNI its int16 pair sums saturate, so the
    weight is split in halves that cannot (kernels/isa.onednn_int8_is_exact); both ways give the exact sums.
    ``split``: the halves forced on (the path of a CPU without VNNI), or the plain call where it is exact here."""
    from infer.kernels import isa as isa_module
    from infer.runtime.model.compressed_tensors import Args, QuantWeight
    from infer.runtime.model.quant_linear import W8A8Linear

    if not split and not isa_module.onednn_int8_is_exact():
        pytest.skip("this CPU (or the forced class) has no VNNI: oneDNN's plain int8 GEMM saturates here, and "
                    "the split case ran")
    monkeypatch.setattr(isa_module, "onednn_int8_is_exact", lambda: not split)
    gen = torch.Generator().manual_seed(fresh_seed)
    n, k = 64, 512
    q, scale = _weight(n, k, gen)
    w = QuantWeight(Args(8, "int", "channel"), Args(8, "int", "token", dynamic=True), q, scale.reshape(-1, 1))
    linear = W8A8Linear(w, None, torch.float32)
    assert linear.split == split
    x = torch.randn(40, k, generator=gen) * 3
    x[:, :8] = -50.0  # rows of extreme codes against the -128 weights: pair sums past int16
    got = linear(x)
    ref, _, _ = _torch_w8a8(x, q, scale)
    assert torch.equal(got, ref)
