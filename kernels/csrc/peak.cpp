// The arithmetic peak of the instruction a class's linears multiply with, measured: a loop of that
// instruction on registers alone (no memory), on every thread, for the benchmarks' "share of peak".
// 12 independent accumulators cover the FMA latency (4-5 cycles) times the two FMA ports. On the `amx` class
// the linears multiply on AMX tiles: a loop of tdpbf16ps on 6 accumulator tiles, one after another, to cover its
// latency.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <string>

#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#endif

namespace {

constexpr int kAcc = 12;

// FLOPs of one loop iteration (kAcc instructions) and the loop itself, per instruction set
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
const char* kInstruction = "tdpbf16ps";
constexpr int64_t kIterScale = 8;  // an iteration of 6 tile products takes ~8x a vector loop's 12 instructions
constexpr double kFlopsPerIter = 6.0 * 16 * 16 * 32 * 2;  // a 16 x 16 tile, 32 bfloat16 products a sum
double run(int64_t iters) {
  static const bool granted = infer::enable_amx();
  if (!granted) return 0;
  infer::configure_tiles();
  alignas(64) static const uint16_t ones[16 * 32] = {};
  alignas(64) float out[16 * 16];
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#elif defined(__AVX512BF16__)
const char* kInstruction = "vdpbf16ps zmm";
constexpr int64_t kIterScale = 1;
constexpr double kFlopsPerIter = kAcc * 16 * 2 * 2;  // 16 lanes, a pair of products each, multiply and add
double run(int64_t iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));  // keeps the loop from being folded
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#elif defined(__AVX512F__)
const char* kInstruction = "vfmadd231ps zmm";
constexpr int64_t kIterScale = 1;
constexpr double kFlopsPerIter = kAcc * 16 * 2;
double run(int64_t iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    asm volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
#elif defined(__AVX2__) && defined(__FMA__)
const char* kInstruction = "vfmadd231ps ymm";
constexpr int64_t kIterScale = 1;
constexpr double kFlopsPerIter = kAcc * 8 * 2;
double run(int64_t iters) {
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    asm volatile("" : "+x"(a), "+x"(b));
  }
  __m256 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm256_add_ps(s, acc[i]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0];
}
#else
const char* kInstruction = "none";
constexpr int64_t kIterScale = 1;
constexpr double kFlopsPerIter = 0;
double run(int64_t) { return 0; }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The 2 x 2 blocking of the AMX linears (C tiles 0-3, A tiles 4-5, B tiles 6-7), 4 tile products an iteration, with
// `loads` (0, 1, 2 or 4) of the four A and B tiles loaded afresh from L1 each iteration, as a kernel loads them per
// 32 k: what tile loads cost beside the products; `offset` bytes past a cache line's start (0: each tile row one
// line; 16: each row split over two, as from a buffer malloc returns).
double tile_loop(int64_t iters, int64_t loads, int64_t offset) {
  static const bool granted = infer::enable_amx();
  if (!granted) return 0;
  infer::configure_tiles();
  alignas(64) static uint8_t buffer[4 * 1024 + 64] = {};
  const uint8_t* zeros[4] = {buffer + offset, buffer + offset + 1024, buffer + offset + 2048, buffer + offset + 3072};
  alignas(64) float out[16 * 16];
  infer::zero_accumulators(true);
  _tile_loadd(4, zeros[0], 64);
  _tile_loadd(5, zeros[1], 64);
  _tile_loadd(6, zeros[2], 64);
  _tile_loadd(7, zeros[3], 64);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" ::: "memory");  // the loads are the point: not hoisted out of the loop
    if (loads >= 1) _tile_loadd(4, zeros[0], 64);
    if (loads >= 4) {
      _tile_loadd(6, zeros[2], 64);
      _tile_loadd(7, zeros[3], 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (loads >= 2) _tile_loadd(5, zeros[1], 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

// FLOP/s of `loop` (which does `flops` and returns a value kept live) run once on each of the threads at once
template <typename Loop>
double on_every_thread(const Loop& loop, double flops) {
  const int64_t threads = at::get_num_threads();
  double sink = 0;
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      if (loop() == 12345.678) sink += 1;  // never true: keeps the result live
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return sink + flops * threads / seconds;
}

}  // namespace

// FLOP/s over all threads of the AMX linears' 2 x 2 tile loop with `loads` tile loads per 4 products, `offset` bytes
// off cache-line alignment (0 where the build has no AMX).
double amx_tile_loop(int64_t iters, int64_t loads, int64_t offset) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(loads == 0 || loads == 1 || loads == 2 || loads == 4, "amx_tile_loop: loads is 0, 1, 2 or 4");
  TORCH_CHECK(offset >= 0 && offset < 64, "amx_tile_loop: offset is 0 .. 63 bytes");
  return on_every_thread([&] { return tile_loop(iters, loads, offset); }, 4.0 * 16 * 16 * 32 * 2 * iters);
#else
  return 0;
#endif
}

// (FLOP/s over all threads, the instruction) for about `iters` vector-loop iterations' time a thread.
std::tuple<double, std::string> arithmetic_peak(int64_t iters) {
  iters /= kIterScale;
  return {on_every_thread([&] { return run(iters); }, kFlopsPerIter * iters), kInstruction};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("arithmetic_peak", &arithmetic_peak, "FLOP/s of a register-only loop of the linears' multiply instruction",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_tile_loop", &amx_tile_loop,
        "FLOP/s of the AMX linears' 2 x 2 tile loop: `loads` tile loads per 4 products, `offset` bytes off alignment",
        py::call_guard<py::gil_scoped_release>());
}
