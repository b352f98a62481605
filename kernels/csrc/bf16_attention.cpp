// Attention of prompt chunks: vdpbf16ps where the CPU has AVX-512 BF16, else the same bfloat16 pairs widened
// to float32 in registers and multiplied with two FMAs (AVX-512F: the `avx512` class; AVX2 + FMA: the `avx2`
// class, on 8 lanes). One source, the instruction set chosen by the build's target flags (kernels/isa.py);
// below AVX-512 BF16 the classes otherwise ran torch's SDPA (0.40 of the FMA peak for a 256-token prefill on
// a Zen 5 forced to `avx512`).
//
// A 256-token prompt spends ~2 ms a layer in torch's bfloat16 flash SDPA on a 2-core Zen 4 (a fifth
// of its prefill), for ~75 MFLOP of work. Here a task is one chunk's block of 32 rows for one KV
// head: the rows of every query head sharing that head, ordered (chunk row, query head) so a tile's
// rows see about as many keys. It packs the keys its rows may see as [keys/K][d/2][K][2] (K = 64 keys
// on AVX-512, 16 on AVX2; the pair layout of kernels/csrc/bf16_linear.cpp, keys as output columns) and the values as
// [keys/2][d][2] (token pairs), reading the cache in place through the block table; then computes
// S = Q K^T in float32, a softmax per row over the keys it may see (up to cached + row), with P
// rounded to bfloat16 and its sum taken over the rounded values, O = P V in float32, and divides
// once at the end. On AVX2 (16 vector registers, no embedded broadcast) a K block is 16 keys and a tile
// 4 rows, and the query rows and P are widened to float32 once (exact) so that each is broadcast
// straight from memory rather than widened again for every block. Tasks are taken largest first from a shared
// counter (kernels/csrc/work_split.h).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "chunk_checks.h"
#include "simd_math.h"
#include "work_split.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
// 16 float32 lanes. A vector of 16 bfloat16 pairs (words), and acc + the pairwise products' sums: vdpbf16ps
// with AVX-512 BF16; without it each word's low half (k) and high half (k + 1) widened to float32 (exact) and
// two FMAs.
using vf = __m512;
constexpr int kLanes = 16;
constexpr int kKeyVectors = 4;  // a packed K block: 64 keys
constexpr int kTileRows = 6;    // rows a tile: 6 x 4 accumulators and 4 K vectors of the 32 registers
#if defined(__AVX512BF16__)
using Pairs = __m512bh;
inline Pairs as_pairs(__m512i v) { return (__m512bh)v; }
inline __m512 dot_pairs(__m512 acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
#else
using Pairs = __m512i;
inline Pairs as_pairs(__m512i v) { return v; }
inline __m512 dot_pairs(__m512 acc, Pairs a, Pairs b) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)),
                         acc);
}
#endif
// The query rows and P stay bfloat16, each (k, k + 1) pair broadcast as one word.
using Operand = uint16_t;
using RowPair = Pairs;
inline Pairs load_pairs(const uint16_t* p) { return as_pairs(_mm512_loadu_si512(p)); }
inline RowPair row_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return as_pairs(_mm512_set1_epi32(pair));
}
inline vf vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
// v / sum (v * inv), rounded to bfloat16, to 16 outputs
inline void store_bf16(uint16_t* o, vf v, float inv) { infer::store_bf16(o, _mm512_mul_ps(v, _mm512_set1_ps(inv))); }
// dst[c] = r0[c] | r1[c] << 16 for 16 columns (r1 null: zero)
inline void pack_token_pair(const uint16_t* r0, const uint16_t* r1, uint32_t* dst) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
  const __m512i hi = r1 != nullptr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)))
                                   : _mm512_setzero_si512();
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}
// query row r as the tiles read it: in place
inline const Operand* query_row(const uint16_t* q, int64_t, std::vector<float>&, int64_t) { return q; }
#else
// 8 float32 lanes (AVX2 + FMA). A vector of 8 bfloat16 pairs widened as it is loaded: the low halves (k) and
// the high halves (k + 1) as float32, exact; the query rows and P are float32 already (widened once, exact),
// each element broadcast from memory, and acc gets two FMAs.
using vf = __m256;
constexpr int kLanes = 8;
constexpr int kKeyVectors = 2;  // a packed K block: 16 keys
constexpr int kTileRows = 4;    // rows a tile: 4 x 2 accumulators, 2 x 2 widened K and 2 broadcasts of 16 registers
struct Pairs {
  __m256 even, odd;
};
using Operand = float;
using RowPair = Pairs;
inline Pairs load_pairs(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
}
inline RowPair row_pair(const float* p) { return {_mm256_broadcast_ss(p), _mm256_broadcast_ss(p + 1)}; }
inline vf dot_pairs(vf acc, Pairs a, RowPair b) {
  acc = _mm256_fmadd_ps(a.even, b.even, acc);
  return _mm256_fmadd_ps(a.odd, b.odd, acc);
}
inline vf vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void store_bf16(uint16_t* o, vf v, float inv) { infer::store_bf16(o, _mm256_mul_ps(v, _mm256_set1_ps(inv))); }
inline void pack_token_pair(const uint16_t* r0, const uint16_t* r1, uint32_t* dst) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
  const __m256i hi = r1 != nullptr ? _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1)))
                                   : _mm256_setzero_si256();
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
}
// query row r as the tiles read it: widened into row r of qf (d floats a row)
inline const Operand* query_row(const uint16_t* q, int64_t d, std::vector<float>& qf, int64_t r) {
  float* dst = qf.data() + r * d;
  for (int64_t c = 0; c < d; ++c) {
    const uint32_t bits = static_cast<uint32_t>(q[c]) << 16;
    std::memcpy(dst + c, &bits, sizeof(bits));
  }
  return dst;
}
#endif

