// ROBE-Z CPU kernels: pooled forward, dense weight gradient, per-sample-weight gradient and
// the fused backward + optimizer step. Multithreaded with at::parallel_for (OpenMP: this file
// must be compiled with -fopenmp, or at::parallel_for runs on one thread), chunks handed out
// dynamically (parallel_for_dynamic).
//
// The hash formulas are those of robe_torchrec/hashing.py, bit-exact; the argument layout is
// that of robe_torchrec/ops/meta.py; the data-dependent checks are those of
// robe_torchrec/ops/validation.py, with the same messages, done inside the kernel loops.
//
// Layout reminders (see meta.py): values/offsets are feature-major, bag (t, b) is
// values[offsets[t*B + b] : offsets[t*B + b + 1]]; table_meta is int64 [7, T].

// Only the ATen headers used here and the op-registration header: <torch/extension.h>
// (pybind11, the C++ frontend, every ATen operator) alone compiles in longer than this whole
// file now does (benchmarks/results/build_time.md). The functions are registered as
// operators of a library named after the extension (see the end of the file) and called as
// torch.ops.<extension name>.<function>.
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

// ---------------------------------------------------------------------------------------
// hashing
// ---------------------------------------------------------------------------------------

inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= kFmixC1;
  x ^= x >> 33;
  x *= kFmixC2;
  x ^= x >> 33;
  return x;
}

struct Feature {
  int64_t out_offset, dim, w_offset, w_size, row_offset, num_rows;
  int64_t nblocks;  // ceil(dim / Z)
  uint64_t span;    // w_size - Z + 1: number of valid block starts
  uint64_t ref_d;   // min(span, P): h mod span == h mod ref_d for every h < P (< 2**32)
  uint64_t ref_magic;  // Lemire fastmod multiplier of ref_d
  bool mean;
  // the hash key of an id of this feature (wrapping, as torch's int64 arithmetic)
  uint64_t key(int64_t id) const { return static_cast<uint64_t>(id) + static_cast<uint64_t>(row_offset); }
};

// The weight of value p in its bag's sum: its per-sample weight (1 without), divided by the
// bag's length for MEAN pooling. (The forward computes it with its checks in between.)
template <typename acc_t>
inline acc_t value_scale(const acc_t* psw, int64_t p, const Feature& f, acc_t len) {
  const acc_t scale = psw != nullptr ? psw[p] : acc_t(1);
  return f.mean ? scale / len : scale;
}

// h_b = (key*A + b*B + C) mod P, start = h_b mod span. h_0 costs one constant-divisor mod,
// each next block one add and a conditional subtract; the mod span is Lemire's fastmod
// (exact: h < P < 2**31 and ref_d < 2**32).
struct RefHash {
  uint64_t a, c;  // raw int64 bit patterns (wrapping arithmetic, as torch does)
  uint64_t b_mod;  // B mod P (floor mod), so the incremental step is exact for any B
  // steps[b] = b * B mod P, for starts(): block b's h is h_0 + steps[b], less P if it
  // reaches P, without the step-by-step chain of blocks()
  static constexpr int64_t kMaxStartsBlocks = 64;
  std::array<uint64_t, kMaxStartsBlocks> steps;
  // h_0 = (key * A + C) mod P
  inline uint64_t first(uint64_t key) const {
    const int64_t x = static_cast<int64_t>(key * a + c);
    const int64_t r = x % static_cast<int64_t>(kPrime);
    return static_cast<uint64_t>(r < 0 ? r + static_cast<int64_t>(kPrime) : r);
  }
  static uint64_t start_in(uint64_t h, uint64_t magic, uint64_t d) {
    const uint64_t low = magic * h;
    return static_cast<uint64_t>((static_cast<unsigned __int128>(low) * d) >> 64);
  }
  template <typename Fn>
  inline void blocks(uint64_t key, const Feature& f, Fn&& fn) const {
    uint64_t h = first(key);
    const uint64_t magic = f.ref_magic, d = f.ref_d;
    for (int64_t blk = 0; blk < f.nblocks; ++blk) {
      fn(blk, start_in(h, magic, d));
      h += b_mod;
      h = h >= kPrime ? h - kPrime : h;
    }
  }
  // out[b] = w_offset + the start of block b (the forward's hash pass, for features of at
  // most kMaxStartsBlocks blocks), in a loop whose blocks do not wait on each other, so it
  // vectorizes. The high half of low * d is formed from low's 32-bit halves, which vector
  // units multiply: the same value as start_in's 128-bit product (exact: d < P < 2**32, so
  // neither sum overflows; a test checks the identity up to d = P - 1, beyond what the
  // tests' arrays reach), which stays in blocks() because one scalar 64x64 multiply beats
  // three (the halves there made the backward up to 1.36x slower).
  inline void starts(uint64_t key, const Feature& f, int64_t w_offset, int64_t* __restrict__ out) const {
    const uint64_t h0 = first(key);
    const uint64_t magic = f.ref_magic, d = f.ref_d;
    const int64_t nblocks = f.nblocks;  // a local: the stores to out could alias f's fields
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      uint64_t h = h0 + steps[blk];
      h = h >= kPrime ? h - kPrime : h;
      const uint64_t low = magic * h;
      const uint64_t high = ((low >> 32) * d + (((low & 0xFFFFFFFFULL) * d) >> 32)) >> 32;
      out[blk] = w_offset + static_cast<int64_t>(high);
    }
  }
};

// base = fmix64(key + salt); h = fmix64(base + (b+1)*GOLDEN); start = ((h>>32)*span)>>32.
struct MixHash {
  uint64_t salt;
  static uint64_t start_in(uint64_t h, uint64_t span) { return ((h >> 32) * span) >> 32; }
  template <typename Fn>
  inline void blocks(uint64_t key, const Feature& f, Fn&& fn) const {
    uint64_t x = fmix64(key + salt);
    const uint64_t span = f.span;
    for (int64_t blk = 0; blk < f.nblocks; ++blk) {
      x += kGolden;
      fn(blk, start_in(fmix64(x), span));
    }
  }
  // out[b] = w_offset + the start of block b (the forward's hash pass). A value's blocks
  // hash independently of each other, so with nothing else in it this loop vectorizes.
  inline void starts(uint64_t key, const Feature& f, int64_t w_offset, int64_t* __restrict__ out) const {
    const uint64_t x = fmix64(key + salt);
    const uint64_t span = f.span;
    const int64_t nblocks = f.nblocks;  // a local: the stores to out could alias f's fields
    for (int64_t blk = 0; blk < nblocks; ++blk) {  // x + (blk + 1) * kGolden: blocks()'s x
      out[blk] = w_offset + static_cast<int64_t>(start_in(fmix64(x + static_cast<uint64_t>(blk + 1) * kGolden), span));
    }
  }
};

// ---------------------------------------------------------------------------------------
// table metadata
// ---------------------------------------------------------------------------------------

struct Layout {
  std::vector<Feature> feats;
  int64_t T = 0, B = 0, Z = 1;
  int64_t max_dim = 0, max_blocks = 0, sum_dim = 0;
};

// Parses table_meta and runs the meta-level checks of validation.check_inputs, in its order.
Layout parse_layout(const at::Tensor& table_meta, int64_t out_dim, int64_t Z, int64_t weights_numel,
                    int64_t hash_mode, int64_t offsets_numel) {
  if (table_meta.scalar_type() != at::kLong || table_meta.dim() != 2 ||
      table_meta.size(0) != NUM_META_FIELDS) {
    fail(cat("robe: table_meta must be int64 [", static_cast<int64_t>(NUM_META_FIELDS), ", T]"));
  }
  if (Z < 1) fail(cat("robe: block_size must be >= 1, got ", Z));
  if (hash_mode != HASH_REFERENCE && hash_mode != HASH_MIX) {
    fail(cat("robe: hash_mode must be 0 (reference) or 1 (mix), got ", hash_mode));
  }
  const at::Tensor meta = table_meta.to(at::kCPU).contiguous();
  const int64_t* m = meta.data_ptr<int64_t>();
  Layout L;
  L.T = meta.size(1);
  L.Z = Z;
  if (L.T == 0 || offsets_numel < 1 || (offsets_numel - 1) % L.T != 0) {
    fail(cat("robe: offsets has ", offsets_numel, " entries; expected T * B + 1 with T = ", L.T,
             " features"));
  }
  L.B = (offsets_numel - 1) / L.T;
  if (out_dim < 0) fail(cat("robe: output_dim must be >= 0, got ", out_dim));
  auto field = [&](int64_t f, int64_t t) { return m[f * L.T + t]; };
  // Every field but ROW_OFFSET (a wrapping key offset) is checked >= 0 first, so that the
  // bounds below can be compared as `a > limit - b` without any int64 overflow.
  for (int64_t t = 0; t < L.T; ++t) {
    for (int64_t f : {OUT_OFFSET, DIM, W_OFFSET, W_SIZE, ROW_OFFSET, NUM_ROWS}) {
      if (f != ROW_OFFSET && field(f, t) < 0) {
        fail(cat("robe: table_meta holds a negative entry (field ", f, ") for feature ", t));
      }
    }
    const int64_t pooling = field(POOLING, t);
    if (pooling != 0 && pooling != kPoolingMean) {
      fail(cat("robe: table_meta POOLING of feature ", t, " is ", pooling,
               "; expected 0 (sum) or 1 (mean)"));
    }
  }
  for (int64_t t = 0; t < L.T; ++t) {
    if (field(DIM, t) > out_dim - field(OUT_OFFSET, t)) {
      fail(cat("robe: output_dim ", out_dim, " is smaller than the features' dims"));
    }
  }
  for (int64_t t = 0; t < L.T; ++t) {
    if (field(W_SIZE, t) < Z || field(W_SIZE, t) > weights_numel - field(W_OFFSET, t)) {
      fail(cat("robe: every ROBE array must hold at least block_size=", Z,
               " floats and lie inside weights (", weights_numel, " floats)"));
    }
  }
  if (hash_mode == HASH_MIX) {
    for (int64_t t = 0; t < L.T; ++t) {
      if (field(W_SIZE, t) - Z + 1 >= (int64_t(1) << 32)) {
        fail("robe: the mix hash needs memory_size - block_size + 1 < 2**32");
      }
    }
  }
  L.feats.resize(L.T);
  for (int64_t t = 0; t < L.T; ++t) {
    Feature& f = L.feats[t];
    f.out_offset = field(OUT_OFFSET, t);
    f.dim = field(DIM, t);
    f.w_offset = field(W_OFFSET, t);
    f.w_size = field(W_SIZE, t);
    f.row_offset = field(ROW_OFFSET, t);
    f.num_rows = field(NUM_ROWS, t);
    f.mean = field(POOLING, t) == kPoolingMean;
    f.nblocks = f.dim / Z + (f.dim % Z != 0);  // ceil without overflowing near 2**63
    f.span = static_cast<uint64_t>(f.w_size - Z + 1);
    f.ref_d = std::min<uint64_t>(f.span, kPrime);
    f.ref_magic = std::numeric_limits<uint64_t>::max() / f.ref_d + 1;  // 0 for d == 1: fine
    L.max_dim = std::max(L.max_dim, f.dim);
    L.max_blocks = std::max(L.max_blocks, f.nblocks);
    L.sum_dim = f.dim > kI64Max - L.sum_dim ? kI64Max : L.sum_dim + f.dim;  // a work estimate only
  }
  return L;
}

