// softmax(q k^T * scale) v for XLA:CPU in one pass, as an XLA FFI custom call (models/cpu/fused_attention.py
// builds this file for the machine it runs on and says why it exists).
//
// q: [B, Sq, H, D], k, v: [B, Sk, H, D], out: [B, Sq, H, D], all float32. Two phases on XLA's intra-op pool:
//   1. per (batch row, head): K^T packed as [D, Skp] and V as [Skp, Dp] (Skp: Sk rounded up to a key block,
//      Dp: D rounded up to a vector; zeros past the ends), so the inner loops read unit-stride vectors;
//   2. per (batch row, head, block of BQ query rows): for each block of BK keys, the scores in register tiles
//      of RQ rows x BK keys, the online softmax (running max and sum, the output rescaled when the max moves),
//      and the output's update P V in register tiles of RQ rows x up to 64 columns.
// Each task is done by one thread in a fixed order, so a row's result does not depend on the thread count or
// on the other rows of its batch (tests/models/test_seeds.py holds seeds bit-identical across batch positions).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
constexpr int RQ = 6;  // 6 x 4 accumulators + 4 key vectors of 32 registers (6 rows: 74 against 66 GFLOP/s at 4)
#else
constexpr int W = 8;
constexpr int RQ = 2;  // 2 x 4 accumulators + 4 key vectors of AVX2's 16 registers
#endif
typedef float vec __attribute__((vector_size(4 * W)));
typedef int32_t ivec __attribute__((vector_size(4 * W)));
constexpr int NK = 4;       // key vectors per register tile
constexpr int BK = NK * W;  // keys per block
constexpr int BQ = RQ * 8;  // query rows per task

// Keeps a loaded vector in a register for the whole tile: without it GCC folds the load into each of the
// tile's FMAs that use it (a load per FMA), and the kernel ran at 50 instead of 65 GFLOP/s on one Zen 4 core.
#if defined(__x86_64__)
#define IN_REGISTER(x) asm("" : "+v"(x))
#else
#define IN_REGISTER(x)
#endif

inline vec load(const float* p) {
  vec r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void store(float* p, vec x) { std::memcpy(p, &x, sizeof(x)); }
inline vec splat(float x) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(x);
#else
  return vec{} + x;
#endif
}

// 2^x for x <= 0, and 0 below -125: x = n + f with n = round(x), |f| <= 1/2, 2^f by its Taylor series in
// f ln 2 to degree 7 (relative error under 1e-7), 2^n added to the exponent bits.
inline vec exp2_nonpositive(vec x) {
  const vec floor = splat(-125.f);
  const vec xc = x < floor ? floor : x;
  const ivec n = __builtin_convertvector(xc - splat(0.5f), ivec);  // truncation: round(xc) for xc <= 0
  const vec f = (xc - __builtin_convertvector(n, vec)) * splat(0.6931471805599453f);
  vec p = splat(1.f / 5040.f);
  p = p * f + splat(1.f / 720.f);
  p = p * f + splat(1.f / 120.f);
  p = p * f + splat(1.f / 24.f);
  p = p * f + splat(1.f / 6.f);
  p = p * f + splat(0.5f);
  p = p * f + splat(1.f);
  p = p * f + splat(1.f);
  ivec bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += n << 23;
  vec r;
  std::memcpy(&r, &bits, sizeof(r));
  return x < floor ? splat(0.f) : r;
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t b, sq, sk, h, d;
  float scale;
  int64_t dp() const { return (d + W - 1) / W * W; }
  int64_t skp() const { return (sk + BK - 1) / BK * BK; }
  int64_t packed_per_head() const { return d * skp() + skp() * dp(); }
  int64_t row() const { return h * d; }  // floats between consecutive tokens
};

// Phase 1: K^T [d, skp] and V [skp, dp] of one (batch row, head), zero past sk and d.
void pack_head(const Problem& pr, int64_t bh, float* packed) {
  const int64_t hh = bh % pr.h, bb = bh / pr.h, skp = pr.skp(), dp = pr.dp(), row = pr.row();
  float* kt = packed + bh * pr.packed_per_head();
  float* vp = kt + pr.d * skp;
  const float* ks = pr.k + bb * pr.sk * row + hh * pr.d;
  const float* vs = pr.v + bb * pr.sk * row + hh * pr.d;
  for (int64_t j = 0; j < skp; ++j) {
    const bool real = j < pr.sk;
    for (int64_t c = 0; c < pr.d; ++c) kt[c * skp + j] = real ? ks[j * row + c] : 0.f;
    for (int64_t c = 0; c < dp; ++c) vp[j * dp + c] = real && c < pr.d ? vs[j * row + c] : 0.f;
  }
}

