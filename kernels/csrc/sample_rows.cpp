// The sampler's filters and draw over a batch of rows (kernels/sample_rows.py); the draw itself is sample_rows.h.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "sample_rows.h"

namespace {

// ids[i]: row i's draw with weights exp(inv_temperature[i] (x - max)), cut by top_k[i] (< 1 or >= vocab: off),
// top_p[i] (1: off) and min_p[i] (0: off), and the uniform u[i] in [0, 1); invalid[i]: the row had no
// distribution (its id is 0).
std::tuple<torch::Tensor, torch::Tensor> draw_rows(const torch::Tensor& logits, const torch::Tensor& inv_temperature,
                                                   const torch::Tensor& u, const torch::Tensor& top_k,
                                                   const torch::Tensor& top_p, const torch::Tensor& min_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2,
              "draw_rows: logits must be float32 [rows, vocab] on the CPU");
  const torch::Tensor values = logits.stride(1) == 1 ? logits : logits.contiguous();  // rows may be strided
  const int64_t rows = values.size(0), n = values.size(1);
  for (const torch::Tensor* t : {&inv_temperature, &u, &top_p, &min_p}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->numel() == rows,
                "draw_rows: inv_temperature, u, top_p and min_p must be float32 with one value a row");
  }
  TORCH_CHECK(top_k.scalar_type() == torch::kInt64 && top_k.numel() == rows, "draw_rows: top_k must be int64, one a row");
  const torch::Tensor scale = inv_temperature.contiguous(), draws = u.contiguous(), ks = top_k.contiguous(),
                      ps = top_p.contiguous(), mins = min_p.contiguous();
  torch::Tensor ids = torch::zeros({rows}, torch::kInt64), invalid = torch::zeros({rows}, torch::kBool);
  const float* x = values.data_ptr<float>();
  const float *s = scale.data_ptr<float>(), *uu = draws.data_ptr<float>(), *p = ps.data_ptr<float>(),
              *mp = mins.data_ptr<float>();
  const int64_t* k = ks.data_ptr<int64_t>();
  int64_t* out = ids.data_ptr<int64_t>();
  bool* bad = invalid.data_ptr<bool>();
  const int64_t stride = values.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> e;
    std::vector<uint32_t> candidates;
    for (int64_t i = first; i < last; ++i) {
      const int64_t id = infer::sampling::draw_row(x + i * stride, n, s[i], uu[i], k[i], p[i], mp[i], e, candidates);
      out[i] = id < 0 ? 0 : id;
      bad[i] = id < 0;
    }
  });
  return {ids, invalid};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draw_rows", &draw_rows, "inverse-CDF draw per row of float32 logits, with temperature, top-k, top-p, min-p (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
