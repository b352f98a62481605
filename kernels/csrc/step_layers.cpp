// Every decoder layer of a step, in one call: the same kernels the model calls one by one (layer_ops,
// paged decode attention, the chunk attention and linears on AMX tiles or AVX-512 BF16, int4 and int8 linears), from C++.
//
// At batch 1 a step streams 270 MB of weights in about 9 ms; called from Python, the ~13 kernel
// calls a layer (each a module call, a pybind crossing and a few tensor views) added about 3 ms more
// on a Zen 4 host. Here a layer is a dozen direct C++ calls. This file includes the kernels' own
// sources (their modules switched off), so there is one copy of each kernel, each compiled as it is
// on its own: no contraction for the layer ops (they round exactly where torch rounds), GCC's default
// contraction for the attention kernels and linears, none with fast-math, so a fused step computes the same
// bits as the Python loop.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__)
#include "amx_tiles.h"  // here, outside the namespaces below that include the kernels using it
#endif
#include "call_buffer.h"
#include "chunk_checks.h"
#include "float_storage.h"
#include "prefetch.h"
#include "sample_rows.h"
#include "simd_math.h"
#include "work_split.h"

#define INFER_NO_MODULE
namespace layer_ops {
#include "layer_ops.cpp"
}
// Every kernel below is built on its own with GCC's default contraction (fp-contract=fast), which this
// module's -ffp-contract=off (for the layer ops above) would otherwise turn off: a multiply-add fused in one
// build and not in the other gives last-bit differences that a bfloat16 rounding now and then turns into a
// different value. None is built with -ffast-math: a pragma cannot reproduce that flag (the shared headers
// above are compiled before it), and the decode attention built both ways gave the Python loop and this
// step different bits on 3 of 6 seeds of tests/test_fused_step.py's random Qwen2 models.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
namespace attention {
#include "paged_attention.cpp"
}
namespace chunk {
#include "bf16_attention.cpp"
}
namespace linear {
#include "bf16_linear.cpp"
}
namespace int4 {
#include "int4_linear.cpp"
}
namespace int8 {
#include "int8_linear.cpp"
}
// AMX tiles where the build targets them (kernels/step_layers.py adds the flags on a CPU with AMX)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFER_STEP_AMX 1
namespace amx {
#include "amx_linear.cpp"
}
namespace amx_chunk {
#include "amx_attention.cpp"
}
constexpr bool kHasAmx = true;
#else
constexpr bool kHasAmx = false;
#endif
#pragma GCC pop_options

// input norm, qkv bias (or empty), post norm, then qkv, o, gate_up, down as LINEAR_SLOTS tensors each
constexpr int WEIGHTS_PER_LAYER = 3 + 4 * 3;
// bfloat16: packed, empty, empty; int4: packed, scales, offsets (or empty); int8 (W8A16): packed, scales, empty;
// int8 (W8A8): packed, scales, column sums; fp8 (uint8 e4m3 bytes): packed, scales, empty
constexpr int LINEAR_SLOTS = 3;

// A linear as the model runs it: AMX tiles for a bfloat16 weight packed as tiles ([N/16, K/32, 16, 32], bias
// bfloat16), the AVX-512 BF16 kernel for one packed in column blocks ([blocks, K/2, width, 2], bias float32),
// the int4 one for int32 words, the int8 ones for int8 codes ([blocks, K, W]: W8A16; [blocks, K/4, W, 4]: W8A8),
// the fp8 one for e4m3 bytes (uint8 [blocks, K, W]).
// Each linear is dispatched on its own weight, so float, int4 and int8 linears mix in one model.
torch::Tensor run_linear(const torch::Tensor& x, const torch::Tensor* w, int64_t n, c10::optional<torch::Tensor> bias) {
  if (w[0].scalar_type() == at::kChar) {
    if (w[0].dim() == 4) return int8::w8a8_linear(x, w[0], w[1], w[2], n, bias);
    return int8::int8_linear(x, w[0], w[1], n, bias);
  }
  if (w[0].scalar_type() == at::kByte) return int8::fp8_linear(x, w[0], w[1], n, bias);
  if (w[0].scalar_type() == at::kBFloat16 && w[0].dim() == 4 && w[0].size(3) != 2) {
#ifdef INFER_STEP_AMX
    return amx::amx_linear(x, w[0], bias);
#else
    TORCH_CHECK(false, "step_layers: an AMX-packed weight, but this build has no AMX (kernels/step_layers.py)");
#endif
  }
  if (w[0].scalar_type() == at::kBFloat16) return linear::bf16_linear(x, w[0], n, bias);
  c10::optional<torch::Tensor> offsets;
  if (w[2].numel() > 0) offsets = w[2];
  return int4::int4_linear(x, w[0], w[1], offsets, n, bias);
}

