// 16-lane fp32 vectors for the CPU kernels: loads that widen bf16/fp16, stores that round
// to bf16 as torch does, and e^x. GCC/Clang vector extensions keep the kernels free of one
// instruction set's intrinsics: one AVX-512 register, two AVX2 ones.
#pragma once

// GCC 12 takes the AVX-512 intrinsics' undefined pass-through operand (in the kernels that
// use them) for an uninitialised variable.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// 16 values widened to fp32 from an unaligned address.
inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load16(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}

inline vf load16(const c10::Half* p) {
#ifdef __FLT16_MANT_DIG__
  typedef _Float16 vhf __attribute__((vector_size(32)));
  vhf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float hsum(vf a) {
  vf8 s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The lane sums of 16 vectors, in order, as one vector: a transpose-and-add tree that
// costs 45 operations where 16 separate horizontal sums would cost about 160. Always
// inlined: GCC 12 called it out of line from decode attention's scores, the 16 vectors
// passed through memory, and it took a quarter of the kernel's time (a sampling profile;
// inlined, the op on a hot cache ran 1.05-1.5x faster, docs/benchmarks.md).
__attribute__((always_inline)) inline vf hsum16(const vf* a) {
  vf r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // [a_2i: 8 partial sums | a_2i+1: 8]
    r[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // four vectors, 4 partial sums each
    s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // eight vectors, 2 partial sums each
    u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

inline float hmax(vf a) {
  vf8 x = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
  vf8 y = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  x = x > y ? x : y;
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, x[i]);
  return m;
}

// 16 fp32 values stored at an unaligned address, rounded to bf16 as c10::BFloat16 rounds:
// to nearest even, any NaN to the canonical quiet NaN.
inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf round_bf16(vf v) {  // v rounded to bf16's precision, still as fp32
  const vu u = reinterpret_cast<vu>(v);
  const vu rounded = (u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u;
  const vu nan = reinterpret_cast<vu>((u & 0x7fffffffu) > 0x7f800000u);  // ones where NaN
  return reinterpret_cast<vf>((nan & 0x7fc00000u) | (~nan & rounded));
}

inline void store16(c10::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector(reinterpret_cast<vu>(round_bf16(v)) >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

typedef int32_t vi __attribute__((vector_size(64)));

// The 16x16 transpose of a[0..15] in place: four rounds of interleaving row i with row
// i + 8, each of which rotates an element's (row, column) bits by one.
inline void transpose16(vf* a) {
  for (int round = 0; round < 4; ++round) {
    vf t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = __builtin_shufflevector(a[i], a[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                         21, 6, 22, 7, 23);
      t[2 * i + 1] = __builtin_shufflevector(a[i], a[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                             28, 13, 29, 14, 30, 15, 31);
    }
    std::memcpy(a, t, sizeof t);
  }
}

// e^x for x <= 0 in every lane (Cephes' expf polynomial, ~1 ulp; x is clamped below at -87,
// not above, so small positive x are exact too). V: vf, or any float vector type
// (native_vec.h's register-width vn).
template <typename V>
inline V exp_nonpositive(V x) {
  using VI = decltype(x < x);  // the int vector of V's width
  const V lo = V{} - 87.0f, magic = V{} + 12582912.0f;  // 1.5 * 2^23 rounds to integers
  x = x < lo ? lo : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<V>((__builtin_convertvector(n, VI) + 127) << 23);
}

// x * sigmoid(x), with e^-|x| so the exponential never overflows, and one division.
inline vf silu(vf x) {
  const vf e = exp_nonpositive(x < 0 ? x : -x);
  const vf r = (vf{} + 1.f) / (1.f + e);
  return x * (x >= 0 ? r : e * r);
}

// The first n (< 16) values of p, zero-padded; and their store. Row tails of any width.
template <typename T>
inline vf load_n(const T* p, int n) {
  T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load16(tmp);
}

template <typename T>
inline void store_n(T* p, vf v, int n) {
  T tmp[kLanes];
  store16(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

// Loads and stores of n <= 16 values.
template <typename T>
inline vf load_any(const T* p, int n) {
  return n == kLanes ? load16(p) : load_n(p, n);
}

template <typename T>
inline void store_any(T* p, vf v, int n) {
  if (n == kLanes)
    store16(p, v);
  else
    store_n(p, v, n);
}

// fp32 values rounded as a tensor of T would hold them.
template <typename T>
inline vf in_dtype(vf v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_bf16(v);
}

// fn(static_cast<T*>(nullptr)) for x's dtype T, float32 or bfloat16; `op` names the caller
// in the error.
template <typename F>
void dispatch_float_bf16(const at::Tensor& x, const char* op, F&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, op, ": float32 or bfloat16 expected, got ", x.scalar_type());
  }
}

}  // namespace