// hashing.reference_key_limit: ((2**63 - 1 - C - max(nb - 1, 0) * B) // A) + 1 (floor division)
__int128 reference_key_limit(int64_t max_blocks, const std::vector<int64_t>& p) {
  const __int128 a = p[0], b = p[1], c = p[2];
  if (a == 0) fail("robe: reference hash parameter A must be non-zero");
  const __int128 n = static_cast<__int128>(kI64Max) - c - static_cast<__int128>(std::max<int64_t>(max_blocks - 1, 0)) * b;
  __int128 q = n / a;
  if (n % a != 0 && ((n < 0) != (a < 0))) q -= 1;
  return q + 1;
}

void check_hash_params(const std::vector<int64_t>& p) {
  if (p.size() != 3) fail(cat("robe: hash_params must hold 3 integers, got ", p.size()));
}

RefHash make_ref_hash(const std::vector<int64_t>& p) {
  RefHash h;
  h.a = static_cast<uint64_t>(p[0]);
  h.c = static_cast<uint64_t>(p[2]);
  int64_t bm = p[1] % static_cast<int64_t>(kPrime);
  if (bm < 0) bm += static_cast<int64_t>(kPrime);
  h.b_mod = static_cast<uint64_t>(bm);
  h.steps[0] = 0;
  for (int64_t blk = 1; blk < RefHash::kMaxStartsBlocks; ++blk) {
    const uint64_t next = h.steps[blk - 1] + h.b_mod;
    h.steps[blk] = next >= kPrime ? next - kPrime : next;
  }
  return h;
}

MixHash make_mix_hash(const std::vector<int64_t>& p) { return MixHash{static_cast<uint64_t>(p[0])}; }

template <typename F>
void dispatch_hash(int64_t hash_mode, const std::vector<int64_t>& params, F&& f) {
  if (hash_mode == HASH_REFERENCE) {
    f(make_ref_hash(params));
  } else {
    f(make_mix_hash(params));
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  if (!t.device().is_cpu()) fail(cat("robe: the C++ CPU kernel got ", name, " on ", t.device()));
}

// offsets[0] == 0 and offsets[-1] == N (the O(1) checks, done before any loop).
template <typename index_t>
void check_offset_ends(const index_t* offs, int64_t n_offs, int64_t N) {
  const int64_t first = offs[0], last = offs[n_offs - 1];
  if (first != 0) fail(cat("robe: offsets[0] must be 0, got ", first));
  if (last != N) {
    fail(cat("robe: offsets[-1] = ", last, " but values has ", N,
             " entries (lengths do not match values)"));
  }
}

template <typename index_t>
[[noreturn]] void fail_offsets_decrease(const index_t* offs, int64_t bag, int64_t B) {
  const int64_t b = std::max<int64_t>(B, 1);
  fail(cat("robe: offsets decrease at bag ", bag, " (feature ", bag / b, ", sample ", bag % b, "): ",
           static_cast<int64_t>(offs[bag]), " -> ", static_cast<int64_t>(offs[bag + 1])));
}

// All offset checks in one serial pass (used by the backward ops before they index values).
template <typename index_t>
void check_offsets_full(const index_t* offs, int64_t n_offs, int64_t N, int64_t B) {
  check_offset_ends(offs, n_offs, N);
  for (int64_t i = 0; i + 1 < n_offs; ++i) {
    if (offs[i + 1] < offs[i]) fail_offsets_decrease(offs, i, B);
  }
}

template <typename index_t>
int64_t feature_of_position(const index_t* offs, const Layout& L, int64_t pos) {
  for (int64_t t = 0; t < L.T; ++t) {
    if (pos < static_cast<int64_t>(offs[(t + 1) * L.B])) return t;
  }
  return L.T - 1;
}

template <typename index_t>
void raise_loop_errors(const LoopErrors& err, const index_t* offs, const index_t* vals,
                       const at::Tensor& psw, const Layout& L, int64_t bounds_check,
                       const std::string& limit_str) {
  if (err.offsets.any()) fail_offsets_decrease(offs, err.offsets.get(), L.B);
  if (err.psw.any()) {
    const int64_t pos = err.psw.get();
    const double v = psw.reshape(-1)[pos].item<double>();
    fail(cat("robe: per_sample_weights[", pos, "] is ", py_float_str(v), "; weights must be finite"));
  }
  if (err.ids.any()) {
    const int64_t pos = err.ids.get();
    const int64_t t = feature_of_position(offs, L, pos);
    const int64_t id = vals[pos];
    if (bounds_check == BOUNDS_ERROR) {
      fail(cat("robe: id ", id, " at position ", pos, " of feature ", t, " is out of range [0, ",
               L.feats[t].num_rows, ")", kRawIdsHint));
    }
    fail(cat("robe: id ", id, " at position ", pos, " of feature ", t,
             " cannot be hashed by the reference hash (keys must lie in [0, ", limit_str,
             "); use hash='mix' for arbitrary 64-bit ids)"));
  }
}

at::ScalarType acc_type_of(at::ScalarType w) { return w == at::kDouble ? at::kDouble : at::kFloat; }

// ---------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------

enum IdCheck { CHECK_RANGE = 0, CHECK_REF_LIMIT = 1, CHECK_NONE = 2 };

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
// its branches on every block (the forward's gather was 2x its hashing at dim 16, Z = 8).
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

// Copies a finished output row out of the thread's row buffer. Large outputs use
// non-temporal stores: they do not fit in cache anyway, and streaming them skips the read
// for ownership that a plain store of a cold line costs (half of the output traffic). Where
// the CPU has 512-bit stores, one writes a whole line: at one thread the forward took
// 0.88-0.95x its time with 256-bit ones on the pair model and 0.80-0.82x with rows of 312
// floats, bitwise equal, and the same at two threads (results/probes/kernel_ab_forward_stream512*.md).
#if defined(__AVX512F__)
constexpr int64_t kStreamBytesPerStore = 64;  // one 512-bit store: a whole cache line
inline void stream_vector(float* dst, const float* src) { _mm512_stream_ps(dst, _mm512_loadu_ps(src)); }
inline void stream_vector(double* dst, const double* src) { _mm512_stream_pd(dst, _mm512_loadu_pd(src)); }
#elif defined(__AVX__)
constexpr int64_t kStreamBytesPerStore = 32;
inline void stream_vector(float* dst, const float* src) { _mm256_stream_ps(dst, _mm256_loadu_ps(src)); }
inline void stream_vector(double* dst, const double* src) { _mm256_stream_pd(dst, _mm256_loadu_pd(src)); }
#endif

template <typename scalar_t, typename acc_t>
inline void store_row(scalar_t* __restrict__ dst, const acc_t* __restrict__ src, int64_t n, bool stream) {
#ifdef __AVX__
  if constexpr (std::is_same_v<scalar_t, acc_t> &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
    if (stream) {
      constexpr int64_t kWidth = kStreamBytesPerStore / sizeof(scalar_t);  // one vector
      int64_t j = 0;
      for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & (kStreamBytesPerStore - 1)) != 0; ++j) dst[j] = src[j];
      for (; j + kWidth <= n; j += kWidth) stream_vector(dst + j, src + j);
      for (; j < n; ++j) dst[j] = src[j];
      return;
    }
  }
