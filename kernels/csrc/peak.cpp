// The arithmetic peak of the instruction a class's linears multiply with, measured: a loop of that
// instruction on registers alone (no memory), on every thread, for the benchmarks' "share of peak".
// 12 independent accumulators cover the FMA latency (4-5 cycles) times the two FMA ports.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdint>
#include <string>

#include <immintrin.h>

namespace {

constexpr int kAcc = 12;

// FLOPs of one loop iteration (kAcc instructions) and the loop itself, per instruction set
#if defined(__AVX512BF16__)
const char* kInstruction = "vdpbf16ps zmm";
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
constexpr double kFlopsPerIter = 0;
double run(int64_t) { return 0; }
#endif

}  // namespace

// (FLOP/s over all threads, the instruction) for `iters` iterations a thread.
std::tuple<double, std::string> arithmetic_peak(int64_t iters) {
  const int64_t threads = at::get_num_threads();
  double sink = 0;
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const double v = run(iters);
      if (v == 12345.678) sink += v;  // never true: keeps the result live
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {sink + kFlopsPerIter * iters * threads / seconds, kInstruction};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("arithmetic_peak", &arithmetic_peak, "FLOP/s of a register-only loop of the linears' multiply instruction",
        py::call_guard<py::gil_scoped_release>());
}
