// Loops shared by the forward and the backward: block prefetches and adds, the dynamic
// parallel loop.

#pragma once

#include "common.h"

namespace robe {
namespace {

// Prefetch every cache line of a block of `len` elements (an unaligned block of 32 floats
// spans three lines); kForWrite = 1 asks for the lines in a writable state.
template <int kForWrite = 0, typename scalar_t>
inline void prefetch_block(const scalar_t* p, int64_t len) {
  const char* a = reinterpret_cast<const char*>(p);
  const char* last = reinterpret_cast<const char*>(p + len) - 1;
  for (; a < last; a += 64) __builtin_prefetch(a, kForWrite);
  __builtin_prefetch(last, kForWrite);
}

// dst[0:n] += src[0:n] * scale. A full block of a common Z gets a loop of fixed length, which
// compiles to a few vector instructions; the variable-length loop costs a remainder loop and
// its branches on every block.
template <int64_t kN, typename scalar_t, typename acc_t>
inline void add_scaled_fixed(acc_t* __restrict__ dst, const scalar_t* __restrict__ src, acc_t scale) {
#pragma omp simd
  for (int64_t j = 0; j < kN; ++j) dst[j] += static_cast<acc_t>(src[j]) * scale;
}

template <typename scalar_t, typename acc_t>
inline void add_scaled(acc_t* __restrict__ dst, const scalar_t* __restrict__ src, int64_t n, acc_t scale) {
  switch (n) {
    case 4: return add_scaled_fixed<4>(dst, src, scale);
    case 8: return add_scaled_fixed<8>(dst, src, scale);
    case 16: return add_scaled_fixed<16>(dst, src, scale);
    case 32: return add_scaled_fixed<32>(dst, src, scale);
    default: break;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] += static_cast<acc_t>(src[j]) * scale;
}

// Runs fn(std::integral_constant<int64_t, kZ>{}) with kZ = Z where every block holds Z
// elements (`whole`) and Z is 4, 8, 16 or 32: the loops then add blocks of a length known at
// compile time instead of choosing it block by block; else with kZ = 0. Only where kFixed
// (float32): each fixed length is one more copy of the loop to compile.
template <bool kFixed, typename Fn>
inline void with_block_length(int64_t Z, bool whole, Fn&& fn) {
  if constexpr (kFixed) {
    if (whole) {
      switch (Z) {
        case 4: return fn(std::integral_constant<int64_t, 4>{});
        case 8: return fn(std::integral_constant<int64_t, 8>{});
        case 16: return fn(std::integral_constant<int64_t, 16>{});
        case 32: return fn(std::integral_constant<int64_t, 32>{});
        default: break;
      }
    }
  }
  fn(std::integral_constant<int64_t, 0>{});
}

// at::parallel_for with dynamic load balancing: f(begin, end) runs on consecutive chunks of
// `chunk` indices, handed to the pool's threads as they become free, so a thread slowed by
// another process (shared cores) does not hold the whole call back. No result depends on
// which thread runs which chunk.
template <typename F>
void parallel_for_dynamic(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  const int64_t n_threads = std::min<int64_t>(n_chunks, at::get_num_threads());
  if (n_threads <= 1 || at::in_parallel_region()) {
    f(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n_chunks;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      f(k * chunk, std::min(n, (k + 1) * chunk));
    }
  });
}

// Chunk of a dynamically scheduled loop: at least `grain`, about 8 chunks per thread.
inline int64_t dynamic_chunk(int64_t n, int64_t grain) {
  return std::max<int64_t>(grain, n / (8 * std::max<int64_t>(at::get_num_threads(), 1)));
}

// Samples per tile: the tile's (value, block) starts are hashed (and their weights
// prefetched) in a first pass, then gathered in a second, so the gathers' cache misses
// overlap instead of each one stalling the loop.
constexpr int64_t kTileEntries = 64;

}  // namespace
}  // namespace robe