#endif
  (void)stream;
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
}

inline void store_fence() {
#ifdef __AVX__
  _mm_sfence();
#endif
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
// A core's L2 cache as this CPU reports it (512 KiB where it does not), read once when the
// library loads: a function-local static in its place, its guard checked on every forward,
// made the bags-of-20-ids forward 1.16-1.17x slower in two A/B runs. The forward prefetches
// its blocks from arrays larger than this: the gathers from a smaller one hit the caches
// anyway, and prefetching them cost up to 20% of the forward on 512 KiB arrays
// (results/probes/kernel_ab_forward_prefetch_limit.md) and 7-9% on a 1 MiB one in a 1 MiB L2
// (results/probes/kernel_ab_forward_prefetch_l2.md).
int64_t reported_l2_bytes() {
  const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return reported > 0 ? static_cast<int64_t>(reported) : int64_t(512) << 10;
}
const int64_t kL2Bytes = reported_l2_bytes();

// Whether the forward prefetches the blocks it gathers from an array of weights_bytes
// (also exported, for the tests).
inline bool forward_prefetches(int64_t weights_bytes) { return weights_bytes > kL2Bytes; }

// Arrays beyond this go through the backward scatter's window (see ScatterWindow; measured with
// this limit, results/probes/kernel_ab_direct_window.md).
constexpr int64_t kScatterWindowMinBytes = int64_t(512) << 10;
// Outputs at least this large are written with non-temporal stores.
constexpr int64_t kStreamBytes = int64_t(1) << 21;

// What forward_kernel does: the forward, or one of its profiling aids (the benchmark times
// them against the forward to split its time: hashing, gathering, storing).
enum class ForwardMode {
  FULL,        // hash, gather, pool, store the output
  HASH_ONLY,   // pass 1 alone (loops, checks, hashes, the tile's buffers), no prefetches,
               // no gathers, no output
  GATHER_ONLY  // all of FULL but the output stores: each pooled row is added to one of its
               // chunk's kGatherSinks cache-resident [out_dim] sums, in turn; returns them
               // all added up
};

// GATHER_ONLY's sums per chunk. With one, each row's add waited on the previous row's (a
// chain through memory the forward does not have): the aid took 1.1-1.2x the whole forward's
// time on the pair model. Rows added in turn to 8 sums are independent again.
constexpr int64_t kGatherSinks = 8;

// One tile's hashed lookups, pass 1's output and pass 2's input: the next tile is hashed
// (and its weights prefetched) before this one is gathered, so every prefetch has a whole
// tile of work to land.
template <typename acc_t>
struct TileBuf {
  std::vector<int64_t> starts;  // flat weight index of each valid (value, block)
  std::vector<acc_t> scales;    // scale of each valid value
  std::vector<int64_t> counts;  // valid values of each bag (sample-major)
};

// Room for `more` entries after the cursor `at` of v (grown by doubling); returns the cursor,
// which growing moves.
template <typename T>
inline T* room_for(std::vector<T>& v, T* at, int64_t more) {
  const size_t used = static_cast<size_t>(at - v.data());
  if (used + static_cast<size_t>(more) > v.size()) {
    v.resize(std::max(2 * v.size(), used + static_cast<size_t>(more)));
  }
  return v.data() + used;
}

// Pass 1 of the forward for samples [b0, b1): checks each value (recording the first bad
// one in err), computes its scale, hashes its blocks and, if `prefetch`, prefetches them,
// into buf (in HASH_ONLY mode too, as the forward does, then returns the sum of the tile's
// block starts: a running sum per block would be a dependency chain the forward does not
// have). kStarts: a value's starts in one loop (Hash::starts), then their prefetches. A
// function of its own with its cursors in locals: as pool_tile, not a lambda's captured
// references.
template <typename scalar_t, typename acc_t, typename index_t, typename Hash, ForwardMode kMode,
          bool kStarts>
uint64_t hash_values(const scalar_t* __restrict__ w, const index_t* __restrict__ vals,
                     const index_t* __restrict__ offs, const acc_t* __restrict__ psw, int64_t b0, int64_t b1,
                     const Layout& L, const Hash& hash, int64_t N, IdCheck id_check, int64_t max_key,
                     bool prefetch, LoopErrors& err, TileBuf<acc_t>& buf) {
  const int64_t B = L.B, T = L.T, Z = L.Z;
  uint64_t sum = 0;
  int64_t* st = buf.starts.data();
  acc_t* sc = buf.scales.data();
  int64_t* cn = buf.counts.data();
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const Feature& f = L.feats[t];
      const int64_t bag = t * B + b;
      const int64_t s = offs[bag], e = offs[bag + 1];
      int64_t valid = 0;
      if (e < s) {
        err.offsets.record(bag);
      } else if (s >= 0 && e <= N) {  // else: offsets decrease elsewhere, reported there
        const acc_t len = static_cast<acc_t>(e - s);
        const scalar_t* wf = w + f.w_offset;
        st = room_for(buf.starts, st, (e - s) * f.nblocks);
        sc = room_for(buf.scales, sc, e - s);
        for (int64_t p = s; p < e; ++p) {
          const int64_t id = static_cast<int64_t>(vals[p]);
          const uint64_t key = f.key(id);
          if (id_check == CHECK_RANGE) {
            if (id < 0 || id >= f.num_rows) {
              err.ids.record(p);
              continue;
            }
          } else if (id_check == CHECK_REF_LIMIT) {
            if (id < 0 || static_cast<int64_t>(key) > max_key) {
              err.ids.record(p);
              continue;
            }
          }
          acc_t scale = acc_t(1);
          if (psw != nullptr) {
            scale = psw[p];
            if (!std::isfinite(scale)) {
              err.psw.record(p);
              continue;
            }
          }
          if (f.mean) scale = scale / len;
          ++valid;
          *sc++ = scale;
          if constexpr (kStarts) {
            // the starts first, the prefetches after: a loop of hashes and stores alone
            // vectorizes (see forward_kernel)
            hash.starts(key, f, f.w_offset, st);
            if (prefetch) {
              for (int64_t blk = 0; blk < f.nblocks; ++blk) prefetch_block(w + st[blk], std::min(Z, f.dim - blk * Z));
            }
            st += f.nblocks;
          } else {
            hash.blocks(key, f, [&](int64_t blk, uint64_t start) {
              if (prefetch) prefetch_block(wf + start, std::min(Z, f.dim - blk * Z));
              *st++ = f.w_offset + static_cast<int64_t>(start);
            });
          }
        }
      }
      *cn++ = valid;
    }
  }
  if constexpr (kMode == ForwardMode::HASH_ONLY) {
    for (const int64_t* p = buf.starts.data(); p < st; ++p) sum += static_cast<uint64_t>(*p);
  }
  return sum;
}

// Pass 2 of the forward for samples [b0, b1): pools each row in `row` from its hashed block
// starts (st), value scales (sc) and valid-value counts (cn), then stores it to out (in
// GATHER_ONLY mode: adds it to sum b % kGatherSinks of those after the row). A function of
// its own with restrict pointers: inside forward_kernel's lambda the compiler kept the
// cursors on the stack and reloaded them around every block.
template <typename scalar_t, typename acc_t, ForwardMode kMode>
void pool_tile(const scalar_t* __restrict__ w, const int64_t* __restrict__ st, const acc_t* __restrict__ sc,
               const int64_t* __restrict__ cn, int64_t b0, int64_t b1, const Layout& L, acc_t* __restrict__ row,
               acc_t* __restrict__ out, int64_t out_dim, bool stream) {
  const int64_t T = L.T, Z = L.Z;
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(row, row + out_dim, acc_t(0));
    for (int64_t t = 0; t < T; ++t) {
      const Feature& f = L.feats[t];
      const int64_t D = f.dim, nb = f.nblocks;
      acc_t* __restrict__ acc = row + f.out_offset;
      const int64_t valid = *cn++;
      with_block_length<std::is_same_v<scalar_t, float>>(Z, D % Z == 0, [&](auto z_tag) {
        constexpr int64_t kZ = decltype(z_tag)::value;
        for (int64_t i = 0; i < valid; ++i) {
          const acc_t scale = *sc++;
          for (int64_t blk = 0; blk < nb; ++blk) {
            if constexpr (kZ > 0) {
              add_scaled_fixed<kZ>(acc + blk * kZ, w + *st++, scale);
            } else {
              add_scaled(acc + blk * Z, w + *st++, std::min(Z, D - blk * Z), scale);
            }
          }
        }
      });
    }
    if constexpr (kMode == ForwardMode::GATHER_ONLY) {
      acc_t* __restrict__ sink = row + out_dim * (1 + b % kGatherSinks);
#pragma omp simd
      for (int64_t j = 0; j < out_dim; ++j) sink[j] += row[j];
    } else {
      store_row(out + b * out_dim, row, out_dim, stream);
    }
  }
}

