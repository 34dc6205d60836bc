// One kernel template for float32 and bfloat16 tensors.
//
// A bfloat16 kernel loads its inputs as float, computes in float32 and stores
// each result rounded once to bfloat16 (nearest, ties to even, as torch's
// conversion does). Where torch, run on bfloat16 tensors, rounds an
// intermediate (every elementwise op stores its result as bfloat16), the
// kernel rounds at the same point with round_as<T>, so the two agree. For
// float32, to_float, from_float and round_as are identities: the float32
// kernels compile to the same arithmetic as before they were templated.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <bit>
#include <cstdint>

namespace kvmesh {

// Conversions written out rather than taken from c10::BFloat16, whose
// float -> bfloat16 rounding branches on isnan: here both directions are a
// few integer ops, which gcc vectorizes inside `omp simd` loops (the NaN test
// alone cost the rotary kernel a quarter of its time).
inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Nearest bfloat16, ties to even: torch's rounding for every non-NaN value.
// NaN needs no test here: the floats a bfloat16 kernel rounds are bfloat16
// inputs (low 16 bits zero) or results of float arithmetic on them, and a NaN
// among those is x86's default NaN or an input NaN quieted with its payload,
// low 16 bits zero again; adding the bias then keeps it a NaN. (Only a NaN
// with payload bits set in both halves could carry into the sign.)
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(rounded), c10::BFloat16::from_bits());
}

// x as a T tensor would store it, read back as float.
template <typename T>
inline float round_as(float x) {
  return to_float(from_float<T>(x));
}

// f(T{}) with T the element type of `dtype`: float or c10::BFloat16.
template <typename F>
void dispatch_float_or_bf16(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": tensors must be float32 or bfloat16, not ", dtype);
  }
}

// Mixed precision is not supported: every floating argument has x's dtype.
inline void check_same_dtype(const at::Tensor& x, const at::Tensor& other, const char* op,
                             const char* x_name, const char* other_name) {
  TORCH_CHECK(other.scalar_type() == x.scalar_type(), op, ": ", other_name, " is ",
              other.scalar_type(), " but ", x_name, " is ", x.scalar_type(),
              "; all must share one dtype (float32 or bfloat16)");
}

}  // namespace kvmesh
