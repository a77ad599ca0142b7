// Scalar reference for kernels/rope.h: dequantize a row, rotate pairs in double, store back.
#include <cmath>
#include <vector>

#include "kernels/rope.h"
#include "layouts/quant.h"

namespace kv::kernels {

void RopeShiftRef(const TensorView& key, std::span<const int32_t> delta, const RopeParams& params) {
  const int64_t head_dim = key.ne[0];
  const int64_t dims = params.dims > 0 ? params.dims : head_dim;
  const int64_t half = dims / 2;
  std::vector<float> row(static_cast<size_t>(head_dim));
  for (int64_t i = 0; i < key.ne[2]; ++i) {
    if (delta[i] == 0) continue;
    for (int64_t h = 0; h < key.ne[1]; ++h) {
      void* r = RowPtr(key, h, i);
      LoadRowAsF32(r, head_dim, key.dtype, row.data());
      for (int64_t k = 0; k < half; ++k) {
        const double theta =
            static_cast<double>(params.freq_scale) *
            std::pow(static_cast<double>(params.base), -2.0 * static_cast<double>(k) / dims);
        const double angle = static_cast<double>(delta[i]) * theta;
        const float c = static_cast<float>(std::cos(angle));
        const float s = static_cast<float>(std::sin(angle));
        const int64_t a = params.neox ? k : 2 * k;
        const int64_t b = params.neox ? k + half : 2 * k + 1;
        const float x0 = row[a];
        const float x1 = row[b];
        row[a] = x0 * c - x1 * s;
        row[b] = x0 * s + x1 * c;
      }
      StoreRowFromF32(row.data(), head_dim, key.dtype, r);
    }
  }
}

}  // namespace kv::kernels