template <typename scalar_t, typename acc_t, typename index_t, typename Hash, ForwardMode kMode>
uint64_t forward_kernel(const scalar_t* __restrict__ w, const index_t* __restrict__ vals,
                        const index_t* __restrict__ offs, const acc_t* __restrict__ psw,
                        acc_t* __restrict__ out, int64_t out_dim, const Layout& L, const Hash& hash,
                        int64_t N, int64_t weights_numel, IdCheck id_check, int64_t max_key, LoopErrors& err) {
  const int64_t B = L.B, T = L.T;
  // work per sample ~ its multiply-adds; at least ~32k of them per task
  const int64_t avg_dim = std::max<int64_t>(L.sum_dim / std::max<int64_t>(T, 1), 1);
  const int64_t work_per_sample = std::max<int64_t>(1, N * avg_dim / std::max<int64_t>(B, 1) + T * 4);
  const int64_t grain = std::max<int64_t>(1, 32768 / work_per_sample);
  const int64_t entries_per_sample = std::max<int64_t>(1, N * std::max<int64_t>(L.max_blocks, 1) / std::max<int64_t>(B, 1));
  const int64_t tile = std::clamp<int64_t>(kTileEntries / entries_per_sample, 1, 256);
  const bool stream = B * out_dim * static_cast<int64_t>(sizeof(acc_t)) >= kStreamBytes;
  const bool prefetch = kMode != ForwardMode::HASH_ONLY &&
                        forward_prefetches(weights_numel * static_cast<int64_t>(sizeof(scalar_t)));
  // A value's blocks can hash independently of each other (Hash::starts): when every feature
  // has more than two, the hash pass writes a value's starts in one loop that vectorizes,
  // then prefetches them. Mix hash: 0.57x the forward's time on bags of 20 ids at Z = 4,
  // 0.88x on the pair model at Z = 8 (results/probes/kernel_ab_forward_mix_starts.md); reference
  // hash, up to 64 blocks: 0.77-0.79x and 0.82-0.85x (results/probes/kernel_ab_forward_ref_starts*.md).
  // With two blocks or fewer the mix hash was slower that way, so there the pass hashes,
  // prefetches and stores block by block (the reference hash follows the same rule).
  bool starts_first = std::all_of(L.feats.begin(), L.feats.end(), [](const Feature& f) { return f.nblocks > 2; });
  if constexpr (std::is_same_v<Hash, RefHash>) {
    starts_first = starts_first && L.max_blocks <= RefHash::kMaxStartsBlocks;
  }
  std::atomic<uint64_t> checksum{0};
  parallel_for_dynamic(B, dynamic_chunk(B, grain), [&](int64_t b0, int64_t b1) {
    // GATHER_ONLY: the kGatherSinks sums of out_dim elements after the row add up this
    // chunk's pooled rows, in place of their stores. (The aid names no new local in the
    // lambdas: a lambda captures what a discarded `if constexpr` branch names too, and that
    // changed FULL's machine code.)
    std::vector<acc_t> row_buf(static_cast<size_t>(std::max<int64_t>(out_dim, 1)) *
                               (kMode == ForwardMode::GATHER_ONLY ? 1 + kGatherSinks : 1));
    acc_t* __restrict__ row = row_buf.data();
    TileBuf<acc_t> bufs[2];
    for (TileBuf<acc_t>& tb : bufs) tb.counts.resize(static_cast<size_t>(tile * T));
    uint64_t local_sum = 0;

    // pass 1 of samples [tb0, tb1)
    auto hash_tile = [&](int64_t tb0, int64_t tb1, TileBuf<acc_t>& buf) {
      if (starts_first) {
        local_sum += hash_values<scalar_t, acc_t, index_t, Hash, kMode, true>(
            w, vals, offs, psw, tb0, tb1, L, hash, N, id_check, max_key, prefetch, err, buf);
        return;
      }
      local_sum += hash_values<scalar_t, acc_t, index_t, Hash, kMode, false>(
          w, vals, offs, psw, tb0, tb1, L, hash, N, id_check, max_key, prefetch, err, buf);
    };

    // pass 2 of samples [tb0, tb1)
    auto gather_tile = [&](int64_t tb0, int64_t tb1, const TileBuf<acc_t>& buf) {
      pool_tile<scalar_t, acc_t, kMode>(w, buf.starts.data(), buf.scales.data(), buf.counts.data(), tb0, tb1, L,
                                        row, out, out_dim, stream);
    };

    if constexpr (kMode == ForwardMode::HASH_ONLY) {
      for (int64_t tb0 = b0; tb0 < b1; tb0 += tile) hash_tile(tb0, std::min(b1, tb0 + tile), bufs[0]);
      checksum.fetch_add(local_sum, std::memory_order_relaxed);
    } else {
      int cur = 0;
      if (b0 < b1) hash_tile(b0, std::min(b1, b0 + tile), bufs[cur]);
      for (int64_t tb0 = b0; tb0 < b1; tb0 += tile) {
        const int64_t tb1 = std::min(b1, tb0 + tile);
        if (tb1 < b1) hash_tile(tb1, std::min(b1, tb1 + tile), bufs[cur ^ 1]);
        gather_tile(tb0, tb1, bufs[cur]);
        cur ^= 1;
      }
      if constexpr (kMode == ForwardMode::GATHER_ONLY) {
        static std::atomic_flag merging = ATOMIC_FLAG_INIT;  // the chunks add into out in turn
        while (merging.test_and_set(std::memory_order_acquire)) {
        }
        for (int64_t k = 1; k <= kGatherSinks; ++k) {
          for (int64_t j = 0; j < out_dim; ++j) out[j] += row[k * out_dim + j];
        }
        merging.clear(std::memory_order_release);
      } else {
        store_fence();
      }
    }
  });
  return checksum.load();
}

template <ForwardMode kMode>
at::Tensor forward_impl(const at::Tensor& weights_in, const at::Tensor& values_in,
                        const at::Tensor& offsets_in, const std::optional<at::Tensor>& psw_in,
                        const at::Tensor& table_meta, int64_t output_dim, int64_t block_size,
                        int64_t hash_mode, const std::vector<int64_t>& hash_params,
                        int64_t bounds_check) {
  check_cpu(weights_in, "weights");
  check_cpu(values_in, "values");
  check_cpu(offsets_in, "offsets");
  check_hash_params(hash_params);
  if (values_in.scalar_type() != offsets_in.scalar_type()) {
    fail(cat("robe: offsets dtype ", offsets_in.scalar_type(), " must equal values dtype ", values_in.scalar_type()));
  }
  const at::Tensor weights = weights_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t N = values.numel();
  if (bounds_check != BOUNDS_ERROR && bounds_check != BOUNDS_UNBOUNDED) {
    fail(cat("robe: bounds_check must be 0 (error) or 1 (unbounded), got ", bounds_check));
  }
  const Layout L = parse_layout(table_meta, output_dim, block_size, weights.numel(), hash_mode, offsets.numel());
  const at::ScalarType acc_st = acc_type_of(weights.scalar_type());
  if (kMode == ForwardMode::FULL && L.B > 0 && output_dim > kI64Max / 8 / L.B) {
    fail(cat("robe: the output of ", L.B, " samples x output_dim ", output_dim,
             " elements is too large to allocate"));
  }
  at::Tensor psw;
  if (psw_in.has_value() && psw_in->defined()) {
    check_cpu(*psw_in, "per_sample_weights");
    if (psw_in->numel() != N) {
      fail(cat("robe: per_sample_weights has ", psw_in->numel(), " entries but values has ", N));
    }
    psw = psw_in->to(acc_st).contiguous();
  }
  IdCheck id_check = CHECK_NONE;
  int64_t max_key = kI64Max;
  std::string limit_str;
  if (bounds_check == BOUNDS_ERROR) {
    id_check = CHECK_RANGE;
  } else if (hash_mode == HASH_REFERENCE) {
    id_check = CHECK_REF_LIMIT;
    const __int128 limit = reference_key_limit(L.max_blocks, hash_params);
    limit_str = i128_str(limit);
    const __int128 mk = limit - 1, lo = std::numeric_limits<int64_t>::min();
    max_key = static_cast<int64_t>(mk > kI64Max ? kI64Max : (mk < lo ? lo : mk));
  }
  at::Tensor out;
  if constexpr (kMode == ForwardMode::HASH_ONLY) {
    out = at::zeros({}, values.options().dtype(at::kLong));
  } else if constexpr (kMode == ForwardMode::GATHER_ONLY) {
    out = at::zeros({output_dim}, weights.options().dtype(acc_st));
  } else {
    out = at::empty({L.B, output_dim}, weights.options().dtype(acc_st));
  }
  LoopErrors err;
  uint64_t checksum = 0;
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "robe_forward_index", [&] {
    const index_t* offs = offsets.data_ptr<index_t>();
    check_offset_ends(offs, offsets.numel(), N);
    const index_t* vals = values.data_ptr<index_t>();
    auto run = [&](auto scalar_tag) {
      using scalar_t = decltype(scalar_tag);
      using acc_t = at::opmath_type<scalar_t>;
      const acc_t* pswp = psw.defined() ? psw.data_ptr<acc_t>() : nullptr;
      // pooled in acc_t and returned in it: low-precision weights give float32 output (as
      // FBGEMM's TBE with output_dtype FP32), no second rounding of the sums
      acc_t* outp = kMode == ForwardMode::HASH_ONLY ? nullptr : out.data_ptr<acc_t>();
      dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
        using Hash = std::decay_t<decltype(hash)>;
        checksum = forward_kernel<scalar_t, acc_t, index_t, Hash, kMode>(
            weights.data_ptr<scalar_t>(), vals, offs, pswp, outp, output_dim, L, hash, N, weights.numel(),
            id_check, max_key, err);
      });
    };
    if constexpr (kMode != ForwardMode::FULL) {  // the benchmark aids only need one weight type
      if (weights.scalar_type() != at::kFloat) {
        fail(kMode == ForwardMode::HASH_ONLY ? "robe: forward_hash_only takes float32 weights"
                                             : "robe: forward_gather_only takes float32 weights");
      }
      run(float{});
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "robe_forward",
                                      [&] { run(scalar_t{}); });
    }
    raise_loop_errors(err, offs, vals, psw, L, bounds_check, limit_str);
  });
  if constexpr (kMode == ForwardMode::HASH_ONLY) out.fill_(static_cast<int64_t>(checksum));
  return out;
}

