// A model's decoder layers in one call (CPU): the steps of stallfree/model/layer_steps.py,
// each running the kernels its Python step calls (fused_ops.cpp, amx_linear.cpp,
// f32_linear.cpp or quant_linear.cpp, rope_cache.cpp, paged_prefill.cpp, paged_decode.cpp)
// in the same order on the same tensors, so the results are the same bits; only the Python
// between them is gone. At a one-row decode step a layer's kernels read its weights in
// ~0.2 ms, and the Python around its eight kernel calls (module calls, the checks choosing
// each path, the dispatch from Python) cost ~0.07 ms more per layer (docs/benchmarks.md).
// stallfree/model/layer_loop.py decides when this applies; everything else takes the
// Python path, which stays the reference.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <cstdint>
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
// The attention kernels' trailing (window, softcap): this loop runs no window (0).
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

// What the attention steps read besides the stream: the forward's, shared by the layers.
struct Attention {
  const Tensor& kv_cache;
  const Tensor& cos;
  const Tensor& sin;
  const Tensor& slot_mapping;
  const Tensor& decode_tables;
  const Tensor& decode_lens;
  at::TensorList prefill;  // empty, or the chunks' block tables, query lens, context lens
  int64_t prefill_rows;
  int64_t heads;
  int64_t kv_heads;
  int64_t dim;
  bool tiles;
};