// One layer's attention over the paged cache, as runtime/engine/attention.py's PagedAttention runs it
// with the C++ kernels: a decode-only step (no chunks) in one decode call over every row; otherwise
// the prompt chunks by the chunk kernel (AMX tiles' where amx_chunks, else AVX-512 BF16's) and the
// decode rows (gathered) by the decode one.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& chunk_starts, const torch::Tensor& chunk_lengths,
                     const torch::Tensor& chunk_cached, const torch::Tensor& chunk_tables,
                     const torch::Tensor& decode_rows, const torch::Tensor& block_tables,
                     const torch::Tensor& context_lens, const c10::optional<torch::Tensor>& starts, double scale,
                     bool amx_chunks, bool bf16_dots) {
  if (chunk_starts.numel() == 0)
    return attention::paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, starts, 0.0,
                                             bf16_dots);
  torch::Tensor out = torch::empty(q.sizes(), q.options());
  if (amx_chunks) {
#ifdef INFER_STEP_AMX
    amx_chunk::chunk_attention(q, k_cache, v_cache, out, chunk_starts, chunk_lengths, chunk_cached, chunk_tables,
                               scale);
#else
    TORCH_CHECK(false, "step_layers: amx_chunks, but this build has no AMX (kernels/step_layers.py)");
#endif
  } else {
    chunk::chunk_attention(q, k_cache, v_cache, out, chunk_starts, chunk_lengths, chunk_cached, chunk_tables, scale);
  }
  if (decode_rows.numel() > 0) {
    torch::Tensor od = attention::paged_decode_attention(q.index_select(0, decode_rows), k_cache, v_cache,
                                                         block_tables, context_lens, scale, starts, 0.0, bf16_dots);
    out.index_copy_(0, decode_rows, od);
  }
  return out;
}

// A model's weights as step_layers reads them (WEIGHTS_PER_LAYER tensors a layer), converted from a Python list
// once, when the model loads: passed as a list every step, pybind converted and reference-counted each of its
// 450 tensors (the embedded model) twice a step, ~1.5% of a batch-1 W8A8 decode's samples on Zen 5.
struct StepWeights {
  std::vector<torch::Tensor> tensors;
  explicit StepWeights(std::vector<torch::Tensor> t) : tensors(std::move(t)) {}
};

