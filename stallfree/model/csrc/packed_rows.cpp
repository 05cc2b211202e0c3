// Rows of a matmul weight read back from its packing (CPU): the embedding lookup of a model
// whose embedding is tied to the LM head, where the packing is the only copy of the matrix
// (packing.py). As torch index ops over the packing's 5-d view a lookup took five ops; here
// it is one call that reads the rows' values where they lie: 2-3.7x faster at 1-2,048 ids
// (docs/benchmarks.md, where a one-row decode step is also shown not to feel the ~0.1 ms).
//
// Layouts (packing.py): "amx", bf16 [N/16][K/32][16 k-pairs][16 columns][2] (amx_pack);
// "f32", float32 [N/16][K][16] (f32_pack). Row r of the plain weight is column r % 16 of
// block r / 16.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

template <typename T>
void copy_row(const T* block, int64_t k_dim, int64_t column, bool pairs, T* out) {
  if (!pairs) {  // value k at block[k * 16 + column]
    for (int64_t k = 0; k < k_dim; ++k) out[k] = block[k * 16 + column];
    return;
  }
  // Value k: tile k / 32, pair (k % 32) / 2, element k % 2 of that pair's column.
  for (int64_t k = 0; k < k_dim; k += 2) {
    const T* pair = block + ((k / 32) * 16 + (k % 32) / 2) * 32 + column * 2;
    out[k] = pair[0];
    out[k + 1] = pair[1];
  }
}

template <typename T>
void gather_rows(const at::Tensor& packed, const int64_t* id, int64_t count, int64_t k,
                 bool pairs, at::Tensor& out) {
  const T* w = packed.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // A row's values lie one (f32) or one pair (bf16) to a 64-byte line: k or k / 2 lines
  // from memory, ~10 us at the default model's width, so 64 rows before a second thread.
  at::parallel_for(0, count, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      copy_row(w + id[i] / 16 * 16 * k, k, id[i] % 16, pairs, o + i * k);
  });
}

// ids [any shape] of rows in [0, n) -> [*ids.shape, k]; `pairs`: the bf16 "amx" layout, else
// the float32 "f32" one.
at::Tensor packed_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k,
                       bool pairs) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(pairs ? dtype == at::kBFloat16 : dtype == at::kFloat,
              "packed_rows: the ", pairs ? "amx layout holds bfloat16" : "f32 layout holds "
              "float32", " values, got ", dtype);
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == n * k && n % 16 == 0 &&
                  (!pairs || k % 32 == 0),
              "packed_rows: a contiguous packing of ", n, " x ", k, " values expected, got ",
              packed.numel());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "packed_rows: int64 ids expected");
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t count = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "packed_rows: row ", id[i], " outside [0, ", n, ")");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, packed.options());
  if (pairs)
    gather_rows<c10::BFloat16>(packed, id, count, k, true, out);
  else
    gather_rows<float>(packed, id, count, k, false, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("packed_rows(Tensor packed, Tensor ids, int n, int k, bool pairs) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("packed_rows", &packed_rows); }