// Rows [0, prefill_rows) are prefill chunks, the rest one-token decodes, as paged_attention
// (attention.py) splits them.
Tensor attend(const Kernels& k, const Tensor& q, const Tensor& cache, const Attention& a,
              double scale, double softcap) {
  const int64_t rows = q.size(0), decodes = rows - a.prefill_rows;
  std::vector<Tensor> parts;
  if (a.prefill_rows > 0)
    parts.push_back(k.paged_prefill.call(q.narrow(0, 0, a.prefill_rows), cache, a.prefill[0],
                                         a.prefill[1], a.prefill[2], scale, a.tiles,
                                         /*window*/ 0, softcap));
  if (decodes > 0)
    parts.push_back(k.paged_decode.call(q.narrow(0, a.prefill_rows, decodes), cache,
                                        a.decode_tables, a.decode_lens, scale,
                                        /*split: automatic, paged_decode.AUTO_SPLIT*/ -1,
                                        a.tiles, /*window*/ 0, softcap));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

// stallfree/model/layer_steps.py's Op, lowered by layer_loop.py into records of
// (op, first weight, quant format, features, flag) and two values.
enum Op : int64_t { kAddNorm = 1, kNorm, kMatmul, kGated, kQKNorm, kAttend };
constexpr int64_t kInts = 5, kFloats = 2;

struct Step {
  int64_t op, weight, quant, features, flag;
  double value, value2;
};

// The stream between steps, as the Python layers keep it.
struct Stream {
  Tensor h, residual;
};

// An RMSNorm over each head of qkv's q and k columns, in place (before RoPE).
void norm_heads(const Kernels& k, Tensor& qkv, const Tensor* w, const Step& s,
                const Attention& a) {
  const int64_t rows = qkv.size(0);
  const int64_t spans[2][2] = {{0, a.heads * a.dim}, {a.heads * a.dim, a.kv_heads * a.dim}};
  for (int i = 0; i < 2; ++i) {
    Tensor part = qkv.narrow(1, spans[i][0], spans[i][1]);
    const Tensor normed = k.rms_norm.call(part.reshape({-1, a.dim}).contiguous(), w[i],
                                          i == 0 ? s.value : s.value2);
    part.copy_(normed.view({rows, spans[i][1]}));
  }
}

void run(const Kernels& k, const Step& s, const Tensor* w, Stream& st, const Attention& a) {
  switch (s.op) {
    case kAddNorm:
      if (st.residual.defined()) {
        st.h = k.add_rms_norm.call(st.h, st.residual, w[0], s.value);
      } else {  // the model's first norm starts the residual stream
        st.residual = st.h;
        st.h = k.rms_norm.call(st.h, w[0], s.value);
      }
      return;
    case kNorm:
      st.h = k.rms_norm.call(st.h, w[0], s.value);
      return;
    case kMatmul:
      st.h = matmul(k, st.h, w[0], s.features, false, s.quant);
      if (s.flag) st.h = at::add(st.h, w[1]);  // the bias, added as linear.py adds it
      return;
    case kGated:
      if (s.flag == 0) {  // SiLU, fused into the matmul
        st.h = matmul(k, st.h, w[0], s.features, true, s.quant);
      } else {  // tanh-GELU on the gate, as the Python step applies it
        const std::vector<Tensor> halves =
            matmul(k, st.h, w[0], s.features, false, s.quant).chunk(2, -1);
        st.h = at::mul(at::gelu(halves[0], "tanh"), halves[1]);
      }
      return;
    case kQKNorm:
      norm_heads(k, st.h, w, s, a);
      return;
    case kAttend: {
      Tensor cache = a.kv_cache.select(0, s.features);
      const int64_t rows = st.h.size(0), q_size = a.heads * a.dim;
      k.rope_cache.call(st.h, a.cos, a.sin, cache, a.slot_mapping, a.heads, a.kv_heads);
      const Tensor q = st.h.narrow(1, 0, q_size).view({rows, a.heads, a.dim});
      st.h = attend(k, q, cache, a, s.value, s.value2).reshape({rows, q_size});
      return;
    }
    default:
      TORCH_CHECK(false, "decoder_layers: no step ", s.op);
  }
}

// The weights a step reads, from its first.
int64_t weights_read(const Step& s) {
  if (s.op == kAttend) return 0;
  return s.op == kQKNorm || (s.op == kMatmul && s.flag) ? 2 : 1;
}

// x [T, hidden] (bf16 or float32, as the packings) through the steps; returns (h, the
// residual stream), as the Python layers leave them: after a layer, its output and the
// stream before it, for the final norm to add; after the final norm's step, that norm of
// their sum and the sum. As there, x itself starts the residual stream: the second norm
// adds into it, and the residual returned is x's storage.
std::tuple<Tensor, Tensor> decoder_layers(
    Tensor x, at::TensorList weights, const Tensor& steps, const Tensor& values,
    const Tensor& kv_cache, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
    const Tensor& decode_tables, const Tensor& decode_lens, at::TensorList prefill,
    int64_t prefill_rows, int64_t heads, int64_t kv_heads, int64_t dim,
    bool attention_tiles) {
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 6, "decoder_layers: x [T, hidden] and "
              "kv_cache [layers, 2, blocks, block_size, Hkv, D (int8: D + 4)] expected");
  TORCH_CHECK(steps.scalar_type() == at::kLong && values.scalar_type() == at::kDouble &&
                  steps.dim() == 1 && values.dim() == 1 && steps.is_contiguous() &&
                  values.is_contiguous(),
              "decoder_layers: steps (int64) and values (float64) as contiguous vectors");
  const int64_t count = steps.numel() / kInts;
  TORCH_CHECK(steps.numel() == count * kInts && values.numel() == count * kFloats,
              "decoder_layers: ", kInts, " ints and ", kFloats, " floats per step expected");
  TORCH_CHECK(prefill_rows == 0 || prefill.size() == 3,
              "decoder_layers: prefill rows need [block tables, query lens, context lens]");
  const Kernels& k = kernels();
  // `dim` from the caller: an int8 cache's rows are wider (kv_quant.py), and the kernels
  // read and write that layout themselves.
  const Attention attention{kv_cache,    cos,          sin,   slot_mapping,
                            decode_tables, decode_lens, prefill, prefill_rows,
                            heads,       kv_heads,     dim,   attention_tiles};
  Stream stream{x, Tensor()};
  const int64_t num_weights = static_cast<int64_t>(weights.size());
  const int64_t* ints = steps.data_ptr<int64_t>();
  const double* floats = values.data_ptr<double>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* r = ints + i * kInts;
    const Step s{r[0], r[1], r[2], r[3], r[4], floats[i * kFloats], floats[i * kFloats + 1]};
    TORCH_CHECK(s.weight >= 0 && s.weight + weights_read(s) <= num_weights &&
                    (s.op != kAttend || (s.features >= 0 && s.features < kv_cache.size(0))),
                "decoder_layers: step ", i, " reads past the weights or the cache's layers");
    run(k, s, weights.data() + s.weight, stream, attention);
  }
  return {stream.h, stream.residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("decoder_layers(Tensor(b!) x, Tensor[] weights, Tensor steps, Tensor values, "
        "Tensor(a!) kv_cache, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor decode_tables, Tensor decode_lens, Tensor[] prefill, int prefill_rows, "
        "int heads, int kv_heads, int head_dim, bool attention_tiles) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