constexpr int64_t kKeys = kKeyVectors * kLanes;  // keys per packed K block
constexpr int64_t kChunkRows = 32;  // chunk rows per task: 0.89-0.95x the time of 16 on a Zen 4 (fewer K/V packs), 64 loses on short chunks

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Args {
  const uint16_t* q;
  int64_t q_row, q_head;  // strides of q [T, heads, d]
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  int64_t block_size, kv_heads, heads, d;
  uint16_t* out;
  int64_t out_row, out_head;
  float scale;
};

// s[r][0:kKeys] = q_r . keys of one packed block, float32, for ROWS rows.
template <int ROWS>
inline void scores(const Operand* const* q, int64_t pairs, const uint16_t* block, float* s, int64_t lds) {
  vf acc[ROWS][kKeyVectors];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < kKeyVectors; ++j) acc[r][j] = vzero();
  for (int64_t p = 0; p < pairs; ++p) {
    Pairs kv[kKeyVectors];
    for (int j = 0; j < kKeyVectors; ++j) kv[j] = load_pairs(block + (p * kKeys + kLanes * j) * 2);
    for (int r = 0; r < ROWS; ++r) {
      const RowPair qv = row_pair(q[r] + 2 * p);
      for (int j = 0; j < kKeyVectors; ++j) acc[r][j] = dot_pairs(acc[r][j], kv[j], qv);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < kKeyVectors; ++j) vstore(s + r * lds + kLanes * j, acc[r][j]);
}

