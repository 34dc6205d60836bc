// Splitting an op's items over torch's threads on a box shared with other
// processes.
//
// at::parallel_for gives each thread one fixed slice. When the OS takes a
// core away for a millisecond (another kvmesh service handling tokens on a
// 2-core machine), the other thread finishes its slice and waits: the op runs
// at the speed of the preempted thread. Measured on the engine in process, a
// neighbour burning 14% of one core slowed decode steps by 14%.
//
// Here each thread still starts on its own contiguous slice, front to back
// (so memory streams stay sequential and prefetchable), but a thread that
// runs out takes items from the back of the other slices. Each slice is one
// 64-bit word (front in the low half, back in the high half) updated by
// compare-and-swap, so owner and thief never take the same item.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace kvmesh {

namespace detail {

struct alignas(64) Slice {
  std::atomic<uint64_t> bounds;  // front | back << 32
};

inline uint64_t pack(uint64_t front, uint64_t back) { return front | (back << 32); }

// Takes one item from the front (owner) or the back (thief); -1 when empty.
inline int64_t take(Slice& slice, bool from_front) {
  uint64_t seen = slice.bounds.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = seen & 0xffffffffu, back = seen >> 32;
    if (front >= back) return -1;
    const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
    if (slice.bounds.compare_exchange_weak(seen, next, std::memory_order_acq_rel,
                                           std::memory_order_relaxed)) {
      return static_cast<int64_t>(from_front ? front : back - 1);
    }
  }
}

}  // namespace detail

// Calls fn(item, forward) exactly once for every item in [0, n); `forward` is
// false for items taken from the back of another thread's slice (a kernel
// may use it to prefetch the item it will most likely get next).
template <typename Fn>
void parallel_items(int64_t n, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region() || n >= (int64_t{1} << 31)) {
    for (int64_t i = 0; i < n; ++i) fn(i, true);
    return;
  }
  std::unique_ptr<detail::Slice[]> slices(new detail::Slice[threads]);
  for (int64_t t = 0; t < threads; ++t) {
    slices[t].bounds.store(detail::pack(n * t / threads, n * (t + 1) / threads),
                           std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // Normally one slice per call; several when torch ran fewer threads.
    for (int64_t own = begin; own < end; ++own) {
      for (int64_t item; (item = detail::take(slices[own], true)) >= 0;) fn(item, true);
    }
    for (int64_t k = 1; k < threads; ++k) {
      detail::Slice& victim = slices[(begin + k) % threads];
      for (int64_t item; (item = detail::take(victim, false)) >= 0;) fn(item, false);
    }
  });
}

}  // namespace kvmesh