at::Tensor forward(const at::Tensor& weights, const at::Tensor& values, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& psw, const at::Tensor& table_meta, int64_t output_dim,
                   int64_t block_size, int64_t hash_mode, const std::vector<int64_t>& hash_params,
                   int64_t bounds_check) {
  return forward_impl<ForwardMode::FULL>(weights, values, offsets, psw, table_meta, output_dim,
                                         block_size, hash_mode, hash_params, bounds_check);
}

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

// ---------------------------------------------------------------------------------------
// backward: the scatter plan shared by backward_dense and backward_fused_
//
// Phase 1 (parallel over fixed chunks of values) hashes every (value, block) once into a
//   record {dst, src, scale, len} and counts, per chunk, the records that touch each
//   destination range of the flat weights (ranges of RS = 2**k floats, cache sized).
// Phase 1b (parallel over chunks) scatters the records into per-range buckets, in chunk
//   order, so each bucket lists its records in value order (a block straddling two ranges
//   goes to both).
// Phase 2 (caller, parallel over ranges) adds each bucket into its own range only: no races,
//   and each weight's sum runs in value order whatever the thread count (deterministic).
// ---------------------------------------------------------------------------------------

template <typename acc_t>
struct Rec {
  int64_t dst;  // first flat weight index of the block
  int64_t src;  // first grad_output element of the block
  acc_t scale;  // per-sample weight / bag length (MEAN)
  int32_t len;  // elements in the block (the last block of a row may be partial)
};

// Scratch memory reused across calls by the calling thread: fresh multi-megabyte buffers
// would be page-faulted in (and zeroed by the kernel) on every call.
struct Scratch {
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  static constexpr size_t kKeepBytes = size_t(256) << 20;  // larger buffers are not kept
  template <typename T>
  T* get(size_t n) {
    static_assert(std::is_trivially_destructible_v<T>);
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    if (bytes > capacity || (capacity > kKeepBytes && bytes <= kKeepBytes)) {
      data.reset();
      data.reset(new char[bytes]);  // new[] of char: aligned for any fundamental type
      capacity = bytes;
    }
    return reinterpret_cast<T*>(data.get());
  }
  void trim() {
    if (capacity > kKeepBytes) {
      data.reset();
      capacity = 0;
    }
  }
};
thread_local Scratch t_records, t_sorted, t_direct;  // t_direct: the direct scatter's gradient

template <typename acc_t>
struct Plan {
  Rec<acc_t>* sorted = nullptr;  // t_sorted's memory (valid until the next plan)
  std::vector<int64_t> bucket_begin;  // R + 1
  int64_t R = 0, log2_rs = 0, rs = 0;
};

template <typename acc_t, typename index_t, typename Hash>
Plan<acc_t> build_plan(const index_t* offs, const index_t* vals, const acc_t* psw, const Layout& L,
                       const Hash& hash, int64_t N, int64_t weights_numel, int64_t ldg) {
  const int64_t B = L.B, T = L.T, Z = L.Z;
  Plan<acc_t> plan;
  // destination ranges: power of two >= max(16384, Z, numel / 4096)
  int64_t rs_min = std::max<int64_t>({16384, Z, (weights_numel + 4095) / 4096});
  int64_t lg = 0;
  while ((int64_t(1) << lg) < rs_min) ++lg;
  plan.log2_rs = lg;
  plan.rs = int64_t(1) << lg;
  plan.R = std::max<int64_t>(1, (weights_numel + plan.rs - 1) / plan.rs);
  const int64_t R = plan.R;

  // entry (record) index of the first value of each feature
  std::vector<int64_t> vbeg(T), ebeg(T + 1);
  ebeg[0] = 0;
  for (int64_t t = 0; t < T; ++t) {
    vbeg[t] = offs[t * B];
    ebeg[t + 1] = ebeg[t] + (static_cast<int64_t>(offs[(t + 1) * B]) - vbeg[t]) * L.feats[t].nblocks;
  }
  const int64_t E = ebeg[T];
  // fixed chunks (independent of the thread count: results do not depend on it)
  int64_t C = std::min<int64_t>({64, std::max<int64_t>(1, (N + 2047) / 2048),
                                 std::max<int64_t>(1, (int64_t(1) << 20) / R)});
  if (N == 0) C = 0;
  const int64_t vpc = C > 0 ? (N + C - 1) / C : 0;
  std::vector<int64_t> hist(static_cast<size_t>(C * R), 0), chunk_e0(C + 1, E);
  Rec<acc_t>* recs = t_records.get<Rec<acc_t>>(static_cast<size_t>(E));

  auto entry_of = [&](int64_t p, int64_t bag) {
    const int64_t t = bag / B;
    return ebeg[t] + (p - vbeg[t]) * L.feats[t].nblocks;
  };
  auto bag_of = [&](int64_t p) {  // bag holding value p (offsets validated, p < N)
    return static_cast<int64_t>(std::upper_bound(offs, offs + T * B + 1, static_cast<index_t>(p)) - offs) - 1;
  };

  parallel_for_dynamic(C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p0 = c * vpc, p1 = std::min(N, p0 + vpc);
      if (p0 >= p1) {
        chunk_e0[c] = -1;  // empty chunk: fixed below
        continue;
      }
      int64_t* h = hist.data() + c * R;
      int64_t bag = bag_of(p0);
      int64_t e = entry_of(p0, bag);
      chunk_e0[c] = e;
      int64_t bag_end = offs[bag + 1];
      const Feature* f = &L.feats[bag / B];
      int64_t sample = bag % B;
      acc_t len = acc_t(1);
      auto set_bag = [&]() {
        f = &L.feats[bag / B];
        sample = bag % B;
        len = static_cast<acc_t>(static_cast<int64_t>(offs[bag + 1]) - static_cast<int64_t>(offs[bag]));
      };
      set_bag();
      for (int64_t p = p0; p < p1; ++p) {
        if (p >= bag_end) {
          do {
            ++bag;
            bag_end = offs[bag + 1];
          } while (bag_end <= p);
          set_bag();
        }
        const acc_t scale = value_scale(psw, p, *f, len);
        const uint64_t key = f->key(static_cast<int64_t>(vals[p]));
        const int64_t src0 = sample * ldg + f->out_offset;
        const int64_t D = f->dim, w0 = f->w_offset;
        hash.blocks(key, *f, [&](int64_t blk, uint64_t start) {
          Rec<acc_t>& r = recs[e++];
          r.dst = w0 + static_cast<int64_t>(start);
          r.src = src0 + blk * Z;
          r.scale = scale;
          r.len = static_cast<int32_t>(std::min(Z, D - blk * Z));
          const int64_t ra = r.dst >> lg, rb = (r.dst + r.len - 1) >> lg;
          for (int64_t q = ra; q <= rb; ++q) ++h[q];
        });
      }
    }
  });
  // chunks with no values start where the next one does
  chunk_e0[C] = E;
  for (int64_t c = C - 1; c >= 0; --c) {
    if (chunk_e0[c] < 0) chunk_e0[c] = chunk_e0[c + 1];
  }

  // prefix sums: bucket r holds chunk 0's records, then chunk 1's, ...
  plan.bucket_begin.assign(R + 1, 0);
  std::vector<int64_t> cursor(static_cast<size_t>(C * R));
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    plan.bucket_begin[r] = total;
    for (int64_t c = 0; c < C; ++c) {
      cursor[c * R + r] = total;
      total += hist[c * R + r];
    }
  }
  plan.bucket_begin[R] = total;
  plan.sorted = t_sorted.get<Rec<acc_t>>(static_cast<size_t>(total));
  parallel_for_dynamic(C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = cursor.data() + c * R;
      for (int64_t i = chunk_e0[c]; i < chunk_e0[c + 1]; ++i) {
        const Rec<acc_t>& r = recs[i];
        const int64_t ra = r.dst >> lg, rb = (r.dst + r.len - 1) >> lg;
        for (int64_t q = ra; q <= rb; ++q) plan.sorted[cur[q]++] = r;
      }
    }
  });
  t_records.trim();
  return plan;
}

