// A model's decoder layers in one call (CPU): the kernels the Python layer loop calls
// (fused_ops.cpp, amx_linear.cpp or f32_linear.cpp, rope_cache.cpp, paged_prefill.cpp,
// paged_decode.cpp), in
// the same order on the same tensors, so the results are the same bits; only the Python
// between them is gone. At a one-row decode step a layer's kernels read its weights in
// ~0.2 ms, and the Python around its eight kernel calls (module calls, the checks choosing
// each path, the dispatch from Python) cost ~0.07 ms more per layer (docs/benchmarks.md).
// stallfree/model/layer_loop.py decides when this applies; everything else takes the
// Python path, which stays the reference.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using NormSig = Tensor(const Tensor&, const Tensor&, double);
using AddNormSig = Tensor(const Tensor&, Tensor&, const Tensor&, double);
using LinearSig = Tensor(const Tensor&, const Tensor&, int64_t, bool);
using F32LinearSig = Tensor(const Tensor&, const Tensor&, int64_t);
using QuantLinearSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t);
using RopeSig = void(Tensor&, const Tensor&, const Tensor&, Tensor&, const Tensor&, int64_t,
                     int64_t);
// The attention kernels' trailing (window, softcap): this loop runs neither (0, 0.0).
using PrefillSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, double, bool, int64_t, double);
using DecodeSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                         int64_t, bool, int64_t, double);

// The kernels, found once: through the dispatcher, as Python calls them (~0.2 us a call),
// so each stays in its own file behind its registered schema.
struct Kernels {
  c10::TypedOperatorHandle<NormSig> rms_norm = find<NormSig>("stallfree::rms_norm");
  c10::TypedOperatorHandle<AddNormSig> add_rms_norm =
      find<AddNormSig>("stallfree::add_rms_norm");
  c10::TypedOperatorHandle<LinearSig> linear = find<LinearSig>("stallfree::amx_linear");
  c10::TypedOperatorHandle<LinearSig> gated = find<LinearSig>("stallfree::amx_linear_silu_mul");
  c10::TypedOperatorHandle<F32LinearSig> f32_linear =
      find<F32LinearSig>("stallfree::f32_linear");
  c10::TypedOperatorHandle<F32LinearSig> f32_gated =
      find<F32LinearSig>("stallfree::f32_linear_silu_mul");
  c10::TypedOperatorHandle<QuantLinearSig> quant_linear =
      find<QuantLinearSig>("stallfree::quant_linear");
  c10::TypedOperatorHandle<QuantLinearSig> quant_gated =
      find<QuantLinearSig>("stallfree::quant_linear_silu_mul");
  c10::TypedOperatorHandle<RopeSig> rope_cache = find<RopeSig>("stallfree::rope_cache");
  c10::TypedOperatorHandle<PrefillSig> paged_prefill =
      find<PrefillSig>("stallfree::paged_prefill");
  c10::TypedOperatorHandle<DecodeSig> paged_decode = find<DecodeSig>("stallfree::paged_decode");
};

const Kernels& kernels() {
  static const Kernels found;  // on first use: every file's ops are registered by then
  return found;
}

// Per layer, in this order: input norm weight, qkv (amx packing), o (amx), post-attention
// norm weight, gate/up (amx_gated packing), down (amx); for float32, the f32 packings; any
// of the four matmuls' may instead be quant rows (quant_linear.cpp), in any dtype.
constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kMatmulsPerLayer = 4;  // qkv, o, gate/up, down: their quant formats' slots

// x @ W.T from W's packing (gated: silu(gate) * up): quant rows of format `quant` (> 0), else
// the matmul kernel of x's dtype.
Tensor matmul(const Kernels& k, const Tensor& x, const Tensor& packed, int64_t n, bool gated,
              int64_t quant) {
  if (quant > 0)
    return (gated ? k.quant_gated : k.quant_linear).call(x, packed, n, x.size(1), quant);
  if (x.scalar_type() == at::kFloat)
    return (gated ? k.f32_gated : k.f32_linear).call(x, packed, n);
  return (gated ? k.gated : k.linear).call(x, packed, n, true);
}

struct Attention {
  const Tensor& decode_tables;
  const Tensor& decode_lens;
  at::TensorList prefill;  // empty, or the chunks' block tables, query lens, context lens
  int64_t prefill_rows;
  double scale;
  bool tiles;
};