// s[:rows, :NKT*W] = qs[:rows, :d] @ kt[:d, :NKT*W] (kt's rows skp apart), RQ rows at a time.
template <int NKT>
void score_tiles(const float* qs, const float* kt, float* s, int d, int64_t skp, int rows) {
  for (int i0 = 0; i0 < rows; i0 += RQ) {
    vec acc[RQ][NKT] = {};
    for (int c = 0; c < d; ++c) {
      vec kk[NKT];
      _Pragma("GCC unroll 8") for (int t = 0; t < NKT; ++t) {
        kk[t] = load(kt + c * skp + t * W);
        IN_REGISTER(kk[t]);
      }
      _Pragma("GCC unroll 8") for (int r = 0; r < RQ; ++r) {
        const vec qq = splat(qs[(i0 + r) * d + c]);
        _Pragma("GCC unroll 8") for (int t = 0; t < NKT; ++t) acc[r][t] += qq * kk[t];
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RQ; ++r)
      _Pragma("GCC unroll 8") for (int t = 0; t < NKT; ++t) store(s + (i0 + r) * BK + t * W, acc[r][t]);
  }
}

// o[:rows, dc : dc + NV*W] += p[:rows, :nk] @ v[:nk, dc : dc + NV*W], RQ rows at a time.
template <int NV>
void update_tiles(const float* p, const float* v, float* o, int dp, int dc, int nk, int rows) {
  for (int i0 = 0; i0 < rows; i0 += RQ) {
    vec acc[RQ][NV];
    _Pragma("GCC unroll 8") for (int r = 0; r < RQ; ++r)
      _Pragma("GCC unroll 8") for (int c = 0; c < NV; ++c) acc[r][c] = load(o + (i0 + r) * dp + dc + c * W);
    for (int j = 0; j < nk; ++j) {
      vec vv[NV];
      _Pragma("GCC unroll 8") for (int c = 0; c < NV; ++c) {
        vv[c] = load(v + j * dp + dc + c * W);
        IN_REGISTER(vv[c]);
      }
      _Pragma("GCC unroll 8") for (int r = 0; r < RQ; ++r) {
        const vec pr = splat(p[(i0 + r) * BK + j]);
        _Pragma("GCC unroll 8") for (int c = 0; c < NV; ++c) acc[r][c] += pr * vv[c];
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RQ; ++r)
      _Pragma("GCC unroll 8") for (int c = 0; c < NV; ++c) store(o + (i0 + r) * dp + dc + c * W, acc[r][c]);
  }
}

struct Scratch {
  float* buf = nullptr;
  size_t size = 0;
  ~Scratch() { std::free(buf); }
  float* get(size_t n) {
    if (n > size) {
      std::free(buf);
      buf = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
      size = buf ? n : 0;
    }
    return buf;
  }
};

// Phase 2: one (batch row, head, block of BQ query rows). Returns false when out of memory.
bool attend_block(const Problem& pr, const float* packed, int64_t task, Scratch& scratch) {
  const int64_t qblocks = (pr.sq + BQ - 1) / BQ;
  const int64_t qb = task % qblocks, bh = task / qblocks;
  const int64_t hh = bh % pr.h, bb = bh / pr.h, skp = pr.skp(), row = pr.row();
  const int d = static_cast<int>(pr.d), dp = static_cast<int>(pr.dp());
  const float* kt_all = packed + bh * pr.packed_per_head();
  const float* v_all = kt_all + pr.d * skp;
  float* qs = scratch.get(static_cast<size_t>(BQ * d + BQ * dp + BQ * BK + 2 * BQ));
  if (qs == nullptr) return false;
  float* o = qs + BQ * d;  // [BQ, dp], unnormalised
  float* s = o + BQ * dp;  // [BQ, BK]: scores, then their exponentials
  float* m = s + BQ * BK;  // running max of each row, log2 units
  float* l = m + BQ;       // running sum of each row
  const int64_t q0 = qb * BQ;
  const int nq = static_cast<int>(std::min<int64_t>(BQ, pr.sq - q0));
  const int rows = (nq + RQ - 1) / RQ * RQ;  // whole register tiles
  // Scores in log2 units, exp(x) = 2^(x log2 e): the scale and log2 e folded into q once.
  const float qscale = pr.scale * 1.4426950408889634f;
  const float* qsrc = pr.q + (bb * pr.sq + q0) * row + hh * pr.d;
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < d; ++c) qs[i * d + c] = i < nq ? qsrc[i * row + c] * qscale : 0.f;
  std::fill(o, o + rows * dp, 0.f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.f);
  for (int64_t k0 = 0; k0 < pr.sk; k0 += BK) {
    const int nk = static_cast<int>(std::min<int64_t>(BK, pr.sk - k0));
    const int nkt = (nk + W - 1) / W;  // a short last block computes only the vectors it has
    switch (nkt) {
      case 4: score_tiles<4>(qs, kt_all + k0, s, d, skp, rows); break;
      case 3: score_tiles<3>(qs, kt_all + k0, s, d, skp, rows); break;
      case 2: score_tiles<2>(qs, kt_all + k0, s, d, skp, rows); break;
      default: score_tiles<1>(qs, kt_all + k0, s, d, skp, rows); break;
    }
    for (int i = 0; i < rows; ++i) {
      float* si = s + i * BK;
      for (int j = nk; j < nkt * W; ++j) si[j] = -INFINITY;
      vec mx = load(si);
      for (int t = 1; t < nkt; ++t) {
        const vec x = load(si + t * W);
        mx = mx > x ? mx : x;
      }
      float block_max = mx[0];
      for (int e = 1; e < W; ++e) block_max = std::max(block_max, mx[e]);
      const float m_new = std::max(m[i], block_max);
      const float alpha = m[i] == -INFINITY ? 0.f : std::exp2(m[i] - m_new);
      vec sum = {};
      for (int t = 0; t < nkt; ++t) {
        const vec e = exp2_nonpositive(load(si + t * W) - splat(m_new));
        sum += e;
        store(si + t * W, e);
      }
      float total = 0.f;
      for (int e = 0; e < W; ++e) total += sum[e];
      l[i] = l[i] * alpha + total;
      m[i] = m_new;
      if (alpha != 1.f)
        for (int c = 0; c < dp; c += W) store(o + i * dp + c, load(o + i * dp + c) * splat(alpha));
    }
    const float* v = v_all + k0 * dp;
    int dc = 0;
    for (; dc + 4 * W <= dp; dc += 4 * W) update_tiles<4>(s, v, o, dp, dc, nk, rows);
    switch ((dp - dc) / W) {
      case 3: update_tiles<3>(s, v, o, dp, dc, nk, rows); break;
      case 2: update_tiles<2>(s, v, o, dp, dc, nk, rows); break;
      case 1: update_tiles<1>(s, v, o, dp, dc, nk, rows); break;
      default: break;
    }
  }
  float* dst = pr.out + (bb * pr.sq + q0) * row + hh * pr.d;
  for (int i = 0; i < nq; ++i) {
    const float inv = 1.f / l[i];  // l >= 1: the row's max contributes exp(0)
    for (int c = 0; c < d; ++c) dst[i * row + c] = o[i * dp + c] * inv;
  }
  return true;
}

// Runs fn(0) ... fn(n - 1) on the calling thread and the pool's other threads, and returns when all are done.
// The caller takes items too, so it finishes alone when the pool runs nothing of ours (XLA allows a pool that
// runs tasks late, or on the caller), and helpers that start late find no work and leave.
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Shared {
    Fn fn;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Fn f, int64_t count) : fn(std::move(f)), n(count) {}
    void work() {
      int64_t finished = 0;
      for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n; ++finished) fn(t);
      if (finished) done.fetch_add(finished, std::memory_order_acq_rel);
    }
  };
  auto shared = std::make_shared<Shared>(std::move(fn), n);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