// Adds bucket r of the plan into buf (which holds the weights [lo, hi)).
template <typename acc_t>
inline void accumulate_bucket(const Plan<acc_t>& plan, int64_t r, int64_t lo, int64_t hi,
                              const acc_t* __restrict__ go, acc_t* __restrict__ buf) {
  constexpr int64_t kAhead = 16;  // records whose grad_output rows are prefetched ahead
  const Rec<acc_t>* recs = plan.sorted;
  const int64_t i0 = plan.bucket_begin[r], i1 = plan.bucket_begin[r + 1];
  for (int64_t i = i0; i < std::min(i1, i0 + kAhead); ++i) prefetch_block(go + recs[i].src, recs[i].len);
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kAhead < i1) prefetch_block(go + recs[i + kAhead].src, recs[i + kAhead].len);
    const Rec<acc_t>& rec = recs[i];
    const int64_t a = std::max(rec.dst, lo), b = std::min(rec.dst + rec.len, hi);
    const acc_t* __restrict__ g = go + rec.src + (a - rec.dst);
    acc_t* __restrict__ o = buf + (a - lo);
    const acc_t s = rec.scale;
    add_scaled(o, g, b - a, s);
  }
}

struct BackwardInputs {
  at::Tensor grad_output, values, offsets, psw;
  Layout L;
  int64_t N = 0;
  int64_t ldg = 0;  // grad_output's row stride (its columns are contiguous)
};

BackwardInputs prepare_backward(const at::Tensor& grad_output, const at::Tensor& weights,
                                const at::Tensor& values, const at::Tensor& offsets,
                                const std::optional<at::Tensor>& psw_in, const at::Tensor& table_meta,
                                int64_t block_size, int64_t hash_mode,
                                const std::vector<int64_t>& hash_params, at::ScalarType acc_st) {
  check_cpu(grad_output, "grad_output");
  check_cpu(weights, "weights");
  check_cpu(values, "values");
  check_cpu(offsets, "offsets");
  check_hash_params(hash_params);
  if (values.scalar_type() != offsets.scalar_type()) {
    fail(cat("robe: offsets dtype ", offsets.scalar_type(), " must equal values dtype ", values.scalar_type()));
  }
  if (grad_output.dim() != 2) fail(cat("robe: grad_output must be 2-D [B, output_dim], got ", grad_output.dim(), " dims"));
  BackwardInputs in;
  in.L = parse_layout(table_meta, grad_output.size(1), block_size, weights.numel(), hash_mode, offsets.numel());
  if (grad_output.size(0) != in.L.B) {
    fail(cat("robe: grad_output has ", grad_output.size(0), " rows but the offsets describe ", in.L.B, " samples"));
  }
  // Rows may have any stride, 0 included: the gradient of sum(output) is one row broadcast to
  // all B, and copying it out would cost more than the whole scatter (16 MiB for the pair model).
  in.grad_output = grad_output.to(acc_st);
  if (in.grad_output.size(1) > 1 && in.grad_output.stride(1) != 1) {
    in.grad_output = in.grad_output.stride(0) == 0 && in.grad_output.size(0) > 0  // a broadcast scalar: one row
                         ? in.grad_output.narrow(0, 0, 1).contiguous().expand(in.grad_output.sizes())
                         : in.grad_output.contiguous();
  }
  in.ldg = in.grad_output.stride(0);
  in.values = values.contiguous();
  in.offsets = offsets.contiguous();
  in.N = in.values.numel();
  if (psw_in.has_value() && psw_in->defined()) {
    check_cpu(*psw_in, "per_sample_weights");
    if (psw_in->numel() != in.N) {
      fail(cat("robe: per_sample_weights has ", psw_in->numel(), " entries but values has ", in.N));
    }
    in.psw = psw_in->to(acc_st).contiguous();
  }
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_check_offsets", [&] {
    check_offsets_full(in.offsets.data_ptr<index_t>(), in.offsets.numel(), in.N, in.L.B);
  });
  return in;
}

// Runs fn(plan) with the plan of the inputs, dispatched on acc_t (float/double) and index_t.
template <typename acc_t, typename Fn>
void with_plan(const BackwardInputs& in, int64_t weights_numel, int64_t hash_mode,
               const std::vector<int64_t>& hash_params, Fn&& fn) {
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_backward_plan", [&] {
    const acc_t* pswp = in.psw.defined() ? in.psw.data_ptr<acc_t>() : nullptr;
    dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
      Plan<acc_t> plan = build_plan<acc_t>(in.offsets.data_ptr<index_t>(), in.values.data_ptr<index_t>(),
                                           pswp, in.L, hash, in.N, weights_numel, in.ldg);
      fn(plan);
      t_sorted.trim();
    });
  });
}

// The scatter without a plan, on one thread: every (value, block) is added straight into buf
// (the gradient of the whole flat weights) in value order and block order, the order in which
// the plan's buckets add them, so each sum is bitwise the plan's (a test compares 1 and 2
// threads with 3). It skips writing, counting and sorting the records. Arrays beyond 512 KiB (and
// grad_output rows beyond a page, see direct_scatter_windowed) go through a ScatterWindow: a
// block's destination and gradient lines are prefetched a window of blocks before it is
// added, so its misses overlap the others' instead of each stalling the loop.
// Measured on a 32 MiB-L3 EPYC at one thread (results/probes/kernel_ab_direct_window.md), the
// windowed scatter takes 0.4-0.8x the plan's time up to 10.5 MB arrays, and the fused steps
// lose from 16 MB on (the direct path zeroes and steps a whole-array gradient out of cache).
constexpr int64_t kDirectMaxBytes = int64_t(12) << 20;
constexpr int64_t kPageBytes = 4096;

// At 2 threads, the direct scatter up to this size (one thread zeroes and scatters, both
// share the fused optimizer step). The plan writes, buckets and reads back a record of every block,
// and there those passes cost more than the second thread saves: on a 2-core EPYC the direct
// scatter took 0.24-0.91x the plan's time on arrays up to 2.2 MB
// (results/probes/kernel_ab_direct_at_2_threads.md); taken further, 0.93-1.05x at 4-8 MB and its
// fused step 1.12-1.15x at 10.5 MB (..._12mib.md, ..._sizes.md). From 3 threads on: the plan.
constexpr int64_t kDirectMaxBytesTwoThreads = int64_t(4) << 20;

// Whether the backward ops take the direct scatter for an array of weights_numel elements of
// acc_bytes bytes each, at the current thread count (also exported, for the tests).
bool use_direct_scatter(int64_t weights_numel, int64_t acc_bytes) {
  const int64_t bytes = weights_numel * acc_bytes;
  if (at::get_num_threads() == 1 || at::in_parallel_region()) return bytes <= kDirectMaxBytes;
  return at::get_num_threads() == 2 && bytes <= kDirectMaxBytesTwoThreads;
}

// fn(lo, hi) over [0, n) in ranges on the pool's threads, for an elementwise pass: its result
// does not depend on how [0, n) is split.
template <typename F>
void elementwise_ranges(int64_t n, const F& fn) {
  parallel_for_dynamic(n, dynamic_chunk(n, int64_t(1) << 16), fn);
}

// Whether the direct scatter goes through a ScatterWindow (also exported, for the tests): for
// an array beyond kScatterWindowMinBytes, or for grad_output rows longer than a page. A
// feature's slices of successive rows then lie on different pages, where the hardware's
// stride prefetcher does not follow, and the window's prefetches fetch them instead.
bool direct_scatter_windowed(int64_t weights_numel, int64_t acc_bytes, int64_t row_bytes) {
  return weights_numel * acc_bytes > kScatterWindowMinBytes || row_bytes > kPageBytes;
}

// The blocks waiting to be added, in order: a block is added once kScatterWindow more have
// been hashed (and prefetched) after it. kZ > 0: every block holds kZ elements.
template <typename acc_t, int64_t kZ>
class ScatterWindow {
 public:
  void push(acc_t* dst, const acc_t* src, int64_t len, acc_t scale) {
    prefetch_block<1>(dst, len);
    prefetch_block(src, len);
    ring_[tail_ & kMask] = Pending{dst, src, scale, static_cast<int32_t>(len)};
    if (++tail_ - head_ > kScatterWindow) pop();
  }
  void drain() {
    while (head_ != tail_) pop();
  }

 private:
  static constexpr int64_t kScatterWindow = 32;
  static constexpr int64_t kMask = 63;  // ring of 64 >= kScatterWindow + 1 entries
  struct Pending {
    acc_t* dst;
    const acc_t* src;
    acc_t scale;
    int32_t len;
  };
  void pop() {
    const Pending& e = ring_[head_++ & kMask];
    if constexpr (kZ > 0) {
      add_scaled_fixed<kZ>(e.dst, e.src, e.scale);
    } else {
      add_scaled(e.dst, e.src, e.len, e.scale);
    }
  }
  Pending ring_[kMask + 1];
  int64_t head_ = 0, tail_ = 0;
};

