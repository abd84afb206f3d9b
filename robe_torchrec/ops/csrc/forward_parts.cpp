// Benchmark build only (robe_torchrec/ops/cpu.py builds it as an extension of its own, on
// the first call of cpu.forward_hash_only or cpu.forward_gather_only): the forward's profiling
// aids, which benchmarks/cpu_ops.py times against the forward to split its time into hashing,
// gathering and storing. The production extension (register.cpp) does not contain them.

#include <torch/library.h>

#include "forward.h"

namespace robe {
namespace {

// Benchmark aids, part of the forward's work (no gradient, float32 only), chosen by `part`:
// 1: the hash pass alone (loops, checks, hashes, the tile buffers) without prefetches,
//    gathers and output writes; returns the sum of every block's flat start (so nothing is
//    optimised away), as a 1-element tensor.
// 2: the forward without its output stores: hashes, gathers and pools every row as the
//    forward does, then adds it to a cache-resident sum instead of writing it out; returns
//    that sum, [output_dim] (the forward's output summed over its rows).
at::Tensor forward_part(const at::Tensor& weights, const at::Tensor& values, const at::Tensor& offsets,
                        const std::optional<at::Tensor>& psw, const at::Tensor& table_meta,
                        int64_t output_dim, int64_t block_size, int64_t hash_mode,
                        const std::vector<int64_t>& hash_params, int64_t bounds_check, int64_t part) {
  if (part == 1) {
    return forward_impl<ForwardMode::HASH_ONLY>(weights, values, offsets, psw, table_meta, output_dim,
                                                block_size, hash_mode, hash_params, bounds_check);
  }
  if (part == 2) {
    return forward_impl<ForwardMode::GATHER_ONLY>(weights, values, offsets, psw, table_meta, output_dim,
                                                  block_size, hash_mode, hash_params, bounds_check);
  }
  fail(cat("robe: forward_part takes part 1 (hashing) or 2 (hashing and gathers), got ", part));
}

}  // namespace
}  // namespace robe

#define ROBE_CPU_LIBRARY(name, m) TORCH_LIBRARY(name, m)  // see register.cpp

ROBE_CPU_LIBRARY(TORCH_EXTENSION_NAME, m) { m.def("forward_part", &robe::forward_part); }