// o[r][c0:c0+kLanes*NV] = (P_r V)[c0:...] / sum_r, rounded to bfloat16, for ROWS rows.
template <int ROWS, int NV>
inline void values(const Operand* p, int64_t ldp, int64_t token_pairs, const uint16_t* vp, int64_t d, int64_t c0,
                   const float* inv_sum, uint16_t* const* o) {
  vf acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vzero();
  for (int64_t t = 0; t < token_pairs; ++t) {
    Pairs vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_pairs(vp + (t * d + c0 + kLanes * j) * 2);
    for (int r = 0; r < ROWS; ++r) {
      const RowPair pv = row_pair(p + r * ldp + 2 * t);
      for (int j = 0; j < NV; ++j) acc[r][j] = dot_pairs(acc[r][j], vv[j], pv);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < NV; ++j) store_bf16(o[r] + c0 + kLanes * j, acc[r][j], inv_sum[r]);
}

template <int ROWS>
void values_all(const Operand* p, int64_t ldp, int64_t token_pairs, const uint16_t* vp, int64_t d,
                const float* inv_sum, uint16_t* const* o) {
  constexpr int NV = kLanes == 16 ? 4 : 2;  // 64 columns a pass (AVX-512), 16 (AVX2)
  int64_t c0 = 0;
  for (; c0 + NV * kLanes <= d; c0 += NV * kLanes) values<ROWS, NV>(p, ldp, token_pairs, vp, d, c0, inv_sum, o);
  if (c0 < d) values<ROWS, NV / 2>(p, ldp, token_pairs, vp, d, c0, inv_sum, o);  // AVX-512: d % 64 == 32
}

struct Scratch {
  std::vector<uint32_t> k, v;  // packed keys, packed values (words: bfloat16 pairs)
  std::vector<float> s, inv_sum;
  std::vector<Operand> p;
  std::vector<float> qf;  // AVX2: the query rows widened to float32
  std::vector<const Operand*> q;
  std::vector<uint16_t*> o;
};

// The calling thread's Scratch, kept from call to call (its vectors only grow): made per call, every prompt step
// allocated and freed each worker's packed keys, values and scores.
Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Rows i0 .. i0 + n of one chunk (query rows start + i, after `cached` tokens) for KV head h.
void task(const Args& a, int64_t start, int64_t cached, const int64_t* table, int64_t h, int64_t i0, int64_t n,
          Scratch& w) {
  const int64_t d = a.d, pairs = d / 2, group = a.heads / a.kv_heads, rows = n * group;
  const int64_t len = cached + i0 + n;  // keys the last row sees
  const int64_t keys = round_up(len, kKeys), ldp = round_up(len, 2);
  const auto visible = [&](int64_t r) { return cached + i0 + r / group + 1; };
  const auto token = [&](const uint16_t* cache, int64_t t) {
    return cache + ((table[t / a.block_size] * a.block_size + t % a.block_size) * a.kv_heads + h) * d;
  };
  w.k.resize(keys * pairs);
  for (int64_t t = 0; t < keys; ++t) {
    uint32_t* dst = w.k.data() + (t / kKeys) * pairs * kKeys + t % kKeys;
    if (t < len) {
      const auto* src = reinterpret_cast<const uint32_t*>(token(a.k_cache, t));
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeys] = src[p];
    } else {
      for (int64_t p = 0; p < pairs; ++p) dst[p * kKeys] = 0;
    }
  }
  w.q.resize(rows), w.o.resize(rows);
  w.qf.resize(std::is_same_v<Operand, float> ? rows * d : 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = start + i0 + r / group, head = h * group + r % group;
    w.q[r] = query_row(a.q + row * a.q_row + head * a.q_head, d, w.qf, r);
    w.o[r] = a.out + row * a.out_row + head * a.out_head;
  }
  // S = Q K^T over the key blocks each tile's last row sees
  w.s.resize(rows * keys);
  const auto score_rows = [&](auto rows_c, int64_t r) {
    constexpr int R = decltype(rows_c)::value;
    const int64_t blocks = (visible(r + R - 1) + kKeys - 1) / kKeys;
    for (int64_t b = 0; b < blocks; ++b)
      scores<R>(w.q.data() + r, pairs, reinterpret_cast<const uint16_t*>(w.k.data() + b * pairs * kKeys),
                w.s.data() + r * keys + b * kKeys, keys);
  };
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) score_rows(std::integral_constant<int, kTileRows>{}, r);
  for (; r + 2 <= rows; r += 2) score_rows(std::integral_constant<int, 2>{}, r);
  for (; r < rows; ++r) score_rows(std::integral_constant<int, 1>{}, r);
  // P = exp(scale * S - max) over the visible keys, zero past them, rounded to bfloat16
  w.p.resize(rows * ldp), w.inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r)
    w.inv_sum[r] = infer::softmax_row_bf16(w.s.data() + r * keys, visible(r), ldp, a.scale, w.p.data() + r * ldp);
  // V as token pairs: word (t, dim) = v[2t][dim] | v[2t + 1][dim] << 16; a token past len is zero
  const int64_t token_pairs = ldp / 2;
  w.v.resize(token_pairs * d);
  for (int64_t t = 0; t < token_pairs; ++t) {
    const uint16_t* r0 = token(a.v_cache, 2 * t);
    const uint16_t* r1 = 2 * t + 1 < len ? token(a.v_cache, 2 * t + 1) : nullptr;
    uint32_t* dst = w.v.data() + t * d;
    for (int64_t c = 0; c < d; c += kLanes) pack_token_pair(r0 + c, r1 != nullptr ? r1 + c : nullptr, dst + c);
  }
  // O = P V over the token pairs each tile's last row sees
  const auto* vp = reinterpret_cast<const uint16_t*>(w.v.data());
  const auto value_rows = [&](auto rows_c, int64_t r) {
    constexpr int R = decltype(rows_c)::value;
    const int64_t tp = (visible(r + R - 1) + 1) / 2;
    values_all<R>(w.p.data() + r * ldp, ldp, tp, vp, d, w.inv_sum.data() + r, w.o.data() + r);
  };
  r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) value_rows(std::integral_constant<int, kTileRows>{}, r);
  for (; r + 2 <= rows; r += 2) value_rows(std::integral_constant<int, 2>{}, r);
  for (; r < rows; ++r) value_rows(std::integral_constant<int, 1>{}, r);
}

}  // namespace