// kWindowed: through a ScatterWindow (arrays beyond 512 KiB), or each block added as it is hashed.
// kZ > 0: every feature's dim is a multiple of Z = kZ, so every block holds kZ elements.
template <typename acc_t, bool kWindowed, int64_t kZ>
void direct_scatter_impl(const BackwardInputs& in, int64_t hash_mode, const std::vector<int64_t>& hash_params,
                         acc_t* __restrict__ buf) {
  const Layout& L = in.L;
  const int64_t B = L.B, Z = L.Z, ldg = in.ldg;
  const acc_t* go = in.grad_output.data_ptr<acc_t>();
  const acc_t* psw = in.psw.defined() ? in.psw.data_ptr<acc_t>() : nullptr;
  ScatterWindow<acc_t, kZ> window;
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_direct_scatter", [&] {
    const index_t* offs = in.offsets.data_ptr<index_t>();
    const index_t* vals = in.values.data_ptr<index_t>();
    dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
      for (int64_t t = 0; t < L.T; ++t) {
        const Feature& f = L.feats[t];
        acc_t* wbuf = buf + f.w_offset;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t bag = t * B + b;
          const int64_t s = offs[bag], e = offs[bag + 1];
          const acc_t* grow = go + b * ldg + f.out_offset;
          const acc_t len = static_cast<acc_t>(e - s);
          for (int64_t p = s; p < e; ++p) {
            const acc_t scale = value_scale(psw, p, f, len);
            hash.blocks(f.key(static_cast<int64_t>(vals[p])), f, [&](int64_t blk, uint64_t start) {
              const int64_t n = kZ > 0 ? kZ : std::min(Z, f.dim - blk * Z);
              if constexpr (kWindowed) {
                window.push(wbuf + start, grow + blk * Z, n, scale);
              } else if constexpr (kZ > 0) {
                add_scaled_fixed<kZ>(wbuf + start, grow + blk * Z, scale);
              } else {
                add_scaled(wbuf + start, grow + blk * Z, n, scale);
              }
            });
          }
        }
      }
    });
  });
  window.drain();
}

template <typename acc_t>
void direct_scatter(const BackwardInputs& in, int64_t weights_numel, int64_t hash_mode,
                    const std::vector<int64_t>& hash_params, acc_t* buf) {
  const bool windowed = direct_scatter_windowed(weights_numel, sizeof(acc_t),
                                                in.ldg * static_cast<int64_t>(sizeof(acc_t)));
  auto run = [&](auto z_tag) {
    constexpr int64_t kZ = decltype(z_tag)::value;
    if (windowed) {
      direct_scatter_impl<acc_t, true, kZ>(in, hash_mode, hash_params, buf);
    } else {
      direct_scatter_impl<acc_t, false, kZ>(in, hash_mode, hash_params, buf);
    }
  };
  const int64_t Z = in.L.Z;
  const bool whole_blocks = std::all_of(in.L.feats.begin(), in.L.feats.end(),
                                        [&](const Feature& f) { return f.dim % Z == 0; });
  with_block_length<std::is_same_v<acc_t, float>>(Z, whole_blocks, run);
}

// The whole dense gradient gw[0, M), bitwise the same on any number of threads.
template <typename acc_t>
void scatter_dense(const BackwardInputs& in, int64_t M, int64_t hash_mode,
                   const std::vector<int64_t>& hash_params, acc_t* gw) {
  if (use_direct_scatter(M, sizeof(acc_t))) {
    std::fill(gw, gw + M, acc_t(0));
    direct_scatter<acc_t>(in, M, hash_mode, hash_params, gw);
    return;
  }
  with_plan<acc_t>(in, M, hash_mode, hash_params, [&](const Plan<acc_t>& plan) {
    const acc_t* go = in.grad_output.data_ptr<acc_t>();
    parallel_for_dynamic(plan.R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t lo = r * plan.rs, hi = std::min(lo + plan.rs, M);
        std::fill(gw + lo, gw + hi, acc_t(0));
        accumulate_bucket(plan, r, lo, hi, go, gw + lo);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------
// backward_dense
// ---------------------------------------------------------------------------------------

at::Tensor backward_dense(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& values,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                          const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                          const std::vector<int64_t>& hash_params) {
  const at::ScalarType wst = weights.scalar_type();
  if (wst != at::kFloat && wst != at::kDouble && wst != at::kHalf && wst != at::kBFloat16) {
    fail(cat("robe: weights must be a floating point tensor, got ", wst));
  }
  const at::ScalarType acc_st = acc_type_of(wst);
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, psw, table_meta, block_size,
                                       hash_mode, hash_params, acc_st);
  const int64_t M = weights.numel();
  at::Tensor grad = at::empty({M}, weights.options().dtype(acc_st));
  AT_DISPATCH_FLOATING_TYPES(acc_st, "robe_backward_dense", [&] {
    scatter_dense<scalar_t>(in, M, hash_mode, hash_params, grad.data_ptr<scalar_t>());
  });
  return wst == acc_st ? grad : grad.to(wst);
}

// ---------------------------------------------------------------------------------------
// backward_fused_: scatter + optimizer step, one cache-sized weight range at a time
// ---------------------------------------------------------------------------------------

struct HParams {
  double lr, eps, beta1, beta2, wd;
};

// The steps read weights of type W (float16/bfloat16 storage, or T itself), compute in T
// (float32/float64, as the state) and write the weights back rounded to W.
template <typename W, typename T>
inline void sgd_range(W* __restrict__ w, const T* __restrict__ g, int64_t n, T lr, T wd) {
  const T neg_lr = -lr;
  if (wd != T(0)) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const T wi = static_cast<T>(w[i]);
      w[i] = static_cast<W>(wi + neg_lr * (g[i] + wd * wi));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) w[i] = static_cast<W>(static_cast<T>(w[i]) + neg_lr * g[i]);
  }
}

template <typename W, typename T>
inline void adagrad_range(W* __restrict__ w, T* __restrict__ s1, const T* __restrict__ g, int64_t n,
                          T lr, T eps, T wd) {
  const T neg_lr = -lr;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T wi = static_cast<T>(w[i]);
    const T gi = g[i] + wd * wi;
    const T s = s1[i] + gi * gi;
    s1[i] = s;
    w[i] = static_cast<W>(wi + neg_lr * (gi / (std::sqrt(s) + eps)));
  }
}

template <typename W, typename T>
inline void adam_range(W* __restrict__ w, T* __restrict__ m1, T* __restrict__ m2, const T* __restrict__ g,
                       int64_t n, T wd, T w1, T beta2, T one_minus_beta2, T inv_bias2_sqrt, T eps,
                       T neg_step) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T wi = static_cast<T>(w[i]);
    const T gi = g[i] + wd * wi;
    const T m = m1[i] + w1 * (gi - m1[i]);  // torch.lerp(m1, g, w1) for w1 < 0.5
    const T v = m2[i] * beta2 + one_minus_beta2 * gi * gi;
    m1[i] = m;
    m2[i] = v;
    w[i] = static_cast<W>(wi + neg_step * (m / (std::sqrt(v) * inv_bias2_sqrt + eps)));
  }
}

// Row-wise Adagrad on rows [r0, r1) of Z elements (meta.py: row r is elements [r*Z, r*Z + Z)
// of the M weights, the last one shorter); g holds the gradient of element r0 * Z onwards.
// The squares are summed in element order, without simd, so a row's sum does not depend on
// the buffer's alignment or on which path or thread steps it.
template <typename W, typename T>
void rowwise_adagrad_rows(W* __restrict__ w, T* __restrict__ sum, const T* __restrict__ g, int64_t r0,
                          int64_t r1, int64_t Z, int64_t M, T lr, T eps, T wd) {
  const T neg_lr = -lr;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t lo = r * Z, n = std::min(Z, M - lo);
    W* __restrict__ wr = w + lo;
    const T* __restrict__ gr = g + (lo - r0 * Z);
    T sq = T(0);
    for (int64_t j = 0; j < n; ++j) {
      const T gj = gr[j] + wd * static_cast<T>(wr[j]);
      sq += gj * gj;
    }
    const T s = sum[r] + sq / static_cast<T>(n);
    sum[r] = s;
    const T denom = std::sqrt(s) + eps;
    for (int64_t j = 0; j < n; ++j) {
      const T wj = static_cast<T>(wr[j]);
      wr[j] = static_cast<W>(wj + neg_lr * ((gr[j] + wd * wj) / denom));
    }
  }
}