// x: the step's embeddings [T, H] bfloat16 (read only); returns the last layer's output, and fills
// residual ([T, H], like x) with the residual stream. step_weights: WEIGHTS_PER_LAYER tensors a layer, the linears
// packed by kernels/amx_linear.py, bf16_linear.py or int4_linear.py.
// kv_cache [layers, 2, blocks, block_size, kv_heads, d];
// slots, positions [T]; cos, sin: float32 [positions, d]. Prompt chunks (none: every row is a decode):
// chunk_starts, chunk_lengths, chunk_cached [C] (first row, rows this step, tokens cached before),
// chunk_tables [C, W]. Decodes: decode_rows [D] (their rows; ignored without chunks), block_tables
// [D, W'], context_lens [D]. amx_chunks: the chunks on AMX tiles (what the engine runs where AMX is on).
// bf16_dots: the decodes' scores on vdpbf16ps where built in, else float32 FMAs (paged_attention.cpp's choice).
// Sliding windows: decode_starts [D] (each decode's window's first position) and window_layers [layers] bool
// (the layers that read them), or both empty.
torch::Tensor step_layers(torch::Tensor x, torch::Tensor residual, const StepWeights& step_weights,
                          torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor positions, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor chunk_starts, torch::Tensor chunk_lengths,
                          torch::Tensor chunk_cached, torch::Tensor chunk_tables, torch::Tensor decode_rows,
                          torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor decode_starts,
                          torch::Tensor window_layers, bool amx_chunks, bool bf16_dots, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "step_layers: x must be contiguous [T, H] bfloat16");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "step_layers: residual must be like x");
  const std::vector<torch::Tensor>& weights = step_weights.tensors;
  const int64_t layers = static_cast<int64_t>(weights.size()) / WEIGHTS_PER_LAYER;
  TORCH_CHECK(layers * WEIGHTS_PER_LAYER == static_cast<int64_t>(weights.size()) && kv_cache.dim() == 6 &&
                  kv_cache.size(0) == layers,
              "step_layers: ", WEIGHTS_PER_LAYER, " weights a layer and a KV cache of as many layers");
  TORCH_CHECK(chunk_starts.numel() > 0 || block_tables.size(0) == x.size(0),
              "step_layers: a step without prompt chunks must have every row a decode");
  TORCH_CHECK(window_layers.numel() == 0 || (window_layers.numel() == layers &&
                                              window_layers.scalar_type() == at::kBool &&
                                              decode_starts.size(0) == block_tables.size(0)),
              "step_layers: window_layers must be [layers] bool with decode_starts [decodes], or both empty");
  window_layers = window_layers.contiguous();
  const bool* windowed = window_layers.numel() ? window_layers.data_ptr<bool>() : nullptr;
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  // A decode-only step on a bfloat16 cache goes around ATen inside the layer loop: its tables and slots checked
  // once here, q and the attention output in one buffer each for every layer, each new key and value copied
  // straight into its slot, the decode kernel called on pointers. The tensor views and checks a layer made
  // (q, k, v, two caches, a contiguous q, the output) cost ~4-5 us a layer at batch 1, 0.13 ms of a W4A16 step.
  const bool raw_decode = chunk_starts.numel() == 0 && kv_cache.scalar_type() == at::kBFloat16;
  torch::Tensor q_rows, attn_rows;
  const int64_t *slot = nullptr, *tables = nullptr, *lens = nullptr, *starts = nullptr;
  if (raw_decode) {
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(1) == 2 && kv_cache.size(4) == kv_heads &&
                    kv_cache.size(5) == head_dim,
                "step_layers: kv_cache must be contiguous [layers, 2, blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows &&
                    block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                    context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                    context_lens.numel() == rows && (windowed == nullptr || (decode_starts.scalar_type() == at::kLong &&
                                                                             decode_starts.is_contiguous())),
                "step_layers: slots, block_tables, context_lens and decode_starts must be contiguous int64, a row each");
    slot = slots.data_ptr<int64_t>();
    tables = block_tables.data_ptr<int64_t>();
    lens = context_lens.data_ptr<int64_t>();
    attention::check_slots(slot, rows, kv_cache.size(2) * kv_cache.size(3));
    attention::check_decode_tables(lens, tables, nullptr, rows, block_tables.size(1), kv_cache.size(3),
                                   kv_cache.size(2));
    if (windowed != nullptr) {
      starts = decode_starts.data_ptr<int64_t>();
      attention::check_decode_tables(lens, tables, starts, rows, block_tables.size(1), kv_cache.size(3),
                                     kv_cache.size(2));
    }
    q_rows = torch::empty({rows, q_size}, x.options());
    attn_rows = torch::empty({rows, q_size}, x.options());
  }
  torch::Tensor h = x;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * WEIGHTS_PER_LAYER;
    if (l == 0) {
      residual.copy_(h);
      h = layer_ops::rms_norm(residual, w[0], eps);
    } else {
      layer_ops::add_rms_norm_(h, residual, w[0], eps);  // residual += h; h = norm(residual)
    }
    c10::optional<torch::Tensor> bias;
    if (w[1].defined() && w[1].numel() > 0) bias = w[1];
    const torch::Tensor* lin = w + 3;  // qkv, o, gate_up, down
    torch::Tensor qkv = run_linear(h, lin, qkv_size, bias);
    layer_ops::rotary_(qkv, positions, cos, sin, heads + kv_heads, head_dim);
    torch::Tensor attn;
    if (raw_decode) {
      constexpr int64_t bf16 = sizeof(at::BFloat16);
      const auto* row = reinterpret_cast<const at::BFloat16*>(qkv.data_ptr());
      auto* q = q_rows.data_ptr<at::BFloat16>();
      auto* k_cache = kv_cache.data_ptr<at::BFloat16>() + l * kv_cache.stride(0);
      auto* v_cache = k_cache + kv_cache.stride(1);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(q + r * q_size, row + r * qkv_size, q_size * bf16);
      attention::store_rows(reinterpret_cast<char*>(k_cache), reinterpret_cast<char*>(v_cache), slot, rows,
                            reinterpret_cast<const char*>(row + q_size), qkv_size * bf16,
                            reinterpret_cast<const char*>(row + q_size + kv_size), qkv_size * bf16, kv_size * bf16);
      attention::decode_kernel<at::BFloat16>(q, k_cache, v_cache, tables, lens, windowed && windowed[l] ? starts : nullptr,
                                             attn_rows.data_ptr<at::BFloat16>(), rows, heads, kv_heads, head_dim,
                                             kv_cache.size(3), block_tables.size(1), static_cast<float>(scale), 0.f,
                                             bf16_dots);
      attn = attn_rows;
    } else {
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads, head_dim});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
      torch::Tensor k_cache = kv_cache.select(0, l).select(0, 0), v_cache = kv_cache.select(0, l).select(0, 1);
      attention::store_kv_(k_cache, v_cache, slots, k, v);
      attn = attend(q, k_cache, v_cache, chunk_starts, chunk_lengths, chunk_cached, chunk_tables, decode_rows,
                    block_tables, context_lens,
                    windowed && windowed[l] ? c10::optional<torch::Tensor>(decode_starts) : c10::nullopt, scale,
                    amx_chunks, bf16_dots)
                 .view({rows, q_size});
    }
    torch::Tensor o = run_linear(attn, lin + LINEAR_SLOTS, hidden, c10::nullopt);
    layer_ops::add_rms_norm_(o, residual, w[2], eps);
    torch::Tensor act = layer_ops::silu_mul(run_linear(o, lin + 2 * LINEAR_SLOTS, 2 * intermediate, c10::nullopt));
    h = run_linear(act, lin + 3 * LINEAR_SLOTS, hidden, c10::nullopt);
  }
  return h;
}