// q [T, heads, d] bfloat16 (rows may be strided, heads contiguous); k_cache, v_cache [blocks,
// block_size, kv_heads, d]; out [T, heads, d], written at the chunks' rows only. Chunk c has query
// rows starts[c] .. + lengths[c], follows cached[c] tokens, and reads its blocks from tables[c]; its
// own tokens' K and V are in the cache already.
void chunk_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                     torch::Tensor starts, torch::Tensor lengths, torch::Tensor cached, torch::Tensor tables,
                     double scale) {
  infer::check_chunk_attention(q, k_cache, v_cache, out, starts, lengths, cached, tables, 0);
  const int64_t d = q.size(2), heads = q.size(1), kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t chunks = starts.numel(), width = tables.size(1);
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lengths.data_ptr<int64_t>(), *ca = cached.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const Args args{reinterpret_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                  reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), reinterpret_cast<const uint16_t*>(v_cache.data_ptr()),
                  block_size, kv_heads, heads, d, reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0),
                  out.stride(1), static_cast<float>(scale)};
  infer::for_chunk_tasks(chunks, ln, ca, kv_heads, kChunkRows, []() -> Scratch& { return thread_scratch(); },
                         [&](Scratch& scratch, int64_t c, int64_t h, int64_t i0, int64_t n) {
                           task(args, st[c], ca[c], tb + c * width, h, i0, n, scratch);
                         });
}

bool available() { return true; }

#else

void chunk_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                     torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "chunk_attention: built for a CPU without AVX2 and FMA");
}

bool available() { return false; }

#endif

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernel alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_attention", &chunk_attention,
        "attention of prompt chunks over the paged cache on AVX-512 (BF16 or F) or AVX2 + FMA (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("available", &available, "whether this build has the kernel (its target has AVX2 and FMA at least)");
}
#endif