void backward_fused_(const at::Tensor& grad_output, at::Tensor weights, at::Tensor state1, at::Tensor state2,
                     const at::Tensor& values, const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                     const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                     const std::vector<int64_t>& hash_params, int64_t optimizer,
                     const std::vector<double>& hparams, int64_t step) {
  const at::ScalarType wst = weights.scalar_type();
  if (wst != at::kFloat && wst != at::kDouble && wst != at::kHalf && wst != at::kBFloat16) {
    fail(cat("robe: the fused backward supports float32, float64, float16 and bfloat16 weights, got ", wst));
  }
  const at::ScalarType acc_st = acc_type_of(wst);
  if (optimizer != OPT_SGD && optimizer != OPT_ADAGRAD && optimizer != OPT_ADAM &&
      optimizer != OPT_ROWWISE_ADAGRAD) {
    fail(cat("robe: unknown fused optimizer ", optimizer,
             "; optimizer must be 0 (sgd), 1 (adagrad), 2 (adam) or 3 (rowwise_adagrad)"));
  }
  if (hparams.size() != 5) fail(cat("robe: hparams must hold 5 floats (lr, eps, beta1, beta2, weight_decay), got ", hparams.size()));
  if (!weights.is_contiguous()) fail("robe: the fused backward updates weights in place; they must be contiguous");
  const int64_t M = weights.numel();
  if (block_size < 1) fail(cat("robe: block_size must be >= 1, got ", block_size));
  const int64_t rows = (M + block_size - 1) / block_size;  // row-wise Adagrad's state entries
  auto check_state = [&](const at::Tensor& s, const char* name, int64_t numel) {
    check_cpu(s, name);
    if (s.numel() != numel || s.scalar_type() != acc_st || !s.is_contiguous()) {
      fail(cat("robe: ", name, " must be a contiguous ", acc_st, " tensor of ", numel, " elements for ", wst,
               " weights of ", M, " elements, got ", s.scalar_type(), " with ", s.numel(), " elements"));
    }
  };
  if (optimizer == OPT_ADAGRAD || optimizer == OPT_ADAM) check_state(state1, "state1", M);
  if (optimizer == OPT_ADAM) check_state(state2, "state2", M);
  if (optimizer == OPT_ROWWISE_ADAGRAD) check_state(state1, "state1", rows);
  if (optimizer == OPT_ADAM && step < 1) fail(cat("robe: Adam needs step >= 1, got ", step));
  const HParams hp{hparams[0], hparams[1], hparams[2], hparams[3], hparams[4]};
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, psw, table_meta, block_size,
                                       hash_mode, hash_params, acc_st);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, wst, "robe_backward_fused", [&] {
    using W = scalar_t;
    using T = at::opmath_type<W>;
    W* w = weights.data_ptr<W>();
    T* s1 = optimizer != OPT_SGD ? state1.data_ptr<T>() : nullptr;
    T* s2 = optimizer == OPT_ADAM ? state2.data_ptr<T>() : nullptr;
    const double bias1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
    const double bias2_sqrt = std::sqrt(1.0 - std::pow(hp.beta2, static_cast<double>(step)));
    // the optimizer step of weights [lo, lo + n), whose gradient is in grad
    auto step_range = [&](int64_t lo, int64_t n, const T* grad) {
      if (optimizer == OPT_SGD) {
        sgd_range<W, T>(w + lo, grad, n, static_cast<T>(hp.lr), static_cast<T>(hp.wd));
      } else if (optimizer == OPT_ADAGRAD) {
        adagrad_range<W, T>(w + lo, s1 + lo, grad, n, static_cast<T>(hp.lr), static_cast<T>(hp.eps),
                            static_cast<T>(hp.wd));
      } else {
        adam_range<W, T>(w + lo, s1 + lo, s2 + lo, grad, n, static_cast<T>(hp.wd),
                      static_cast<T>(1.0 - hp.beta1), static_cast<T>(hp.beta2),
                      static_cast<T>(1.0 - hp.beta2), static_cast<T>(1.0 / bias2_sqrt),
                      static_cast<T>(hp.eps), static_cast<T>(-hp.lr / bias1));
      }
    };
    if (optimizer == OPT_ROWWISE_ADAGRAD) {
      // a row can straddle two of the plan's ranges: step the rows once the whole gradient is in
      T* grad = t_direct.get<T>(static_cast<size_t>(M));
      scatter_dense<T>(in, M, hash_mode, hash_params, grad);
      parallel_for_dynamic(rows, dynamic_chunk(rows, std::max<int64_t>(1, 16384 / block_size)),
                           [&](int64_t r0, int64_t r1) {
        rowwise_adagrad_rows<W, T>(w, s1, grad + r0 * block_size, r0, r1, block_size, M,
                                   static_cast<T>(hp.lr), static_cast<T>(hp.eps), static_cast<T>(hp.wd));
      });
      t_direct.trim();
      return;
    }
    if (use_direct_scatter(M, sizeof(T))) {
      T* grad = t_direct.get<T>(static_cast<size_t>(M));
      std::fill(grad, grad + M, T(0));
      direct_scatter<T>(in, M, hash_mode, hash_params, grad);
      elementwise_ranges(M, [&](int64_t lo, int64_t hi) { step_range(lo, hi - lo, grad + lo); });
      return;
    }
    with_plan<T>(in, M, hash_mode, hash_params, [&](const Plan<T>& plan) {
      const T* go = in.grad_output.data_ptr<T>();
      parallel_for_dynamic(plan.R, 1, [&](int64_t r0, int64_t r1) {
        std::unique_ptr<T[]> buf_mem(new T[static_cast<size_t>(plan.rs)]);
        T* buf = buf_mem.get();
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t lo = r * plan.rs, hi = std::min(lo + plan.rs, M), n = hi - lo;
          std::fill(buf, buf + n, T(0));
          accumulate_bucket(plan, r, lo, hi, go, buf);
          step_range(lo, n, buf);
        }
      });
    });
  });
}

// ---------------------------------------------------------------------------------------
// per_sample_weights_grad
// ---------------------------------------------------------------------------------------

template <typename T, typename index_t, typename Hash>
void psw_grad_kernel(const T* __restrict__ go, const T* __restrict__ w, const index_t* __restrict__ vals,
                     const index_t* __restrict__ offs, T* __restrict__ out, int64_t ldg, const Layout& L,
                     const Hash& hash, int64_t N) {
  const int64_t B = L.B, T_ = L.T, Z = L.Z;
  const int64_t n_bags = B * T_;
  const int64_t entries_per_bag = std::max<int64_t>(1, N * std::max<int64_t>(L.max_blocks, 1) / std::max<int64_t>(n_bags, 1));
  const int64_t tile = std::clamp<int64_t>(kTileEntries / entries_per_bag, 1, 256);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, entries_per_bag * Z));
  parallel_for_dynamic(n_bags, dynamic_chunk(n_bags, grain), [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> starts;  // flat weight index of each (value, block) of the tile
    starts.reserve(4 * kTileEntries);
    for (int64_t tb0 = i0; tb0 < i1; tb0 += tile) {
      const int64_t tb1 = std::min(i1, tb0 + tile);
      starts.clear();
      for (int64_t bag = tb0; bag < tb1; ++bag) {  // pass 1: hash and prefetch
        const Feature& f = L.feats[bag / B];
        const T* wf = w + f.w_offset;
        for (int64_t p = offs[bag], e = offs[bag + 1]; p < e; ++p) {
          const uint64_t key = f.key(static_cast<int64_t>(vals[p]));
          hash.blocks(key, f, [&](int64_t blk, uint64_t start) {
            prefetch_block(wf + start, std::min(Z, f.dim - blk * Z));
            starts.push_back(f.w_offset + static_cast<int64_t>(start));
          });
        }
      }
      const int64_t* st = starts.data();
      for (int64_t bag = tb0; bag < tb1; ++bag) {  // pass 2: dot products
        const Feature& f = L.feats[bag / B];
        const int64_t s = offs[bag], e = offs[bag + 1];
        const T* __restrict__ grow = go + (bag % B) * ldg + f.out_offset;
        const T len = static_cast<T>(e - s);
        const int64_t D = f.dim;
        for (int64_t p = s; p < e; ++p) {
          T dot = T(0);
          for (int64_t blk = 0; blk < f.nblocks; ++blk) {
            const T* __restrict__ src = w + *st++;
            const T* __restrict__ g = grow + blk * Z;
            const int64_t n = std::min(Z, D - blk * Z);
            T part = T(0);
#pragma omp simd reduction(+ : part)
            for (int64_t j = 0; j < n; ++j) part += src[j] * g[j];
            dot += part;
          }
          out[p] = f.mean ? dot / len : dot;
        }
      }
    }
  });
}

at::Tensor per_sample_weights_grad(const at::Tensor& grad_output, const at::Tensor& weights,
                                   const at::Tensor& values, const at::Tensor& offsets,
                                   const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                                   const std::vector<int64_t>& hash_params) {
  const at::ScalarType wst = weights.scalar_type();
  if (wst != at::kFloat && wst != at::kDouble && wst != at::kHalf && wst != at::kBFloat16) {
    fail(cat("robe: weights must be a floating point tensor, got ", wst));
  }
  const at::ScalarType acc_st = acc_type_of(wst);
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, std::nullopt, table_meta,
                                       block_size, hash_mode, hash_params, acc_st);
  const at::Tensor w = weights.to(acc_st).contiguous();
  at::Tensor out = at::empty({in.N}, weights.options().dtype(acc_st));
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_psw_grad_index", [&] {
    AT_DISPATCH_FLOATING_TYPES(acc_st, "robe_psw_grad", [&] {
      dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
        psw_grad_kernel<scalar_t, index_t>(in.grad_output.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                           in.values.data_ptr<index_t>(), in.offsets.data_ptr<index_t>(),
                                           out.data_ptr<scalar_t>(), in.ldg, in.L, hash, in.N);
      });
    });
  });
  return wst == acc_st ? out : out.to(wst);
}

bool openmp_enabled() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace robe

// TORCH_LIBRARY pastes its first argument into names, so the extension's name (a macro the
// build defines) is expanded one level up. Each build of this file registers its own
// namespace: the kernel A/B benchmark loads two builds into one process.
#define ROBE_CPU_LIBRARY(name, m) TORCH_LIBRARY(name, m)

ROBE_CPU_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &robe::forward);
  m.def("backward_dense", &robe::backward_dense);
  m.def("per_sample_weights_grad", &robe::per_sample_weights_grad);
  m.def("backward_fused_", &robe::backward_fused_);
  m.def("forward_part", &robe::forward_part);
  m.def("openmp_enabled", &robe::openmp_enabled);
  m.def("use_direct_scatter", &robe::use_direct_scatter);
  m.def("direct_scatter_windowed", &robe::direct_scatter_windowed);
  m.def("forward_prefetches", &robe::forward_prefetches);
}
