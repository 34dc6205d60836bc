// A step's new K and V rows into their paged-cache slots, for CPU, in one op.
//
// Why: the torch form is a check that no slot is negative plus one
// index_copy_ per cache, per layer: four ops and a host sync (the check)
// 30 times per decode step, ~1.2 ms of a 32 ms step of the 135M model on the
// 2-core AMX Xeon, for ~100 KB of data. Here it is one call per layer.
//
// Semantics are reference.write_kv_cache's: token t's row goes to slot
// slot_mapping[t] of the cache viewed as [num_blocks * block_size, row]; a
// negative slot means "skip this token". Rows are copied as bytes, so any
// dtype works as long as key and cache agree (the caller checks).
//
// A quantized cache (int8 / float8 codes, kv_codes.h) takes float32 or
// bfloat16 rows and quantizes each (token, KV head) row into its page's codes
// and scale, exactly as kernels/kv_quant.py's quantize does.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "float_or_bf16.h"
#include "kv_codes.h"
#include "work_stealing.h"

namespace {

// Tokens per work item: a decode step's few rows stay on the calling thread.
constexpr int64_t kTokensPerItem = 64;

bool rows_contiguous(const at::Tensor& t) {
  // [tokens, heads, head_dim] whose (heads, head_dim) part is one dense row;
  // the token stride may be wider (a view into the fused QKV output).
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

// Rows of T quantized into a cache of codes C; the checks were made by the caller.
template <typename T, typename C>
void write_codes(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                 at::Tensor& v_cache, const int64_t* slots) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1), page_bytes = k_cache.stride(0);
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  auto* kc = static_cast<C*>(k_cache.data_ptr());
  auto* vc = static_cast<C*>(v_cache.data_ptr());
  const int64_t items = (tokens + kTokensPerItem - 1) / kTokensPerItem;
  kvmesh::parallel_items(items, [&](int64_t item, bool) {
    float row[512];
    const int64_t end = std::min(tokens, (item + 1) * kTokensPerItem);
    for (int64_t t = item * kTokensPerItem; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (auto [src, cache] : {std::pair{kp + t * k_stride, kc}, std::pair{vp + t * v_stride, vc}}) {
        C* codes = cache + block * page_bytes + offset * heads * head_dim;
        // The page's scales are float32 words: the page and its tail are 4-byte aligned.
        auto* scales = const_cast<float*>(
            kvmesh::page_scales(cache, block, page_bytes, block_size, heads)) + offset * heads;
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t d = 0; d < head_dim; ++d) row[d] = kvmesh::to_float(src[h * head_dim + d]);
          scales[h] = kvmesh::quantize_row(row, head_dim, codes + h * head_dim);
        }
      }
    }
  });
}

void write_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                     at::Tensor& v_cache, const int64_t* slots) {
  kvmesh::check_code_pages(k_cache, v_cache, "write_kv_cache");
  TORCH_CHECK(k_cache.size(3) <= 512, "write_kv_cache: head_dim above 512");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(),
              "write_kv_cache: key and value differ in dtype");
  kvmesh::dispatch_float_or_bf16(key.scalar_type(), "write_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    kvmesh::dispatch_cache<T>(k_cache.scalar_type(), "write_kv_cache", [&](auto code) {
      using C = decltype(code);
      if constexpr (kvmesh::kIsCode<C>) write_codes<T, C>(key, value, k_cache, v_cache, slots);
    });
  });
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(rows_contiguous(key) && rows_contiguous(value),
              "write_kv_cache: key and value must be [tokens, heads, head_dim] with dense rows");
  if (kvmesh::is_code_type(k_cache.scalar_type())) {
    TORCH_CHECK(k_cache.dim() == 4, "write_kv_cache: caches must be [blocks, block_size, heads, head_dim]");
    TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3) &&
                    value.sizes() == key.sizes(),
                "write_kv_cache: key/value rows do not match the cache's");
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong &&
                    slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
                "write_kv_cache: slot_mapping must be a contiguous int64 [tokens] tensor");
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < key.size(0); ++t) {
      TORCH_CHECK(slots[t] < num_slots, "write_kv_cache: slot ", slots[t], " past the cache's ",
                  num_slots);
    }
    write_quantized(key, value, k_cache, v_cache, slots);
    return;
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "write_kv_cache: caches must be contiguous [blocks, block_size, heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "write_kv_cache: key/value dtype differs from the cache's");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3) &&
                  value.sizes() == key.sizes(),
              "write_kv_cache: key/value rows do not match the cache's");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              "write_kv_cache: slot_mapping must be a contiguous int64 [tokens] tensor");
  const int64_t tokens = key.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "write_kv_cache: slot ", slots[t], " past the cache's ",
                num_slots);
  }
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t items = (tokens + kTokensPerItem - 1) / kTokensPerItem;
  kvmesh::parallel_items(items, [&](int64_t item, bool) {
    const int64_t end = std::min(tokens, (item + 1) * kTokensPerItem);
    for (int64_t t = item * kTokensPerItem; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(kc + slot * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + slot * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
