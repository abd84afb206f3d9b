// Shared by every file of the ROBE-Z CPU kernels: the headers they use, the constants of
// robe_torchrec/hashing.py and robe_torchrec/ops/meta.py, and the errors. The kernels are
// multithreaded with at::parallel_for (OpenMP: the build must pass -fopenmp, or
// at::parallel_for runs on one thread), chunks handed out dynamically (loops.h).
//
// Files (built together by robe_torchrec/ops/cpu.py, registered in register.cpp):
//   common.h     headers, constants, errors
//   hash.h       the two hashes (hashing.py, bit-exact)
//   layout.h     table_meta parsed into a Layout; the checks of validation.py
//   loops.h      loops shared by the forward and the backward
//   forward.h    the pooled forward's kernel (forward.cpp; forward_parts.cpp, a benchmark build)
//   forward.cpp  torch.ops.<ext>.forward
//   backward.cpp the scatter (dense gradient), the fused backward + optimizer step, the
//                per-sample-weight gradient
//   optimizers.h the fused optimizers' update rules
//   ops.h        the operators' declarations; register.cpp registers them
//
// The data-dependent checks are those of robe_torchrec/ops/validation.py, with the same
// messages, done inside the kernel loops. Layout reminders (see meta.py): values/offsets are
// feature-major, bag (t, b) is values[offsets[t*B + b] : offsets[t*B + b + 1]]; table_meta
// is int64 [7, T].
//
// Only the ATen headers used here and the op-registration header: <torch/extension.h>
// (pybind11, the C++ frontend, every ATen operator) alone compiles in longer than the whole
// kernel once did (benchmarks/results/probes/build_time.md). Everything in these headers has
// internal linkage (an anonymous namespace): each file compiles its own copy of what it uses.

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>  // sysconf: the L2 cache's size

namespace robe {
namespace {

// ---------------------------------------------------------------------------------------
// constants (hashing.py, meta.py)
// ---------------------------------------------------------------------------------------

constexpr uint64_t kPrime = 2038074743ULL;  // REFERENCE_PRIME
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kFmixC1 = 0xFF51AFD7ED558CCDULL;
constexpr uint64_t kFmixC2 = 0xC4CEB9FE1A85EC53ULL;

enum MetaField : int64_t {
  OUT_OFFSET = 0,
  DIM = 1,
  W_OFFSET = 2,
  W_SIZE = 3,
  ROW_OFFSET = 4,
  NUM_ROWS = 5,
  POOLING = 6,
  NUM_META_FIELDS = 7,
};
enum HashModeId : int64_t { HASH_REFERENCE = 0, HASH_MIX = 1 };
enum BoundsCheckId : int64_t { BOUNDS_ERROR = 0, BOUNDS_UNBOUNDED = 1 };
enum OptimizerId : int64_t { OPT_SGD = 0, OPT_ADAGRAD = 1, OPT_ADAM = 2, OPT_ROWWISE_ADAGRAD = 3 };
constexpr int64_t kPoolingMean = 1;

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
// the end of the out-of-range id message (validation.py's RAW_IDS_HINT says the same)
constexpr const char* kRawIdsHint =
    "; ids must lie in [0, num_embeddings): to look up raw ids (any 64-bit value), hash them "
    "with RobeConfig(bounds_check=\"unbounded\", hash=\"mix\")";

// ---------------------------------------------------------------------------------------
// errors: every message starts with "robe:" (validation.py texts); raised as c10::ValueError
// (Python ValueError)
// ---------------------------------------------------------------------------------------

[[noreturn]] void fail(const std::string& msg) {
  TORCH_CHECK_VALUE(false, msg);
  __builtin_unreachable();
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

std::string i128_str(__int128 v) {
  if (v == 0) return "0";
  const bool neg = v < 0;
  unsigned __int128 u = neg ? -static_cast<unsigned __int128>(v) : static_cast<unsigned __int128>(v);
  std::string s;
  while (u) {
    s.push_back(static_cast<char>('0' + static_cast<int>(u % 10)));
    u /= 10;
  }
  if (neg) s.push_back('-');
  return std::string(s.rbegin(), s.rend());
}

// Python's str(float) for the values the checks report (always non-finite there).
std::string py_float_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

// Lowest position at which a check failed, shared by the threads of a parallel loop.
struct FirstError {
  std::atomic<int64_t> pos{kI64Max};
  void record(int64_t p) {
    int64_t cur = pos.load(std::memory_order_relaxed);
    while (p < cur && !pos.compare_exchange_weak(cur, p, std::memory_order_relaxed)) {
    }
  }
  bool any() const { return pos.load(std::memory_order_relaxed) != kI64Max; }
  int64_t get() const { return pos.load(std::memory_order_relaxed); }
};

struct LoopErrors {
  FirstError offsets;  // first bag whose offsets decrease
  FirstError psw;      // first non-finite per-sample weight
  FirstError ids;      // first id out of bounds
};

}  // namespace
}  // namespace robe