// Rows [0, prefill_rows) are prefill chunks, the rest one-token decodes, as paged_attention
// (attention.py) splits them.
Tensor attend(const Kernels& k, const Tensor& q, const Tensor& cache, const Attention& a) {
  const int64_t rows = q.size(0), decodes = rows - a.prefill_rows;
  std::vector<Tensor> parts;
  if (a.prefill_rows > 0)
    parts.push_back(k.paged_prefill.call(q.narrow(0, 0, a.prefill_rows), cache, a.prefill[0],
                                         a.prefill[1], a.prefill[2], a.scale, a.tiles,
                                         /*window*/ 0, /*softcap*/ 0.0));
  if (decodes > 0)
    parts.push_back(k.paged_decode.call(q.narrow(0, a.prefill_rows, decodes), cache,
                                        a.decode_tables, a.decode_lens, a.scale,
                                        /*split: automatic, paged_decode.AUTO_SPLIT*/ -1,
                                        a.tiles, /*window*/ 0, /*softcap*/ 0.0));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

// x [T, hidden] (bf16 or float32, as the packings) through every layer; returns (the last
// layer's MLP output, the residual stream before it), as LlamaDecoderLayer.forward does, for
// the final norm to add; with `final_norm`, (that norm of their sum, the sum), as the model's
// forward ends. As there, x itself is the first layer's residual stream: the second layer's
// norm adds into it, and the residual returned is x's storage.
std::tuple<Tensor, Tensor> decoder_layers(
    Tensor x, at::TensorList weights, const Tensor& kv_cache, const Tensor& cos,
    const Tensor& sin, const Tensor& slot_mapping, const Tensor& decode_tables,
    const Tensor& decode_lens, at::TensorList prefill, int64_t prefill_rows, int64_t heads,
    int64_t kv_heads, int64_t dim, int64_t gate_up_features, double eps, double scale,
    bool attention_tiles,
    const std::optional<Tensor>& final_norm, at::IntArrayRef quant_formats) {
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 6, "decoder_layers: x [T, hidden] and "
              "kv_cache [layers, 2, blocks, block_size, Hkv, D (int8: D + 4)] expected");
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer,
              "decoder_layers: ", kWeightsPerLayer, " weights per layer expected for ", layers,
              " layers, got ", weights.size());
  TORCH_CHECK(quant_formats.empty() ||
                  static_cast<int64_t>(quant_formats.size()) == layers * kMatmulsPerLayer,
              "decoder_layers: ", kMatmulsPerLayer, " quant formats per layer expected");
  TORCH_CHECK(prefill_rows == 0 || prefill.size() == 3,
              "decoder_layers: prefill rows need [block tables, query lens, context lens]");
  const Kernels& k = kernels();
  // `dim` from the caller: an int8 cache's rows are wider (kv_quant.py), and the kernels
  // below read and write that layout themselves.
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t q_size = heads * dim, qkv_features = (heads + 2 * kv_heads) * dim;
  const Attention attention{decode_tables, decode_lens, prefill, prefill_rows, scale,
                            attention_tiles};
  Tensor residual;  // the first layer's stream is x itself
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = weights.data() + i * kWeightsPerLayer;
    int64_t quant[kMatmulsPerLayer] = {0, 0, 0, 0};
    for (int64_t j = 0; j < kMatmulsPerLayer && !quant_formats.empty(); ++j)
      quant[j] = quant_formats[i * kMatmulsPerLayer + j];
    Tensor cache = kv_cache.select(0, i);
    Tensor h;
    if (residual.defined()) {
      h = k.add_rms_norm.call(x, residual, w[0], eps);
    } else {
      h = k.rms_norm.call(x, w[0], eps);
      residual = x;
    }
    Tensor qkv = matmul(k, h, w[1], qkv_features, false, quant[0]);
    k.rope_cache.call(qkv, cos, sin, cache, slot_mapping, heads, kv_heads);
    const Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads, dim});
    const Tensor o =
        matmul(k, attend(k, q, cache, attention).reshape({rows, q_size}), w[2], hidden, false,
               quant[1]);
    h = k.add_rms_norm.call(o, residual, w[3], eps);
    x = matmul(k, matmul(k, h, w[4], gate_up_features, true, quant[2]), w[5], hidden, false,
               quant[3]);
  }
  if (final_norm.has_value() && residual.defined())
    x = k.add_rms_norm.call(x, residual, *final_norm, eps);
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("decoder_layers(Tensor(b!) x, Tensor[] weights, Tensor(a!) kv_cache, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor decode_tables, Tensor decode_lens, "
        "Tensor[] prefill, int prefill_rows, int heads, int kv_heads, int head_dim, "
        "int gate_up_features, "
        "float eps, float scale, bool attention_tiles, Tensor? final_norm=None, "
        "int[] quant_formats=[]) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