ffi::Error attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("fused attention: q, k, v must be [B, S, H, D]");
  for (int i : {0, 2, 3})
    if (kd[i] != qd[i] || vd[i] != qd[i])
      return ffi::Error::InvalidArgument("fused attention: q, k, v differ in batch, heads or head dim");
  if (vd[1] != kd[1]) return ffi::Error::InvalidArgument("fused attention: k and v differ in length");
  const Problem pr{q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(),
                   qd[0], qd[1], kd[1], qd[2], qd[3], scale};
  if (pr.b * pr.sq * pr.h * pr.d == 0) return ffi::Error::Success();
  if (pr.sk == 0) {  // no key to see: 0, as models.attention.reference gives
    std::fill(pr.out, pr.out + pr.b * pr.sq * pr.h * pr.d, 0.f);
    return ffi::Error::Success();
  }
  const size_t packed_bytes = (pr.b * pr.h * pr.packed_per_head() * sizeof(float) + 63) / 64 * 64;
  std::unique_ptr<float, decltype(&std::free)> packed(static_cast<float*>(std::aligned_alloc(64, packed_bytes)),
                                                      &std::free);
  if (!packed) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "fused attention: out of memory");
  float* pk = packed.get();
  parallel_for(pool, pr.b * pr.h, [&pr, pk](int64_t bh) { pack_head(pr, bh, pk); });
  std::atomic<bool> failed{false};
  parallel_for(pool, pr.b * pr.h * ((pr.sq + BQ - 1) / BQ), [&pr, pk, &failed](int64_t task) {
    thread_local Scratch scratch;
    if (!attend_block(pr, pk, task, scratch)) failed.store(true, std::memory_order_relaxed);
  });
  if (failed.load()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "fused attention: out of memory");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshserveFusedAttention, attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