// Row r of float32 logits [rows, vocab]: the index of its first largest value, or -1 where a value is NaN or the
// largest is infinite (the sampler's numpy argmax picks the same index; a row it would find not finite gets -1)
int64_t finite_argmax(const float* row, int64_t vocab) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < vocab; ++i) {  // vectorized: a max and a NaN flag over the row
    const float v = row[i];
    nan |= v != v;
    best = v > best ? v : best;
  }
  if (nan || !std::isfinite(best)) return -1;
  for (int64_t i = 0; i < vocab; ++i)
    if (row[i] == best) return i;
  return -1;
}

// Up to `steps` decode steps of a batch of decodes back to back, each row's next input its own choice: the engine's
// decode bursts (runtime/engine/engine.py). A step embeds each row's token, runs step_layers, the model's final
// norm and its LM head (float32 logits, the bfloat16 column blocks' or AMX tiles'), then takes each row's token: its
// argmax (finite_argmax), or for a sampled row the sampler's draw (sample_rows.h, the kernel the engine's sampler
// runs) with draws[step, r] as its uniform and its inv_temperature, top_k, top_p and min_p (sampled: an
// inv_temperature above 0; draws empty: every row greedy). Each row r's first step is at position
// first_positions[r], its blocks (every step's) in block_tables; stops[r]: its stop tokens. Ends after a step where
// a row chose one of its stops, and before a step where a row's logits are not finite (or leave a sampled row no
// distribution). bf16_dots: as step_layers'. Returns the steps' tokens, [steps done, rows] int64.
torch::Tensor decode_steps(torch::Tensor tokens, torch::Tensor first_positions, const StepWeights& step_weights,
                           torch::Tensor kv_cache, torch::Tensor block_tables, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor embedding, torch::Tensor norm_weight, torch::Tensor head, int64_t vocab,
                           std::vector<std::vector<int64_t>> stops, int64_t steps, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t intermediate, double eps, torch::Tensor draws,
                           torch::Tensor inv_temperature, torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p,
                           bool bf16_dots) {
  const int64_t rows = tokens.numel(), block_size = kv_cache.size(3);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && first_positions.scalar_type() == at::kLong &&
                  first_positions.numel() == rows && block_tables.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == rows && block_tables.is_contiguous() &&
                  static_cast<int64_t>(stops.size()) == rows,
              "decode_steps: tokens, first_positions, block_tables (int64) and stops must have a row each");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kBFloat16 && embedding.size(0) >= vocab,
              "decode_steps: embedding must be a bfloat16 [vocab, hidden] table");
  const auto* first = first_positions.data_ptr<int64_t>();
  const auto* table = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(first[r] >= 0 && first[r] + steps <= width * block_size,
                "decode_steps: row ", r, "'s blocks do not hold its ", steps, " steps");
  const bool sampling = draws.numel() > 0;
  if (sampling) {
    TORCH_CHECK(draws.scalar_type() == at::kFloat && draws.is_contiguous() && draws.dim() == 2 &&
                    draws.size(0) >= steps && draws.size(1) == rows,
                "decode_steps: draws must be float32 [steps, rows], contiguous");
    for (const torch::Tensor* t : {&inv_temperature, &top_p, &min_p})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                  "decode_steps: inv_temperature, top_p and min_p must be float32, one a row");
    TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows,
                "decode_steps: top_k must be int64, one a row");
  }
  std::vector<float> weights_scratch;
  std::vector<uint32_t> candidates;
  const auto longs = tokens.options();
  torch::Tensor ids = tokens.clone(), positions = torch::empty({rows}, longs), slots = torch::empty({rows}, longs);
  torch::Tensor lens = torch::empty({rows}, longs), decode_rows = torch::arange(rows, longs);
  const torch::Tensor none = torch::empty({0}, longs), no_tables = torch::empty({0, 0}, longs);
  const torch::Tensor no_windows = torch::empty({0}, longs.dtype(at::kBool));
  std::vector<int64_t> out;
  for (int64_t done = 0; done < steps; ++done) {
    auto* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      pos[r] = first[r] + done;
      slots.data_ptr<int64_t>()[r] = table[r * width + pos[r] / block_size] * block_size + pos[r] % block_size;
      lens.data_ptr<int64_t>()[r] = pos[r] + 1;
    }
    torch::Tensor x = embedding.index_select(0, ids);
    torch::Tensor residual = torch::empty_like(x);
    torch::Tensor h = step_layers(x, residual, step_weights, kv_cache, slots, positions, cos, sin, none, none, none,
                                  no_tables, decode_rows, block_tables, lens, none, no_windows, false, bf16_dots, heads,
                                  kv_heads, head_dim, intermediate, eps);
    layer_ops::add_rms_norm_(h, residual, norm_weight, eps);
    torch::Tensor logits;
    if (head.dim() == 4 && head.size(3) != 2) {
#ifdef INFER_STEP_AMX
      logits = amx::amx_linear(h, head, c10::nullopt, true);
#else
      TORCH_CHECK(false, "decode_steps: an AMX-packed LM head, but this build has no AMX (kernels/step_layers.py)");
#endif
    } else {
      logits = linear::bf16_linear(h, head, vocab, c10::nullopt, true);
    }
    std::vector<int64_t> chosen(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data_ptr<float>() + r * vocab;
      const float s = sampling ? inv_temperature.data_ptr<float>()[r] : 0.0f;
      chosen[r] = s > 0.0f ? infer::sampling::draw_row(row, vocab, s, draws.data_ptr<float>()[done * rows + r],
                                                        top_k.data_ptr<int64_t>()[r], top_p.data_ptr<float>()[r],
                                                        min_p.data_ptr<float>()[r], weights_scratch, candidates)
                           : finite_argmax(row, vocab);
    }
    if (std::find(chosen.begin(), chosen.end(), -1) != chosen.end()) break;
    out.insert(out.end(), chosen.begin(), chosen.end());
    std::memcpy(ids.data_ptr<int64_t>(), chosen.data(), rows * sizeof(int64_t));
    bool stop = false;
    for (int64_t r = 0; r < rows; ++r)
      stop |= std::find(stops[r].begin(), stops[r].end(), chosen[r]) != stops[r].end();
    if (stop) break;
  }
  return torch::from_blob(out.data(), {static_cast<int64_t>(out.size()) / std::max<int64_t>(rows, 1), rows}, longs)
      .clone();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: each class's build of this file (kernels/isa.py) registers its own, so two load in one process
  py::class_<StepWeights>(m, "StepWeights", py::module_local(),
                          "a model's weights for step_layers, WEIGHTS_PER_LAYER tensors a layer")
      .def(py::init<std::vector<torch::Tensor>>())
      .def("__len__", [](const StepWeights& w) { return w.tensors.size(); });
  // without the GIL: a server's event loop keeps streaming while the engine thread runs a step
  m.def("step_layers", &step_layers, "every decoder layer of a step: prompt chunks and decodes (CPU, bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_steps", &decode_steps, "decode steps back to back, each row's next token its argmax or draw (CPU, bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("available", [] { return linear::available(); }, "whether the column-block linears are built in");
  m.def("has_chunk_attention", [] { return chunk::available(); },
        "whether the AVX-512 BF16 chunk attention is built in (without it, steps with prompt chunks stay in Python)");
  m.def("has_amx", [] { return kHasAmx; }, "whether the AMX linears and chunk attention are built in");
}
