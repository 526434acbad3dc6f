// Fused CPU kernels for the training step's elementwise chains (built and loaded by kernels/fused.py).
//
// Each kernel is one pass over its rows where torch runs several ops, each a full pass over memory with its own
// dispatch: the RMSNorm forward also writes the bf16 copy the next GEMM reads, the SwiGLU backward writes both
// gradients and their bf16 copies at once. Rows are split across torch's intra-op threads (at::parallel_for); every
// row is computed by one thread in one fixed order, so results do not depend on the thread count, and a kernel called
// twice on the same operands gives the same bits (the nodes rely on that to recompute what they did not save).
//
// Inputs: float32 (or, for GEMM products, bfloat16) matrices whose columns are contiguous (stride(1) == 1); rows may
// be strided (column blocks of a wider tensor). Outputs: new contiguous tensors. No libm calls in the loops (a
// polynomial exp), so the compiler vectorizes them for the build machine's own vector unit (AVX-512, AVX2, NEON).
// A float scalar or pointer a vectorized loop reads is a local of the thread's lambda, not a variable it captures by
// reference: GCC 12 then reloaded it every iteration, as a gather (objdump: the attention forward gathered its scale
// for every 16 scores, 440 -> 310 us a SmolLM2 layer once local; rms_norm_bwd gathered w, 34 -> 16 us at [256, 576]).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LORAD_AMX 1
#define LORAD_BF16_ATTENTION 1
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LORAD_AVX512BF16 1
#define LORAD_BF16_ATTENTION 1
#endif

namespace {

constexpr int64_t kGrainElements = 16384;  // at most one chunk per thread below this many elements

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, cols)); }

// float -> bfloat16 bits, round to nearest even, NaN kept quiet: the conversion torch's .to(torch.bfloat16) does.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// bfloat16 bits -> float (exact).
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// e^x for x in float range, ~1 ulp (Cephes' expf polynomial on a range-reduced argument, 2^n set through the exponent
// bits). Below -87.3 the result is 0 (e^x is under float's smallest normal there); above 88.3 it stays at e^88.3, so
// 2^n is always a normal float; NaN stays NaN.
inline float exp_poly(float x) {
  const bool underflow = x < -87.3f;
  x = x > 88.3f ? 88.3f : x;
  x = x < -87.3f ? -87.3f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflow ? 0.0f : y * scale;
}

// 1 / (1 + e^-x) from e^-|x| <= 1, which never overflows: exactly 0 and 1 far out, so silu(x) = x·sigmoid(x) is -0
// and x there, as torch's is.
inline float sigmoid(float x) {
  const float e = exp_poly(x < 0.0f ? x : -x);
  const float inv = 1.0f / (1.0f + e);
  return x < 0.0f ? e * inv : inv;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, name, " must have contiguous columns (stride(1) == 1)");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == b.size(1), name, " has shape ", b.sizes(), ", expected ",
              a.sizes());
}

void check_weight(const at::Tensor& w, int64_t cols) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == cols && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight must be a contiguous float32 vector of ", cols, " elements, got ", w.sizes(), " ",
              w.scalar_type());
}

void check_rstd(const at::Tensor& rstd, int64_t rows) {
  TORCH_CHECK(rstd.numel() == rows && rstd.is_contiguous() && rstd.scalar_type() == at::kFloat,
              "rstd must hold one float32 per row (", rows, "), got ", rstd.sizes(), " ", rstd.scalar_type());
}

void check_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D) {
  for (const at::Tensor* tab : {&cos, &sin}) {
    TORCH_CHECK(tab->dim() == 2 && tab->size(0) == T && tab->size(1) == D && tab->is_contiguous() &&
                    tab->scalar_type() == at::kFloat,
                "cos and sin must be contiguous float32 [", T, ", ", D, "] tables, got ", tab->sizes());
  }
}

uint16_t* bf16_data(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// One normed row, y = x·rstd·w: the one expression the forward, its recomputation (rms_norm_apply) and the A gradients'
// recomputed rows (rms_norm_a_grads) all evaluate, so they agree bit for bit.
inline float normed(float x, float rs, float w) { return x * rs * w; }

inline void normed_row(const float* xr, float rs, const float* w, float* yr, int64_t C) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) yr[c] = normed(xr[c], rs, w[c]);
}

// y = x·rstd·w with rstd = 1/sqrt(mean(x²) + eps) per row, rstd [R, 1], and (when asked) y as bfloat16; the second
// tensor is empty otherwise.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps,
                                                            bool want_bf16) {
  check_rows(x, "x");
  const int64_t R = x.size(0), C = x.size(1), ldx = x.stride(0);
  check_weight(w, C);
  at::Tensor y = at::empty({R, C}, x.options());
  at::Tensor yb = at::empty({want_bf16 ? R : 0, C}, x.options().dtype(at::kBFloat16));
  at::Tensor rstd = at::empty({R, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(yb) : nullptr;
  float* rp = rstd.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, R, grain_rows(C), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * ldx;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
      const float rs = 1.0f / __builtin_sqrtf(ss / static_cast<float>(C) + feps);
      rp[r] = rs;
      float* yr = yp + r * C;
      if (bp != nullptr) {
        uint16_t* br = bp + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float v = normed(xr[c], rs, wp[c]);
          yr[c] = v;
          br[c] = to_bf16(v);
        }
      } else {
        normed_row(xr, rs, wp, yr, C);
      }
    }
  });
  return {y, yb, rstd};
}

// The forward's y from x and its rstd, bit for bit (the same expression).
at::Tensor rms_norm_apply(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& w) {
  check_rows(x, "x");
  const int64_t R = x.size(0), C = x.size(1), ldx = x.stride(0);
  check_weight(w, C);
  check_rstd(rstd, R);
  at::Tensor y = at::empty({R, C}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, grain_rows(C), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      normed_row(xp + r * ldx, rp[r], wp, yp + r * C, C);
    }
  });
  return y;
}

// dL/dx of y = x·rstd·w (w frozen): rstd·(g·w − x̂·mean(g·w·x̂)), x̂ = x·rstd.
at::Tensor rms_norm_bwd(const at::Tensor& g, const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& w) {
  check_rows(g, "g");
  check_rows(x, "x");
  check_same(x, g, "g");
  const int64_t R = x.size(0), C = x.size(1), ldx = x.stride(0), ldg = g.stride(0);
  check_weight(w, C);
  check_rstd(rstd, R);
  at::Tensor dx = at::empty({R, C}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, R, grain_rows(C), [&](int64_t begin, int64_t end) {
    const float* w = wp;
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * ldx;
      const float* gr = gp + r * ldg;
      const float rs = rp[r];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; ++c) dot += gr[c] * w[c] * (xr[c] * rs);
      const float mean = dot / static_cast<float>(C);
      float* dr = dp + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dr[c] = rs * (gr[c] * w[c] - (xr[c] * rs) * mean);
    }
  });
  return dx;
}

// One row of act = silu(gate)·up's gradients for d_act row d: [d_gate | d_up] into og (2F floats) and, when br is
// given, the same rounded to bfloat16.
inline void swiglu_grad_row(const float* d, const float* gr, const float* ur, int64_t F, float* og, uint16_t* br) {
  float* ou = og + F;
#pragma omp simd
  for (int64_t c = 0; c < F; ++c) {
    const float g = gr[c];
    const float s = sigmoid(g);
    og[c] = d[c] * ur[c] * (s * (1.0f + g * (1.0f - s)));
    ou[c] = d[c] * (g * s);
  }
  if (br != nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < 2 * F; ++c) br[c] = to_bf16(og[c]);
  }
}

// act = silu(gate)·up, and (when asked) act as bfloat16; the second tensor is empty otherwise.
std::tuple<at::Tensor, at::Tensor> swiglu_fwd(const at::Tensor& gate, const at::Tensor& up, bool want_bf16) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_same(gate, up, "up");
  const int64_t R = gate.size(0), F = gate.size(1), ldg = gate.stride(0), ldu = up.stride(0);
  at::Tensor act = at::empty({R, F}, gate.options());
  at::Tensor actb = at::empty({want_bf16 ? R : 0, F}, gate.options().dtype(at::kBFloat16));
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(actb) : nullptr;
  at::parallel_for(0, R, grain_rows(F), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = gp + r * ldg;
      const float* ur = up_ + r * ldu;
      float* ar = ap + r * F;
      if (bp != nullptr) {
        uint16_t* br = bp + r * F;
#pragma omp simd
        for (int64_t c = 0; c < F; ++c) {
          const float v = gr[c] * sigmoid(gr[c]) * ur[c];
          ar[c] = v;
          br[c] = to_bf16(v);
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < F; ++c) ar[c] = gr[c] * sigmoid(gr[c]) * ur[c];
      }
    }
  });
  return {act, actb};
}

// Gradients of act = silu(gate)·up for d_act: [dgate | dup] side by side [R, 2F] in float32 and (when asked) in
// bfloat16, the order of the stacked gate/up weight, so the bf16 block is the input-gradient GEMM's left operand as
// it is (converted from the row just written, still in cache); the second tensor is empty otherwise.
std::tuple<at::Tensor, at::Tensor> swiglu_bwd(const at::Tensor& d_act, const at::Tensor& gate, const at::Tensor& up,
                                              bool want_bf16) {
  check_rows(d_act, "d_act");
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_same(gate, up, "up");
  check_same(gate, d_act, "d_act");
  const int64_t R = gate.size(0), F = gate.size(1);
  const int64_t ldd = d_act.stride(0), ldg = gate.stride(0), ldu = up.stride(0);
  at::Tensor dgu = at::empty({R, 2 * F}, gate.options());
  at::Tensor dgub = at::empty({want_bf16 ? R : 0, 2 * F}, gate.options().dtype(at::kBFloat16));
  const float* dp = d_act.data_ptr<float>();
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* op = dgu.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(dgub) : nullptr;
  at::parallel_for(0, R, grain_rows(2 * F), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      swiglu_grad_row(dp + r * ldd, gp + r * ldg, up_ + r * ldu, F, op + r * 2 * F,
                      bp != nullptr ? bp + r * 2 * F : nullptr);
    }
  });
  return {dgu, dgub};
}


// The LoRA operands of a gate/up pair: each bf16 product [R, F] (contiguous columns, any row stride), the stacked
// h = x·[A_gate; A_up]ᵀ [R, rg + ru] (any strides) and each B [F, r] as [r, Fp] rows, zero-padded to whole tiles.
constexpr int64_t kTileRows = 8;   // rows of one LoRA micro-tile
constexpr int64_t kTileCols = 32;  // columns of one LoRA micro-tile: two vectors of 16 floats
constexpr int64_t kChunkCols = 256;  // columns a tile's gate and up go through at a time (16 kB, in L1)
// 16 floats as the machine's own vectors: one AVX-512 register, two AVX ones, four of SSE or NEON. A plain 64-byte
// GCC vector type is lowered well only where 64-byte registers exist: on AVX2, GCC 12 moved every such value through
// the stack and general registers (vmovq/vpinsrq, 8 bytes at a time). Measured on a 2-core AVX2 EPYC (T = 214 rows,
// 2 threads, plain type -> parts): widen_lowrank [214, 1536] rank 8 1645 -> 261 us, rms_norm_a_grads [214, 576]
// k = 24 1426 -> 291 us, lora_out_grads [214, 1536] rank 8 1123 -> 454 us (with kSumRows and kDotK below).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kLanes = kVecBytes / 4, kParts = 16 / kLanes;
typedef float vpart __attribute__((vector_size(kVecBytes)));
typedef uint16_t u16part __attribute__((vector_size(kVecBytes / 2)));
typedef uint32_t u32part __attribute__((vector_size(kVecBytes)));
struct v16 {
  vpart p[kParts];
};

inline v16 vload(const float* src) {
  v16 v;
  for (int i = 0; i < kParts; ++i) std::memcpy(&v.p[i], src + i * kLanes, sizeof(vpart));
  return v;
}

inline void vstore(float* dst, const v16& v) {
  for (int i = 0; i < kParts; ++i) std::memcpy(dst + i * kLanes, &v.p[i], sizeof(vpart));
}

inline v16& operator+=(v16& a, const v16& b) {
  for (int i = 0; i < kParts; ++i) a.p[i] += b.p[i];
  return a;
}

inline v16 operator*(const v16& a, const v16& b) {
  v16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = a.p[i] * b.p[i];
  return r;
}

inline v16 operator*(float s, const v16& b) {
  v16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = s * b.p[i];
  return r;
}

// 16 bfloat16 values -> floats (exact), as one vector.
inline v16 widen16(const uint16_t* p) {
  v16 f;
  for (int i = 0; i < kParts; ++i) {
    u16part b;
    std::memcpy(&b, p + i * kLanes, sizeof b);
    const u32part u = __builtin_convertvector(b, u32part) << 16;
    std::memcpy(&f.p[i], &u, sizeof u);
  }
  return f;
}

struct LoraPair {
  const uint16_t* pg;
  const uint16_t* pu;
  int64_t ldg, ldu;
  const float* h;
  int64_t hs0, hs1, rg, ru;
  std::vector<float> bgT, buT;  // [r, Fp]
  float s;
  int64_t R, F, Fp;
};

// m float32 [k, N] (any strides) as k rows of Np >= N floats, zeros past N: the layout the LoRA tile sums read (for
// m = Bᵀ of a LoRA B [N, r], B's rows are read in order). Threads split the columns.
std::vector<float> padded_rows(const at::Tensor& m, int64_t Np) {
  const int64_t k = m.size(0), N = m.size(1), ms0 = m.stride(0), ms1 = m.stride(1);
  const float* mp = m.data_ptr<float>();
  std::vector<float> out(static_cast<size_t>(k * Np), 0.0f);
  float* dst = out.data();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, k));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t kk = 0; kk < k; ++kk) dst[kk * Np + c] = mp[kk * ms0 + c * ms1];
    }
  });
  return out;
}

LoraPair lora_pair(const at::Tensor& pg, const at::Tensor& pu, const at::Tensor& h, const at::Tensor& bg,
                   const at::Tensor& bu, double s) {
  for (const at::Tensor* p : {&pg, &pu}) {
    TORCH_CHECK(p->dim() == 2 && p->scalar_type() == at::kBFloat16 && (p->stride(1) == 1 || p->size(1) <= 1),
                "gate and up products must be bfloat16 matrices with contiguous columns, got ", p->sizes(), " ",
                p->scalar_type());
  }
  check_same(pg, pu, "up's product");
  const int64_t R = pg.size(0), F = pg.size(1), Fp = (F + kTileCols - 1) / kTileCols * kTileCols;
  for (const at::Tensor* b : {&bg, &bu}) {
    TORCH_CHECK(b->dim() == 2 && b->size(0) == F && b->scalar_type() == at::kFloat,
                "lora_B must be a float32 [", F, ", r] matrix, got ", b->sizes(), " ", b->scalar_type());
  }
  const int64_t rg = bg.size(1), ru = bu.size(1);
  TORCH_CHECK(h.dim() == 2 && h.size(0) == R && h.size(1) == rg + ru && h.scalar_type() == at::kFloat,
              "h must be a float32 [", R, ", ", rg + ru, "] matrix, got ", h.sizes(), " ", h.scalar_type());
  return LoraPair{reinterpret_cast<const uint16_t*>(pg.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(pu.data_ptr<at::BFloat16>()),
                  pg.stride(0), pu.stride(0), h.data_ptr<float>(), h.stride(0), h.stride(1), rg, ru,
                  padded_rows(bg.t(), Fp), padded_rows(bu.t(), Fp), static_cast<float>(s), R, F, Fp};
}

// Rows a pass of lora_tile_sums keeps in registers: 8 x 32 sums need 16 of AVX-512's 32 registers but 32 of AVX2's 16
// (and 64 of NEON's 32), which spills; with fewer rows a pass they fit and bT's rows are read again from L1 instead.
constexpr int64_t kSumRows = kParts == 1 ? kTileRows : 2;

// out[i, 0 : 32] = Σ_k h[i][k]·bT[k, c0 : c0 + 32] for the tile's rows i (k in order; bT's rows are ldb apart, out's
// ldo), kSumRows x 32 sums held in registers while k runs.
__attribute__((always_inline)) inline void lora_tile_sums(const float* hrows, int64_t rank, const float* bT, int64_t ldb,
                                                          int64_t c0, float* out, int64_t ldo) {
  for (int64_t i0 = 0; i0 < kTileRows; i0 += kSumRows) {
    v16 acc[kSumRows][2];
    for (int64_t i = 0; i < kSumRows; ++i) acc[i][0] = acc[i][1] = v16{};
    for (int64_t k = 0; k < rank; ++k) {
      const v16 b0 = vload(bT + k * ldb + c0), b1 = vload(bT + k * ldb + c0 + 16);
      for (int64_t i = 0; i < kSumRows; ++i) {
        const float hk = hrows[(i0 + i) * rank + k];
        acc[i][0] += hk * b0;
        acc[i][1] += hk * b1;
      }
    }
    for (int64_t i = 0; i < kSumRows; ++i) {
      vstore(out + (i0 + i) * ldo, acc[i][0]);
      vstore(out + (i0 + i) * ldo + 16, acc[i][1]);
    }
  }
}

// Gate, up and act = silu(gate)·up for the row tile starting at r0 (rows past R are skipped): gate and up into
// [kTileRows, Fp] buffers, act into rows F apart; gate = float(product) + s·h·Bᵀ, up likewise. Not inlined: the
// forward and the backward kernel run this one function, so the backward sees the forward's bits.
__attribute__((noinline)) void lora_swiglu_tile(const LoraPair& p, int64_t r0, float* g, float* u, float* act) {
  const int64_t F = p.F, Fp = p.Fp, nr = std::min(kTileRows, p.R - r0);
  std::vector<float> hg(static_cast<size_t>(kTileRows * p.rg)), hu(static_cast<size_t>(kTileRows * p.ru));
  for (int64_t i = 0; i < kTileRows; ++i) {  // the tile's h rows, zeros past R
    const float* hr = p.h + (r0 + i) * p.hs0;
    for (int64_t k = 0; k < p.rg; ++k) hg[static_cast<size_t>(i * p.rg + k)] = i < nr ? hr[k * p.hs1] : 0.0f;
    for (int64_t k = 0; k < p.ru; ++k) hu[static_cast<size_t>(i * p.ru + k)] = i < nr ? hr[(p.rg + k) * p.hs1] : 0.0f;
  }
  const float s = p.s;
  for (int64_t c1 = 0; c1 < Fp; c1 += kChunkCols) {  // the sums of a chunk, then its epilogue while it is in L1
    const int64_t c2 = std::min(Fp, c1 + kChunkCols), ce = std::min(F, c2);
    for (int64_t c0 = c1; c0 < c2; c0 += kTileCols) {
      lora_tile_sums(hg.data(), p.rg, p.bgT.data(), Fp, c0, g + c0, Fp);
      lora_tile_sums(hu.data(), p.ru, p.buT.data(), Fp, c0, u + c0, Fp);
    }
    for (int64_t i = 0; i < nr; ++i) {
      const uint16_t* pgr = p.pg + (r0 + i) * p.ldg;
      const uint16_t* pur = p.pu + (r0 + i) * p.ldu;
      float* gr = g + i * Fp;
      float* ur = u + i * Fp;
      float* ar = act + i * F;
#pragma omp simd
      for (int64_t c = c1; c < ce; ++c) {
        const float gv = from_bf16(pgr[c]) + s * gr[c];
        const float uv = from_bf16(pur[c]) + s * ur[c];
        gr[c] = gv;
        ur[c] = uv;
        ar[c] = gv * sigmoid(gv) * uv;
      }
    }
  }
}

void tile_row_dots(const float* d, int64_t ld, int64_t nr, const float* bT, int64_t ldb, int64_t rank, int64_t F,
                   float* out, int64_t ldo);  // below

// act = silu(gate)·up [R, F] with gate and up rebuilt from their bf16 products and LoRA terms, (when asked) act as
// bfloat16, and (given the next layer's A, a_next [rn, F] with contiguous columns, F a multiple of 16) its rank-space
// rows h_next = act·a_nextᵀ [R, rn] while each tile of act is in cache: down_proj's h, which lowrank_rows took in a
// pass of its own (92 -> ~40 us a SmolLM2 layer at 224 rows, Zen 5). The second and third tensors are empty where not
// asked. Gate and up exist only a tile of rows at a time.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_swiglu_fwd(const at::Tensor& pg, const at::Tensor& pu,
                                                               const at::Tensor& h, const at::Tensor& bg,
                                                               const at::Tensor& bu, double s, bool want_bf16,
                                                               const at::Tensor& a_next) {
  const LoraPair p = lora_pair(pg, pu, h, bg, bu, s);
  const int64_t R = p.R, F = p.F, tiles = (R + kTileRows - 1) / kTileRows;
  const bool next = a_next.numel() > 0;
  TORCH_CHECK(!next || (a_next.dim() == 2 && a_next.size(1) == F && a_next.scalar_type() == at::kFloat &&
                        a_next.stride(1) == 1 && F % 16 == 0),
              "a_next must be a float32 [r, ", F, "] matrix with contiguous columns (", F,
              " a multiple of 16), got ", a_next.sizes(), " ", a_next.scalar_type());
  const int64_t rn = next ? a_next.size(0) : 0, ldn = next ? a_next.stride(0) : 0;
  at::Tensor act = at::empty({R, F}, h.options());
  at::Tensor actb = at::empty({want_bf16 ? R : 0, F}, h.options().dtype(at::kBFloat16));
  at::Tensor hn = at::empty({next ? R : 0, rn}, h.options());
  float* ap = act.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(actb) : nullptr;
  const float* anp = next ? a_next.data_ptr<float>() : nullptr;
  float* hnp = next ? hn.data_ptr<float>() : nullptr;
  at::parallel_for(0, tiles, std::max<int64_t>(1, grain_rows(2 * F) / kTileRows), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(2 * kTileRows * p.Fp));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTileRows, nr = std::min(kTileRows, R - r0);
      float* tile_act = ap + r0 * F;
      lora_swiglu_tile(p, r0, buf.data(), buf.data() + kTileRows * p.Fp, tile_act);
      if (bp != nullptr) {
        uint16_t* br = bp + r0 * F;
#pragma omp simd
        for (int64_t c = 0; c < nr * F; ++c) br[c] = to_bf16(tile_act[c]);
      }
      if (anp != nullptr) tile_row_dots(tile_act, F, nr, anp, ldn, rn, F, hnp + r0 * rn, rn);
    }
  });
  return {act, actb, hn};
}

// The backward of lora_swiglu_fwd for d_act [R, F]: [d_gate | d_up] [R, 2F] in float32 and (when asked) bfloat16, as
// swiglu_bwd gives them, and act again (the forward's bits), which down_proj's dA multiplies.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_swiglu_bwd(const at::Tensor& d_act, const at::Tensor& pg,
                                                               const at::Tensor& pu, const at::Tensor& h,
                                                               const at::Tensor& bg, const at::Tensor& bu, double s,
                                                               bool want_bf16) {
  const LoraPair p = lora_pair(pg, pu, h, bg, bu, s);
  check_rows(d_act, "d_act");
  TORCH_CHECK(d_act.size(0) == p.R && d_act.size(1) == p.F, "d_act has shape ", d_act.sizes(), ", expected [", p.R,
              ", ", p.F, "]");
  const int64_t R = p.R, F = p.F, ldd = d_act.stride(0), tiles = (R + kTileRows - 1) / kTileRows;
  at::Tensor dgu = at::empty({R, 2 * F}, h.options());
  at::Tensor dgub = at::empty({want_bf16 ? R : 0, 2 * F}, h.options().dtype(at::kBFloat16));
  at::Tensor act = at::empty({R, F}, h.options());
  const float* dp = d_act.data_ptr<float>();
  float* op = dgu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(dgub) : nullptr;
  at::parallel_for(0, tiles, std::max<int64_t>(1, grain_rows(2 * F) / kTileRows), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(2 * kTileRows * p.Fp));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTileRows, nr = std::min(kTileRows, R - r0);
      lora_swiglu_tile(p, r0, buf.data(), buf.data() + kTileRows * p.Fp, ap + r0 * F);
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        swiglu_grad_row(dp + r * ldd, buf.data() + i * p.Fp, buf.data() + (kTileRows + i) * p.Fp, F, op + r * 2 * F,
                        bp != nullptr ? bp + r * 2 * F : nullptr);
      }
    }
  });
  return {dgu, dgub, act};
}

// Rows of gate's and up's output gradients a partial sum of their lora_B gradients covers: the sums over rows run
// in these blocks, one thread each, and the blocks' partials are added in block order, so the result does not
// depend on the thread count.
constexpr int64_t kGradBlockRows = 64;

// out[e] = s·Σ_b part[b·stride + e] for e < count, the blocks added in order (b = 0, 1, …): the partial sums of
// kGradBlockRows-row blocks, so the result does not depend on the thread count.
void add_block_partials(const float* part, int64_t blocks, int64_t stride, int64_t count, double s_d, float* out) {
  at::parallel_for(0, count, kGrainElements, [&](int64_t begin, int64_t end) {
    const float s = static_cast<float>(s_d);
    const float* src = part;
    for (int64_t e = begin; e < end; ++e) {
      float v = src[e];
      for (int64_t b = 1; b < blocks; ++b) v += src[b * stride + e];
      out[e] = s * v;
    }
  });
}

// out [cols, rows] (contiguous) = s·Σ_b part[b·stride + r·cols + c]: add_block_partials of a [rows, cols] partial,
// written transposed, in the layout of the parameter it is the gradient of (a LoRA B [out, r]): autograd then keeps
// the tensor as it is where it copied a transposed view into a new gradient (210 copies, ~2 ms a SmolLM2 step).
void add_block_partials_t(const float* part, int64_t blocks, int64_t stride, int64_t rows, int64_t cols, double s_d,
                          float* out) {
  at::parallel_for(0, cols, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, rows)),
                   [&](int64_t begin, int64_t end) {
                     const float s = static_cast<float>(s_d);
                     for (int64_t c = begin; c < end; ++c) {
                       for (int64_t r = 0; r < rows; ++r) {
                         float v = part[r * cols + c];
                         for (int64_t b = 1; b < blocks; ++b) v += part[b * stride + r * cols + c];
                         out[c * rows + r] = s * v;
                       }
                     }
                   });
}

// acc[k][c] += Σ_i hk[i][k]·d[i][c] for the tile's rows i < nr (hk: kTileRows rows of `rank` floats, d: rows ld
// floats apart) and columns c < F, a multiple of 16; acc rows are lda floats apart. The rows' 16 columns are loaded
// once and feed every k. With `first` (a block's first tile), acc is written instead: its partials need no zeroing
// pass (46 us of at::zeros a SmolLM2 MLP backward, Zen 5).
void accumulate_tile_outer(const float* d, int64_t ld, int64_t nr, const float* hk, int64_t rank, float* acc,
                           int64_t lda, int64_t F, bool first) {
  for (int64_t c = 0; c < F; c += 16) {
    v16 dv[kTileRows];
    for (int64_t i = 0; i < kTileRows; ++i) {
      if (i < nr) {
        dv[i] = vload(d + i * ld + c);
      } else {
        dv[i] = v16{};
      }
    }
    for (int64_t k = 0; k < rank; ++k) {
      v16 a = first ? v16{} : vload(acc + k * lda + c);
      for (int64_t i = 0; i < nr; ++i) a += hk[i * rank + k] * dv[i];
      vstore(acc + k * lda + c, a);
    }
  }
}

// Sum of a vector's 16 lanes, in lane order.
inline float lane_sum(const v16& a) {
  float lanes[16];
  vstore(lanes, a);
  float sum = 0.0f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

// k a pass of tile_row_dots sums: two rows of 8 k are 16 vectors of 16 lanes, registers AVX-512 has and AVX2 or NEON
// do not (see kSumRows).
constexpr int64_t kDotK = kParts == 1 ? 8 : 2;

// out[i][k] = Σ_c d[i][c]·bT[k][c] for the tile's rows i < nr (d rows ld floats apart, out rows ldo apart), k < rank
// (bT rows ldb floats apart), c < F (a multiple of 16): two rows and kDotK k at a time, 16 lanes each, the lanes
// then summed in order.
void tile_row_dots(const float* d, int64_t ld, int64_t nr, const float* bT, int64_t ldb, int64_t rank, int64_t F,
                   float* out, int64_t ldo) {
  for (int64_t i0 = 0; i0 < nr; i0 += 2) {
    const bool two = i0 + 1 < nr;
    const float* d0 = d + i0 * ld;
    const float* d1 = two ? d0 + ld : d0;
    for (int64_t k0 = 0; k0 < rank; k0 += kDotK) {
      const int64_t kn = std::min<int64_t>(kDotK, rank - k0);
      v16 a0[kDotK] = {}, a1[kDotK] = {};
      for (int64_t c = 0; c < F; c += 16) {
        const v16 x0 = vload(d0 + c), x1 = vload(d1 + c);
#pragma GCC unroll 8
        for (int64_t kk = 0; kk < kDotK; ++kk) {
          if (kk < kn) {
            const v16 b = vload(bT + (k0 + kk) * ldb + c);
            a0[kk] += x0 * b;
            a1[kk] += x1 * b;
          }
        }
      }
      for (int64_t kk = 0; kk < kn; ++kk) {
        out[i0 * ldo + k0 + kk] = lane_sum(a0[kk]);
        if (two) out[(i0 + 1) * ldo + k0 + kk] = lane_sum(a1[kk]);
      }
    }
  }
}

// lora_swiglu_bwd's bf16 [d_gate | d_up], with the LoRA gradients of gate, up and down from the same pass, while each
// tile's fp32 gradients and act are in cache (they are never written out): g [R, rg + ru] = [d_gate·B_g | d_up·B_u]
// (the rank-space gradient the input gradient and dA multiply), dB_g [F, rg] = s·Σ_rows d_gate ⊗ h_g, dB_u likewise,
// and down's dA [rd, F] = s·Σ_rows g_d ⊗ act for down's rank-space rows g_d [R, rd] (any strides), where a thin
// [rd, R]·[R, F] product read act again (0.19 ms a SmolLM2 layer at 224 rows, MKL, Zen 5).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_swiglu_bwd_grads(
    const at::Tensor& d_act, const at::Tensor& pg, const at::Tensor& pu, const at::Tensor& h, const at::Tensor& bg,
    const at::Tensor& bu, const at::Tensor& g_d, double s_d) {
  const LoraPair p = lora_pair(pg, pu, h, bg, bu, s_d);
  check_rows(d_act, "d_act");
  TORCH_CHECK(d_act.size(0) == p.R && d_act.size(1) == p.F, "d_act has shape ", d_act.sizes(), ", expected [", p.R,
              ", ", p.F, "]");
  TORCH_CHECK(p.F % 16 == 0, "the intermediate size must be a multiple of 16, got ", p.F);
  TORCH_CHECK(g_d.dim() == 2 && g_d.size(0) == p.R && g_d.size(1) > 0 && g_d.scalar_type() == at::kFloat,
              "g_d must be a float32 [", p.R, ", r] matrix, got ", g_d.sizes(), " ", g_d.scalar_type());
  const int64_t R = p.R, F = p.F, rg = p.rg, ru = p.ru, rk = rg + ru, rd = g_d.size(1), ldd = d_act.stride(0);
  const int64_t gds0 = g_d.stride(0), gds1 = g_d.stride(1), rall = rk + rd;
  const int64_t blocks = (R + kGradBlockRows - 1) / kGradBlockRows;
  at::Tensor dgub = at::empty({R, 2 * F}, h.options().dtype(at::kBFloat16));
  at::Tensor g = at::empty({R, rk}, h.options());
  at::Tensor part = at::empty({blocks, rall, F}, h.options());  // each block's Σ h ⊗ d: gate's, up's, down's ranks
  const float* dp = d_act.data_ptr<float>();
  const float* gdp = g_d.data_ptr<float>();
  float* gp = g.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  uint16_t* bp = bf16_data(dgub);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(2 * kTileRows * p.Fp));
    std::vector<float> dgu(static_cast<size_t>(kTileRows * 2 * F));  // the tile's [d_gate | d_up] rows
    std::vector<float> act(static_cast<size_t>(kTileRows * F));  // the tile's act rows
    std::vector<float> hg(static_cast<size_t>(kTileRows * rg)), hu(static_cast<size_t>(kTileRows * ru));
    std::vector<float> hd(static_cast<size_t>(kTileRows * rd));
    for (int64_t blk = begin; blk < end; ++blk) {
      float* acc = pp + blk * rall * F;
      for (int64_t r0 = blk * kGradBlockRows; r0 < std::min(R, (blk + 1) * kGradBlockRows); r0 += kTileRows) {
        const int64_t nr = std::min(kTileRows, R - r0);
        const bool first = r0 == blk * kGradBlockRows;
        lora_swiglu_tile(p, r0, buf.data(), buf.data() + kTileRows * p.Fp, act.data());
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = r0 + i;
          float* row = dgu.data() + i * 2 * F;
          swiglu_grad_row(dp + r * ldd, buf.data() + i * p.Fp, buf.data() + (kTileRows + i) * p.Fp, F, row,
                          bp + r * 2 * F);
          const float* hr = p.h + r * p.hs0;
          for (int64_t k = 0; k < rg; ++k) hg[static_cast<size_t>(i * rg + k)] = hr[k * p.hs1];
          for (int64_t k = 0; k < ru; ++k) hu[static_cast<size_t>(i * ru + k)] = hr[(rg + k) * p.hs1];
          for (int64_t k = 0; k < rd; ++k) hd[static_cast<size_t>(i * rd + k)] = gdp[r * gds0 + k * gds1];
        }
        tile_row_dots(dgu.data(), 2 * F, nr, p.bgT.data(), p.Fp, rg, F, gp + r0 * rk, rk);
        tile_row_dots(dgu.data() + F, 2 * F, nr, p.buT.data(), p.Fp, ru, F, gp + r0 * rk + rg, rk);
        accumulate_tile_outer(dgu.data(), 2 * F, nr, hg.data(), rg, acc, F, F, first);
        accumulate_tile_outer(dgu.data() + F, 2 * F, nr, hu.data(), ru, acc + rg * F, F, F, first);
        accumulate_tile_outer(act.data(), F, nr, hd.data(), rd, acc + rk * F, F, F, first);
      }
    }
  });
  at::Tensor db_g = at::empty({F, rg}, h.options()), db_u = at::empty({F, ru}, h.options());
  at::Tensor da_d = at::empty({rd, F}, h.options());
  add_block_partials_t(pp, blocks, rall * F, rg, F, s_d, db_g.data_ptr<float>());
  add_block_partials_t(pp + rg * F, blocks, rall * F, ru, F, s_d, db_u.data_ptr<float>());
  add_block_partials(pp + rk * F, blocks, rall * F, rd * F, s_d, da_d.data_ptr<float>());
  return {dgub, da_d, g, db_g, db_u};
}

// The LoRA gradients of layers from their output gradients dys[i] [R, out_i] (float32, contiguous columns, out_i a
// multiple of 16) and the stacked h [R, Σr] (any strides), in one pass over each gradient row: the rows side by side
// in bfloat16 when asked (the input-gradient GEMM's operand; empty otherwise), g [R, Σr] = [dy_i·B_i …] and each
// dB_i [out_i, r_i] = s·Σ_rows dy_i ⊗ h_i, summed over kGradBlockRows-row blocks whose partials add in block order.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_out_grads(at::TensorList dys, const at::Tensor& h,
                                                                           at::TensorList bs, double s_d,
                                                                           bool want_bf16) {
  const int64_t n = static_cast<int64_t>(dys.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(bs.size()) == n, "one lora_B per output gradient: got ", dys.size(),
              " gradients and ", bs.size(), " matrices");
  const int64_t R = dys[0].size(0);
  std::vector<int64_t> outs(n), ranks(n), col0(n + 1, 0), rk0(n + 1, 0);
  std::vector<std::vector<float>> bT(n);
  for (int64_t i = 0; i < n; ++i) {
    check_rows(dys[i], "dy");
    TORCH_CHECK(dys[i].size(0) == R, "every output gradient must have ", R, " rows, got ", dys[i].sizes());
    outs[i] = dys[i].size(1);
    TORCH_CHECK(outs[i] % 16 == 0, "output widths must be multiples of 16, got ", outs[i]);
    TORCH_CHECK(bs[i].dim() == 2 && bs[i].size(0) == outs[i] && bs[i].size(1) > 0 && bs[i].scalar_type() == at::kFloat,
                "lora_B must be a float32 [", outs[i], ", r] matrix, got ", bs[i].sizes(), " ", bs[i].scalar_type());
    ranks[i] = bs[i].size(1);
    bT[i] = padded_rows(bs[i].t(), outs[i]);
    col0[i + 1] = col0[i] + outs[i];
    rk0[i + 1] = rk0[i] + ranks[i];
  }
  const int64_t cols = col0[n], rk = rk0[n];
  TORCH_CHECK(h.dim() == 2 && h.size(0) == R && h.size(1) == rk && h.scalar_type() == at::kFloat,
              "h must be a float32 [", R, ", ", rk, "] matrix, got ", h.sizes(), " ", h.scalar_type());
  const int64_t blocks = (R + kGradBlockRows - 1) / kGradBlockRows;
  at::Tensor packed = at::empty({want_bf16 ? R : 0, cols}, h.options().dtype(at::kBFloat16));
  at::Tensor g = at::empty({R, rk}, h.options());
  at::Tensor part = at::empty({blocks, rk * cols}, h.options());  // per block: member i's [r_i, out_i] at rk0·cols..
  std::vector<const float*> dp(n);
  std::vector<int64_t> ld(n);
  for (int64_t i = 0; i < n; ++i) {
    dp[i] = dys[i].data_ptr<float>();
    ld[i] = dys[i].stride(0);
  }
  const float* hp = h.data_ptr<float>();
  const int64_t hs0 = h.stride(0), hs1 = h.stride(1);
  float* gp = g.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  uint16_t* bp = want_bf16 ? bf16_data(packed) : nullptr;
  // member i's partial starts at rk0[i]·cols floats into a block's part (room for [r_i, out_i])
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> hk(static_cast<size_t>(kTileRows * rk));
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t r0 = blk * kGradBlockRows; r0 < std::min(R, (blk + 1) * kGradBlockRows); r0 += kTileRows) {
        const int64_t nr = std::min(kTileRows, R - r0);
        for (int64_t i = 0; i < n; ++i) {
          const float* d = dp[i] + r0 * ld[i];
          const int64_t out = outs[i], r = ranks[i], ldi = ld[i];
          if (bp != nullptr) {
            for (int64_t t = 0; t < nr; ++t) {
              const float* src = d + t * ldi;
              uint16_t* dst = bp + (r0 + t) * cols + col0[i];
#pragma omp simd
              for (int64_t c = 0; c < out; ++c) dst[c] = to_bf16(src[c]);
            }
          }
          tile_row_dots(d, ldi, nr, bT[i].data(), out, r, out, gp + r0 * rk + rk0[i], rk);
          for (int64_t t = 0; t < nr; ++t) {
            for (int64_t k = 0; k < r; ++k) hk[static_cast<size_t>(t * r + k)] = hp[(r0 + t) * hs0 + (rk0[i] + k) * hs1];
          }
          accumulate_tile_outer(d, ldi, nr, hk.data(), r, pp + blk * rk * cols + rk0[i] * cols, out, out,
                                r0 == blk * kGradBlockRows);
        }
      }
    }
  });
  std::vector<at::Tensor> dbs(n);
  for (int64_t i = 0; i < n; ++i) {
    dbs[i] = at::empty({outs[i], ranks[i]}, h.options());
    add_block_partials_t(pp + rk0[i] * cols, blocks, rk * cols, ranks[i], outs[i], s_d, dbs[i].data_ptr<float>());
  }
  return {packed, g, dbs};
}

// The rows of a tile: where its nr rows start and their stride.
struct TileRows {
  const float* p;
  int64_t ld;
};

void check_any_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, name, " must have contiguous columns (stride(1) == 1)");
}

// x's nr rows from row r0 (float32 read in place, or bfloat16 widened into buf, kTileRows rows of C floats: exact).
TileRows tile_rows(const at::Tensor& x, int64_t r0, int64_t nr, float* buf) {
  const int64_t C = x.size(1), ldx = x.stride(0);
  if (x.scalar_type() == at::kFloat) return {x.data_ptr<float>() + r0 * ldx, ldx};
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r0 * ldx;
  for (int64_t i = 0; i < nr; ++i) {
    float* o = buf + i * C;
    const uint16_t* xr = xp + i * ldx;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = from_bf16(xr[c]);
  }
  return {buf, C};
}

// dA [k, C] = s·Σ_rows g[row] ⊗ y[row] for g [R, k] (float32, any strides) and the rows y that tile(r0, nr, buf)
// gives a tile at a time (read in place, or written into buf: kTileRows rows of C floats, the thread's own), never a
// whole [R, C] copy: the LoRA A gradient of the layers reading y. C must be a multiple of 16; the sums over rows run in
// kGradBlockRows-row blocks added in block order, so the bits do not depend on the thread count.
template <typename Tile>
at::Tensor a_grads_by_tiles(int64_t R, int64_t C, const at::Tensor& g, double s_d, const Tile& tile) {
  TORCH_CHECK(C % 16 == 0, "the row width must be a multiple of 16, got ", C);
  TORCH_CHECK(g.dim() == 2 && g.size(0) == R && g.size(1) > 0 && g.scalar_type() == at::kFloat,
              "g must be a float32 [", R, ", k] matrix, got ", g.sizes(), " ", g.scalar_type());
  const int64_t k = g.size(1), gs0 = g.stride(0), gs1 = g.stride(1);
  const int64_t blocks = (R + kGradBlockRows - 1) / kGradBlockRows;
  at::Tensor part = at::empty({blocks, k * C}, g.options());
  const float* gp = g.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(kTileRows * C)), hk(static_cast<size_t>(kTileRows * k));
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int64_t r0 = blk * kGradBlockRows; r0 < std::min(R, (blk + 1) * kGradBlockRows); r0 += kTileRows) {
        const int64_t nr = std::min(kTileRows, R - r0);
        const TileRows y = tile(r0, nr, buf.data());
        for (int64_t i = 0; i < nr; ++i) {
          for (int64_t kk = 0; kk < k; ++kk) hk[static_cast<size_t>(i * k + kk)] = gp[(r0 + i) * gs0 + kk * gs1];
        }
        accumulate_tile_outer(y.p, y.ld, nr, hk.data(), k, pp + blk * k * C, C, C, r0 == blk * kGradBlockRows);
      }
    }
  });
  at::Tensor out = at::empty({k, C}, g.options());
  add_block_partials(pp, blocks, k * C, k * C, s_d, out.data_ptr<float>());
  return out;
}

// dA [k, C] = s·Σ_rows g[row] ⊗ y[row] for y = rms_norm_apply(x, rstd, w) (the same expression, so the same bits),
// recomputed a tile of rows at a time and never written out: the LoRA A gradients of the layers that read the normed
// rows, g [R, k] their rank-space gradient (any strides).
at::Tensor rms_norm_a_grads(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& w, const at::Tensor& g,
                            double s_d) {
  check_rows(x, "x");
  const int64_t R = x.size(0), C = x.size(1), ldx = x.stride(0);
  check_weight(w, C);
  check_rstd(rstd, R);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  return a_grads_by_tiles(R, C, g, s_d, [&](int64_t r0, int64_t nr, float* buf) {
    const float* wl = wp;
    for (int64_t i = 0; i < nr; ++i) normed_row(xp + (r0 + i) * ldx, rp[r0 + i], wl, buf + i * C, C);
    return TileRows{buf, C};
  });
}

// dA [k, C] = s·Σ_rows g[row] ⊗ x[row] for rows x [R, C] (float32, or bfloat16 widened a tile at a time) and their
// rank-space gradient g [R, k] (any strides): a LoRA layer's A gradient, where a thin [k, R]·[R, C] product (MKL) read
// a widened copy of x (o_proj's bf16 rows).
at::Tensor lowrank_a_grads(const at::Tensor& x, const at::Tensor& g, double s_d) {
  check_any_rows(x, "x");
  return a_grads_by_tiles(x.size(0), x.size(1), g, s_d,
                          [&](int64_t r0, int64_t nr, float* buf) { return tile_rows(x, r0, nr, buf); });
}

// h [R, k] = x·aᵀ for rows x [R, C] (float32, contiguous columns, any row stride) and a [k, C] (float32, contiguous
// columns, any row stride): the rank-space rows of LoRA layers reading x (a: their A, stacked), each of the k dot
// products summed in 16 lanes over C (a multiple of 16), the lanes then in order. Every row is one thread's.
// h [R, k] = x·aᵀ for rows x [R, C] (float32, or bfloat16 widened a tile at a time: the bf16 attention output o_proj
// reads, no widened copy; contiguous columns, any row stride) and a [k, C] (float32, contiguous columns).
at::Tensor lowrank_rows(const at::Tensor& x, const at::Tensor& a) {
  check_any_rows(x, "x");
  check_rows(a, "a");
  const int64_t R = x.size(0), C = x.size(1), k = a.size(0), lda = a.stride(0);
  TORCH_CHECK(a.size(1) == C && k > 0, "a must be a [k, ", C, "] matrix with k > 0, got ", a.sizes());
  TORCH_CHECK(C % 16 == 0, "the row width must be a multiple of 16, got ", C);
  at::Tensor h = at::empty({R, k}, a.options());
  const float* ap = a.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const int64_t tiles = (R + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, std::max<int64_t>(1, grain_rows(C) / kTileRows), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(x.scalar_type() == at::kFloat ? 0 : static_cast<size_t>(kTileRows * C));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTileRows, nr = std::min(kTileRows, R - r0);
      const TileRows xr = tile_rows(x, r0, nr, buf.data());
      tile_row_dots(xr.p, xr.ld, nr, ap, lda, k, C, hp + r0 * k, k);
    }
  });
  return h;
}


// y [M, N] bfloat16 = x·wᵀ for a few rows x [M, K] (float32 rounded to bfloat16 as the bf16 GEMM takes them, or
// bfloat16; contiguous columns, any row stride) and a bf16 weight w [N, K] (contiguous): what generation runs per token
// (M = 1), where oneDNN's GEMM repacked the whole weight every call and streamed ~8 GB/s on the Zen 5 instead of the
// ~25 the memory gives. Each weight row is read once for all M rows; its dot products are summed in fp32 over 16
// lanes in two interleaved chains (even and odd 16-column blocks), then the lanes in order, the K % 16 tail, and
// rounded to bfloat16 once: what the GEMM returns, up to the order of its fp32 sums. Threads split the weight's rows;
// every output is one thread's, in one order.
constexpr int64_t kSmallRows = 8;

at::Tensor small_rows_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be a 2-D tensor with contiguous columns, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "w must be a contiguous bfloat16 matrix, got ", w.scalar_type(), " ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), ldx = x.stride(0);
  TORCH_CHECK(w.size(1) == K, "w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(M >= 1 && M <= kSmallRows, "small_rows_bf16 takes 1 to ", kSmallRows, " rows, got ", M);
  const int64_t K16 = K / 16 * 16;
  std::vector<float> xs(static_cast<size_t>(M * K));  // x as bfloat16 values, widened again: the GEMM's operand
  if (x.scalar_type() == at::kFloat) {
    const float* xf = x.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) xs[static_cast<size_t>(m * K + k)] = from_bf16(to_bf16(xf[m * ldx + k]));
    }
  } else {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) xs[static_cast<size_t>(m * K + k)] = from_bf16(xb[m * ldx + k]);
    }
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* yp = bf16_data(y);
  const float* xsp = xs.data();
  at::parallel_for(0, N, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, K)), [&](int64_t begin, int64_t end) {
    const float* xl = xsp;  // locals, not captures (see the header)
    const int64_t Ml = M, Kl = K, K16l = K16, Nl = N;
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* wr = wp + n * Kl;
      v16 a0[kSmallRows], a1[kSmallRows];
      for (int64_t m = 0; m < Ml; ++m) a0[m] = a1[m] = v16{};
      int64_t k = 0;
      for (; k + 32 <= K16l; k += 32) {
        const v16 w0 = widen16(wr + k), w1 = widen16(wr + k + 16);
        for (int64_t m = 0; m < Ml; ++m) {
          a0[m] += vload(xl + m * Kl + k) * w0;
          a1[m] += vload(xl + m * Kl + k + 16) * w1;
        }
      }
      if (k < K16l) {
        const v16 w0 = widen16(wr + k);
        for (int64_t m = 0; m < Ml; ++m) a0[m] += vload(xl + m * Kl + k) * w0;
      }
      for (int64_t m = 0; m < Ml; ++m) {
        a0[m] += a1[m];
        float sum = lane_sum(a0[m]);
        for (int64_t t = K16l; t < Kl; ++t) sum += xl[m * Kl + t] * from_bf16(wr[t]);
        yp[m * Nl + n] = to_bf16(sum);
      }
    }
  });
  return y;
}

// Per-row symmetric int8 quantization of float32 rows a [R, K] (contiguous columns, any row stride), each row first
// multiplied by the column scales c [K] when c is given (the input gradient folds the weight's per-channel scales into
// dy): scale = max(absmax(row), 1e-30) / 127 and q = clamp(round_half_even(row / scale), ±127), what
// _quant.quantize_rows computes with torch's ops (abs, amax, clamp, two divisions, round, clamp, a cast: ten passes
// over memory, each its own dispatch), in one pass that reads each row once more from L1. The division is IEEE's,
// as torch's; rounding to the nearest even integer adds and subtracts 1.5·2^23 (|row / scale| <= 127 + an ulp, so the
// sum is exact but for that rounding). A row holding a NaN or an infinity gets a NaN scale and q = 0.
std::tuple<at::Tensor, at::Tensor> quantize_rows_i8(const at::Tensor& a, const at::Tensor& c) {
  check_rows(a, "a");
  TORCH_CHECK(a.scalar_type() == at::kFloat, "a must be float32, got ", a.scalar_type());
  const int64_t R = a.size(0), K = a.size(1), lda = a.stride(0);
  const bool has_c = c.numel() > 0;
  TORCH_CHECK(!has_c || (c.dim() == 1 && c.size(0) == K && c.scalar_type() == at::kFloat && c.is_contiguous()),
              "c must be a contiguous float32 vector of ", K, " elements, got ", c.sizes(), " ", c.scalar_type());
  at::Tensor q = at::empty({R, K}, a.options().dtype(at::kChar));
  at::Tensor scale = at::empty({R, 1}, a.options());
  if (R == 0) return {q, scale};
  const float* ap = a.data_ptr<float>();
  const float* cp = has_c ? c.data_ptr<float>() : nullptr;
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, R, grain_rows(K), [&](int64_t begin, int64_t end) {
    const int64_t Kl = K;
    const float* cl = cp;
    std::vector<float> buf(static_cast<size_t>(cl != nullptr ? Kl : 0));
    for (int64_t r = begin; r < end; ++r) {
      const float* src = ap + r * lda;
      if (cl != nullptr) {
        float* b = buf.data();
#pragma omp simd
        for (int64_t k = 0; k < Kl; ++k) b[k] = src[k] * cl[k];
        src = b;
      }
      float m = 0.0f, probe = 0.0f;  // probe: NaN when the row holds a NaN or an infinity
#pragma omp simd reduction(max : m) reduction(+ : probe)
      for (int64_t k = 0; k < Kl; ++k) {
        const float v = std::fabs(src[k]);
        m = v > m ? v : m;
        probe += src[k] - src[k];
      }
      const float sc = probe == probe ? std::max(m, 1e-30f) / 127.0f : std::numeric_limits<float>::quiet_NaN();
      sp[r] = sc;
      int8_t* qr = qp + r * Kl;
      constexpr float kRound = 12582912.0f;  // 1.5·2^23: v + it - it is v rounded to the nearest even integer
#pragma omp simd
      for (int64_t k = 0; k < Kl; ++k) {
        float v = src[k] / sc;
        v = (v + kRound) - kRound;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        v = v == v ? v : 0.0f;
        qr[k] = static_cast<int8_t>(static_cast<int32_t>(v));
      }
    }
  });
  return {q, scale};
}

// y [R, N] float32 = (float(acc)·s_row)·c (+ bias) from an int8 GEMM's int32 sums acc [R, N] (contiguous), the rows'
// quantization scales s [R, 1] and, when given, per-column scales c [N] (a w8a8 weight's output channels) and a bias
// [N]: the products in the order torch's .float().mul_(s).mul_(c).add_(bias) takes them, one pass over memory.
at::Tensor int8_rescale(const at::Tensor& acc, const at::Tensor& s, const at::Tensor& c, const at::Tensor& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "acc must be a contiguous int32 matrix, got ", acc.sizes(), " ", acc.scalar_type());
  const int64_t R = acc.size(0), N = acc.size(1);
  TORCH_CHECK(s.numel() == R && s.scalar_type() == at::kFloat && s.is_contiguous(),
              "s must hold one float32 per row (", R, "), got ", s.sizes(), " ", s.scalar_type());
  for (const at::Tensor* v : {&c, &bias}) {
    TORCH_CHECK(v->numel() == 0 || (v->dim() == 1 && v->size(0) == N && v->scalar_type() == at::kFloat &&
                                    v->is_contiguous()),
                "column scales and bias must be contiguous float32 vectors of ", N, " elements, got ", v->sizes(),
                " ", v->scalar_type());
  }
  at::Tensor y = at::empty({R, N}, s.options());
  if (R == 0 || N == 0) return y;
  const int32_t* ip = acc.data_ptr<int32_t>();
  const float* spp = s.data_ptr<float>();
  const float* cp = c.numel() > 0 ? c.data_ptr<float>() : nullptr;
  const float* bp = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, grain_rows(N), [&](int64_t begin, int64_t end) {
    const int64_t Nl = N;
    const float* cl = cp;
    const float* bl = bp;
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ir = ip + r * Nl;
      float* yr = yp + r * Nl;
      const float sr = spp[r];
      if (cl != nullptr) {
#pragma omp simd
        for (int64_t n = 0; n < Nl; ++n) yr[n] = static_cast<float>(ir[n]) * sr * cl[n];
      } else {
#pragma omp simd
        for (int64_t n = 0; n < Nl; ++n) yr[n] = static_cast<float>(ir[n]) * sr;
      }
      if (bl != nullptr) {  // a pass of its own: in the product's loop the compiler fuses the add into an FMA
#pragma omp simd
        for (int64_t n = 0; n < Nl; ++n) yr[n] += bl[n];
      }
    }
  });
  return y;
}

// out [R, N] float32 = (float(prod) + bias) + s·(h·m): a bf16 GEMM's product widened with a rank-k term added in the
// same pass, one read of the product and one write of the result (a LoRA layer's output, s·h·Bᵀ, or its input
// gradient, s·g·A) where torch widens, then adds the term through a thin fp32 GEMM that reads and writes [R, N] again.
// prod: bfloat16 [R, N] with contiguous columns; h: float32 [R, k] and m: float32 [k, N], any strides; bias: float32
// [N] or empty. Each element's k products are summed in order k = 0, 1, ..., then scaled and added once.
at::Tensor widen_lowrank(const at::Tensor& prod, const at::Tensor& h, const at::Tensor& m, const at::Tensor& bias,
                         double s_d) {
  TORCH_CHECK(prod.dim() == 2 && prod.scalar_type() == at::kBFloat16 && (prod.stride(1) == 1 || prod.size(1) <= 1),
              "prod must be a bfloat16 matrix with contiguous columns, got ", prod.sizes(), " ", prod.scalar_type());
  const int64_t R = prod.size(0), N = prod.size(1), ldp = prod.stride(0);
  TORCH_CHECK(h.dim() == 2 && h.size(0) == R && h.size(1) > 0 && h.scalar_type() == at::kFloat,
              "h must be a float32 [", R, ", k] matrix with k > 0, got ", h.sizes(), " ", h.scalar_type());
  const int64_t k = h.size(1);
  TORCH_CHECK(m.dim() == 2 && m.size(0) == k && m.size(1) == N && m.scalar_type() == at::kFloat,
              "m must be a float32 [", k, ", ", N, "] matrix, got ", m.sizes(), " ", m.scalar_type());
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.dim() == 1 && bias.size(0) == N && bias.scalar_type() == at::kFloat &&
                            bias.is_contiguous()),
              "bias must be a contiguous float32 vector of ", N, " elements, got ", bias.sizes(), " ",
              bias.scalar_type());
  at::Tensor out = at::empty({R, N}, h.options());
  if (R == 0 || N == 0) return out;
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(prod.data_ptr<at::BFloat16>());
  const float* hp = h.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t hs0 = h.stride(0), hs1 = h.stride(1), ms0 = m.stride(0), ms1 = m.stride(1);
  const int64_t row_tiles = (R + kTileRows - 1) / kTileRows, col_tiles = (N + kTileCols - 1) / kTileCols;
  const bool m_direct = ms1 == 1 && N % kTileCols == 0;  // m's rows hold whole tiles: the sums read m itself
  const int64_t Np = col_tiles * kTileCols, ldm = m_direct ? ms0 : Np;
  const std::vector<float> padded = m_direct ? std::vector<float>() : padded_rows(m, Np);
  const float* mrows = m_direct ? mp : padded.data();
  std::vector<float> bias_row(static_cast<size_t>(Np), 0.0f);  // + 0 without a bias: exact
  for (int64_t c = 0; c < N && bp != nullptr; ++c) bias_row[static_cast<size_t>(c)] = bp[c];
  const float s = static_cast<float>(s_d);
  at::parallel_for(0, row_tiles, std::max<int64_t>(1, grain_rows(N) / kTileRows), [&](int64_t begin, int64_t end) {
    float hrows[kTileRows * 64];
    std::vector<float> hbuf;
    float* hr = hrows;
    if (k > 64) {
      hbuf.resize(static_cast<size_t>(kTileRows * k));
      hr = hbuf.data();
    }
    alignas(64) float acc[kTileRows * kTileCols];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTileRows, nr = std::min(kTileRows, R - r0);
      for (int64_t i = 0; i < kTileRows; ++i) {  // the tile's h rows, zeros past R
        for (int64_t kk = 0; kk < k; ++kk) hr[i * k + kk] = i < nr ? hp[(r0 + i) * hs0 + kk * hs1] : 0.0f;
      }
      for (int64_t c0 = 0; c0 < Np; c0 += kTileCols) {
        lora_tile_sums(hr, k, mrows, ldm, c0, acc, kTileCols);
        const int64_t nc = std::min(kTileCols, N - c0);
        const float* br = bias_row.data() + c0;
        for (int64_t i = 0; i < nr; ++i) {
          const uint16_t* pr = pp + (r0 + i) * ldp + c0;
          const float* ar = acc + i * kTileCols;
          float* orow = op + (r0 + i) * N + c0;
          if (nc == kTileCols) {  // a whole tile: vectors
            for (int64_t half = 0; half < kTileCols; half += 16) {
              v16 y = widen16(pr + half);
              y += vload(br + half);
              y += s * vload(ar + half);
              vstore(orow + half, y);
            }
          } else {
            for (int64_t c = 0; c < nc; ++c) orow[c] = (from_bf16(pr[c]) + br[c]) + s * ar[c];
          }
        }
      }
    }
  });
  return out;
}

inline void put(uint16_t* p, float v) { *p = to_bf16(v); }
inline void put(float* p, float v) { *p = v; }
inline float get(uint16_t v) { return from_bf16(v); }
inline float get(float v) { return v; }

// RoPE of x [B, T, H, D] (float32, any strides with contiguous D) into contiguous [B, H, T, D] rows y (float32, or
// bfloat16 rounded once): with halves x1, x2 and the tables' rows c, s at position t, y1 = x1·c1 − x2·s1 and
// y2 = x2·c2 + x1·s2.
template <typename Out>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, Out* yp) {
  const int64_t H = x.size(2), T = x.size(1), D = x.size(3), half = D / 2, rows = x.size(0) * H * T;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // i = (b·H + h)·T + t: output row i
      const int64_t t = i % T, h = (i / T) % H, b = i / (T * H);
      const float* xr = xp + b * sb + t * st + h * sh;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      Out* yr = yp + i * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        put(yr + d, xr[d] * c[d] - xr[d + half] * s[d]);
        put(yr + d + half, xr[d + half] * c[d + half] + xr[d] * s[d + half]);
      }
    }
  });
}

at::Tensor rope_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool bf16) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.stride(3) == 1,
              "x must be a float32 [B, T, H, D] tensor with contiguous D, got ", x.sizes(), " ", x.scalar_type());
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "head dim must be even, got ", D);
  check_tables(cos, sin, T, D);
  at::Tensor y = at::empty({B, H, T, D}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (bf16) {
    rope_rows(x, cos, sin, bf16_data(y));
  } else {
    rope_rows(x, cos, sin, y.data_ptr<float>());
  }
  return y;
}

// The gradient of rope_fwd for g [B, H, T, D] (contiguous, bfloat16 or float32): float32 [B, T, H, D], contiguous,
// with dx1 = g1·c1 + g2·s2 and dx2 = g2·c2 − g1·s1.
template <typename In>
void rope_grad_rows(const In* gp, const at::Tensor& cos, const at::Tensor& sin, int64_t B, int64_t H, int64_t T,
                    int64_t D, float* dp) {
  const int64_t half = D / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, B * H * T, grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // i = (b·H + h)·T + t: gradient row i
      const int64_t t = i % T, h = (i / T) % H, b = i / (T * H);
      const In* gr = gp + i * D;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      float* dr = dp + ((b * T + t) * H + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float g1 = get(gr[d]), g2 = get(gr[d + half]);
        dr[d] = g1 * c[d] + g2 * s[d + half];
        dr[d + half] = g2 * c[d + half] - g1 * s[d];
      }
    }
  });
}

at::Tensor rope_bwd(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(g.dim() == 4 && (g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kFloat) && g.is_contiguous(),
              "g must be a contiguous bfloat16 or float32 [B, H, T, D] tensor, got ", g.sizes(), " ", g.scalar_type());
  const int64_t B = g.size(0), H = g.size(1), T = g.size(2), D = g.size(3);
  TORCH_CHECK(D % 2 == 0, "head dim must be even, got ", D);
  check_tables(cos, sin, T, D);
  at::Tensor dx = at::empty({B, T, H, D}, g.options().dtype(at::kFloat));
  if (g.scalar_type() == at::kBFloat16) {
    rope_grad_rows(reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>()), cos, sin, B, H, T, D,
                   dx.data_ptr<float>());
  } else {
    rope_grad_rows(g.data_ptr<float>(), cos, sin, B, H, T, D, dx.data_ptr<float>());
  }
  return dx;
}


// Softmax cross-entropy over bfloat16 logit rows [R, V] (the lm_head GEMM's product), in fp32: returns each row's
// lse − logit[label] and, with a positive `denom`, overwrites the row with its gradient (softmax − onehot) / denom
// rounded to bfloat16, the input-gradient GEMM's operand. Three passes over a row while it sits in cache (max,
// Σ exp, write), against ~10 passes over a widened fp32 copy.
at::Tensor softmax_xent_bf16_(at::Tensor& logits, const at::Tensor& labels, double denom) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 && logits.stride(1) == 1,
              "logits must be a bfloat16 matrix with contiguous columns, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == R && labels.scalar_type() == at::kLong && labels.is_contiguous(),
              "labels must be a contiguous int64 vector of ", R, " elements, got ", labels.sizes());
  const int64_t* lp = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < V, "label ", lp[r], " of row ", r, " is outside the vocabulary [0, ", V, ")");
  }
  at::Tensor loss = at::empty({R}, logits.options().dtype(at::kFloat));
  uint16_t* xp = bf16_data(logits);
  float* op = loss.data_ptr<float>();
  const bool grad = denom > 0.0;
  const float inv_denom = grad ? static_cast<float>(1.0 / denom) : 0.0f;
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* xr = xp + r * ld;
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t v = 0; v < V; ++v) m = std::max(m, from_bf16(xr[v]));
      float z = 0.0f;
#pragma omp simd reduction(+ : z)
      for (int64_t v = 0; v < V; ++v) z += exp_poly(from_bf16(xr[v]) - m);
      const float target = from_bf16(xr[lp[r]]);
      op[r] = m + std::log(z) - target;
      if (grad) {
        const float scale = inv_denom / z;
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) xr[v] = to_bf16(exp_poly(from_bf16(xr[v]) - m) * scale);
        // the label's entry: (p − 1) / denom, from its own probability
        xr[lp[r]] = to_bf16((exp_poly(target - m) / z - 1.0f) * inv_denom);
      }
    }
  });
  return loss;
}


// ---- Causal attention on AMX tiles or AVX512-BF16 --------------------------------------------------------------
// Forward and backward of causal grouped-query attention for training, q [B, H, T, D], k and v [B, KV, T, D], with
// every product a bf16 dot product with fp32 sums, on the CPU's AMX unit (16 x 16 fp32 += 16 x 32 bf16 · 32 x 16 bf16
// per instruction) or, without AMX, with AVX512-BF16's vdpbf16ps in register tiles (AMD Zen 4/5, Intel Cooper Lake),
// and only the causal half of the score matrix computed: a task owns 16 query rows of one head, computes their scores
// against the keys up to its last row, takes the softmax in fp32 (bf16 probabilities for the next product, as the torch
// path rounds them) and multiplies by V. Nothing [T, T]-sized is kept for the backward: it recomputes the scores from
// the saved log-sum-exp. The backward's first pass (per 16 query rows) gives dS = P·(dP − Σ P·dP)·scale and dQ = dS·K;
// its second (per 16 keys) sums dV = Pᵀ·dO and dK = dSᵀ·Q over the query heads of one KV head, in a fixed order: every
// element is computed by one task in one order, so results do not depend on the thread count.
//
// Operand layouts, per head, bf16 bits, rows beyond T zero (the tiles read whole 16- and 32-row blocks):
//   rows   [Tk, D]         the matrix itself                        A operand (16 rows x 32 columns a tile)
//   pairs  [Tk/2, N, 2]    rows 2p and 2p+1 interleaved             B operand whose K runs over rows
//   dwords [D/2, Tk]       column pairs as 32-bit words, transposed B operand whose K runs over columns
// with Tk = T rounded up to 32. Requires D a multiple of 64.
constexpr int64_t kAttnRows = 16;  // query (or key) rows a task owns: one tile's rows
constexpr int64_t kAttnCols = 64;  // output columns a task's four accumulator tiles hold

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Task t of n row blocks, ordered 0, n-1, 1, n-2, ...: causal blocks cost more the later they are, and at::parallel_for
// hands each thread a contiguous range of tasks, so this order balances the threads.
int64_t balanced_block(int64_t t, int64_t n) { return (t & 1) ? n - 1 - t / 2 : t / 2; }

uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// One query row's softmax over its first `valid` scores s (scaled by `scale` here): s becomes e^(s·scale − max) in
// place; returns 1/Σ (0 for a row with no keys, a padding row) and the row's log-sum-exp, which the backward recomputes
// the probabilities from.
struct RowSoftmax {
  float inv, lse;
};

inline RowSoftmax row_exps(float* s, int64_t valid, float scale) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < valid; ++j) m = std::max(m, s[j] * scale);
  float z = 0.0f;
#pragma omp simd reduction(+ : z)
  for (int64_t j = 0; j < valid; ++j) {
    s[j] = exp_poly(s[j] * scale - m);
    z += s[j];
  }
  return {valid > 0 ? 1.0f / z : 0.0f, m + std::log(z)};
}

// x [B, G, T, D] (float32 or bfloat16, contiguous D, any other strides) as bf16 rows [B, G, rows, D], zero past T;
// x itself when it already is that (bf16, contiguous, T == rows).
at::Tensor rows_bf16(const at::Tensor& x, int64_t rows) {
  const int64_t B = x.size(0), G = x.size(1), T = x.size(2), D = x.size(3);
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous() && T == rows) return x;
  const at::Tensor src = (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.stride(3) == 1
                             ? x
                             : x.to(at::kFloat).contiguous();
  at::Tensor o = at::empty({B, G, rows, D}, x.options().dtype(at::kBFloat16));
  uint16_t* op = bits(o);
  const bool f32 = src.scalar_type() == at::kFloat;
  const char* base = static_cast<const char*>(src.data_ptr());
  const int64_t es = src.element_size(), s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / G, g = bg % G;
      uint16_t* out = op + bg * rows * D;
      for (int64_t t = 0; t < T; ++t) {
        const char* row = base + (b * s0 + g * s1 + t * s2) * es;
        uint16_t* o_row = out + t * D;
        if (f32) {
          const float* r = reinterpret_cast<const float*>(row);
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o_row[d] = to_bf16(r[d]);
        } else {
          std::memcpy(o_row, row, D * sizeof(uint16_t));
        }
      }
      std::memset(out + T * D, 0, (rows - T) * D * sizeof(uint16_t));
    }
  });
  return o;
}

// bf16 rows [B, G, R, N] (contiguous) -> pairs [B, G, R/2, N, 2]: rows 2p and 2p+1 interleaved.
at::Tensor row_pairs(const at::Tensor& r) {
  const int64_t BG = r.size(0) * r.size(1), R = r.size(2), N = r.size(3);
  at::Tensor o = at::empty({r.size(0), r.size(1), R / 2, N, 2}, r.options());
  const uint16_t* ip = bits(r);
  uint16_t* op = bits(o);
  at::parallel_for(0, BG, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      for (int64_t p = 0; p < R / 2; ++p) {
        const uint16_t* even = ip + (bg * R + 2 * p) * N;
        const uint16_t* odd = even + N;
        uint16_t* out = op + (bg * R + 2 * p) * N;
#pragma omp simd
        for (int64_t c = 0; c < N; ++c) {
          out[2 * c] = even[c];
          out[2 * c + 1] = odd[c];
        }
      }
    }
  });
  return o;
}

// Transpose of each [R, C] matrix of x [B, G, R, C] (contiguous, elements of `Elem`) into [B, G, C, R].
template <typename Elem>
void transpose_heads(const Elem* ip, Elem* op, int64_t BG, int64_t R, int64_t C) {
  at::parallel_for(0, BG, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {
      const Elem* in = ip + bg * R * C;
      Elem* out = op + bg * R * C;
      for (int64_t r0 = 0; r0 < R; r0 += 16) {  // 16 x 16 blocks: reads and writes stay in a few cache lines
        for (int64_t c0 = 0; c0 < C; c0 += 16) {
          for (int64_t c = c0; c < std::min(C, c0 + 16); ++c) {
            for (int64_t r = r0; r < std::min(R, r0 + 16); ++r) out[c * R + r] = in[r * C + c];
          }
        }
      }
    }
  });
}

// bf16 rows [B, G, R, D] -> [B, G, D/2, R] int32: each row's column pairs as 32-bit words, transposed.
at::Tensor column_dwords(const at::Tensor& r) {
  at::Tensor o = at::empty({r.size(0), r.size(1), r.size(3) / 2, r.size(2)}, r.options().dtype(at::kInt));
  transpose_heads(reinterpret_cast<const uint32_t*>(bits(r)), reinterpret_cast<uint32_t*>(o.data_ptr<int32_t>()),
                  r.size(0) * r.size(1), r.size(2), r.size(3) / 2);
  return o;
}

// bf16 rows [B, G, R, D] -> [B, G, D, R].
at::Tensor transposed_bf16(const at::Tensor& r) {
  at::Tensor o = at::empty({r.size(0), r.size(1), r.size(3), r.size(2)}, r.options());
  transpose_heads(bits(r), bits(o), r.size(0) * r.size(1), r.size(2), r.size(3));
  return o;
}

// q [B, H, T, D] and k, v [B, KV, T, D] with H a multiple of KV, D of head_multiple, and T > 0.
void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t head_multiple) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, H, T, D] tensors, got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "k and v must be [", q.size(0), ", KV, ", q.size(2), ", ", q.size(3), "], got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "query heads ", q.size(1),
              " are not a multiple of key/value heads ", k.size(1));
  TORCH_CHECK(q.size(3) > 0 && q.size(3) % head_multiple == 0, "head dim must be a multiple of ", head_multiple,
              ", got ", q.size(3));
  TORCH_CHECK(q.size(2) > 0, "no tokens");
}

#ifdef LORAD_AMX
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's tile registers, configured for the scope: all eight 16 rows of 64 bytes. Tiles 0-3 accumulate,
// 4 holds the A operand, 5 the B operand.
struct TileScope {
  TileScope() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Linux hands out AMX state only to processes that ask (oneDNN asks too; asking twice is fine).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// S[16, 0 .. n) (fp32, ldS floats apart) = A [16, D] (rows, lda elements apart) · Bᵀ from B's column dwords
// [D/2, ldb]; n a multiple of 16.
void tiles_abt(const uint16_t* A, int64_t lda, const int32_t* Bd, int64_t ldb, int64_t D, int64_t n, float* S,
               int64_t ldS) {
  for (int64_t n0 = 0; n0 < n; n0 += 16) {
    _tile_zero(0);
    for (int64_t k0 = 0; k0 < D; k0 += 32) {
      _tile_loadd(4, A + k0, lda * 2);
      _tile_loadd(5, Bd + (k0 / 2) * ldb + n0, ldb * 4);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, S + n0, ldS * 4);
  }
}

// O[16, 64] (fp32, contiguous) = A [16, K] (rows, lda elements apart) · B from its row pairs [K/2, ldb, 2], starting
// at B's column pointer; K a multiple of 32.
void tiles_ab64(const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t ldb, int64_t K, float* O) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    _tile_loadd(4, A + k0, lda * 2);
    const uint16_t* b = Bp + (k0 / 2) * ldb * 2;
    _tile_loadd(5, b, ldb * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 32, ldb * 4);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, b + 64, ldb * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, b + 96, ldb * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, O, 256);
  _tile_stored(1, O + 16, 256);
  _tile_stored(2, O + 32, 256);
  _tile_stored(3, O + 48, 256);
}

// dV = Pᵀ·dO and dK = dSᵀ·Q of 16 keys (j0 ..) and 64 head columns (d0 ..), summed over query heads: key_grad_zero,
// then key_grad_add once per query head, then key_grad_store; key_grad_at reads C's element (key r, column d).
// Here C[64, 16] = Σ_i Xᵀ[d, i]·Y[i, key] accumulates in tiles 0-3 (C is written by key_grad_store only); Xh is the
// head's Xᵀ rows [D, Tk] (dOᵀ or Qᵀ), Yh its query-row pairs [Tk/2, Tk, 2] (P or dS), rows from i_first (a multiple of
// 32) on.
void key_grad_zero(float*) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void key_grad_add(const uint16_t* Xh, const uint16_t* Yh, int64_t Tk, int64_t, int64_t d0, int64_t j0, int64_t i_first,
                  float*) {
  const uint16_t* XT = Xh + d0 * Tk;
  const uint16_t* Yp = Yh + j0 * 2;
  for (int64_t i = i_first; i < Tk; i += 32) {
    _tile_loadd(5, Yp + (i / 2) * Tk * 2, Tk * 4);
    _tile_loadd(4, XT + i, Tk * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(4, XT + 16 * Tk + i, Tk * 2);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(4, XT + 32 * Tk + i, Tk * 2);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(4, XT + 48 * Tk + i, Tk * 2);
    _tile_dpbf16ps(3, 4, 5);
  }
}

void key_grad_store(float* C) {
  _tile_stored(0, C, kAttnRows * 4);
  _tile_stored(1, C + 16 * kAttnRows, kAttnRows * 4);
  _tile_stored(2, C + 32 * kAttnRows, kAttnRows * 4);
  _tile_stored(3, C + 48 * kAttnRows, kAttnRows * 4);
}

inline float key_grad_at(const float* C, int64_t r, int64_t d) { return C[d * kAttnRows + r]; }

// X's layout key_grad_add reads: its transpose [B, H, D, Tk].
at::Tensor key_grad_operand(const at::Tensor& rows) { return transposed_bf16(rows); }
#elif defined(LORAD_AVX512BF16)
// The same products with AVX512-BF16 dot products (vdpbf16ps: 16 fp32 sums += 16 pairs of bf16 products) in register
// tiles of 16 accumulators (16 of the 32 registers): the AMX tiles' operand layouts (B as 32-bit pair words) are this
// instruction's too. A's pairs are broadcast from memory, B's pair rows loaded once for all of a tile's rows. Tiles of
// 8 x 32 and 4 x 64 sums need fewer broadcasts per product than 16 x 16: a SmolLM2 layer's forward 0.61 -> 0.54 ms and
// backward 1.95 -> 1.51 ms (medians of 200 interleaved calls, 2 threads, Zen 5).
struct TileScope {};  // no tile state to configure

// C[R, 16·NV] (fp32, rows ldc floats apart) = (add ? C : 0) + Σ_{p < pairs} A(r, p)·B(p, ·), where A(r, p) is the bf16
// pair at A + r·lda + p·ldp (elements) and B(p, c) word c of B's pair row p (rows ldb words apart); p in order. R·NV
// accumulators stay in registers; each pair step loads NV vectors of B and broadcasts R words of A.
template <int R, int NV>
inline void dp_tile(const uint16_t* A, int64_t lda, int64_t ldp, const int32_t* B, int64_t ldb, int64_t pairs, float* C,
                    int64_t ldc, bool add) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = add ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 16 * v);
    const uint16_t* a = A + p * ldp;
    for (int r = 0; r < R; ++r) {
      int32_t w;
      std::memcpy(&w, a + r * lda, sizeof w);
      const __m512bh aw = (__m512bh)_mm512_set1_epi32(w);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], aw, b[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
  }
}

// C[16, n] for n a multiple of 16, as dp_tile: 8 x 32 tiles where the columns allow (fewer broadcasts per product than
// 16 x 16), 16 x 16 for a last odd 16 columns.
inline void dp_rows16(const uint16_t* A, int64_t lda, int64_t ldp, const int32_t* B, int64_t ldb, int64_t pairs,
                      int64_t n, float* C, int64_t ldc, bool add) {
  int64_t n0 = 0;
  for (; n0 + 32 <= n; n0 += 32) {
    dp_tile<8, 2>(A, lda, ldp, B + n0, ldb, pairs, C + n0, ldc, add);
    dp_tile<8, 2>(A + 8 * lda, lda, ldp, B + n0, ldb, pairs, C + 8 * ldc + n0, ldc, add);
  }
  if (n0 < n) dp_tile<16, 1>(A, lda, ldp, B + n0, ldb, pairs, C + n0, ldc, add);
}

void tiles_abt(const uint16_t* A, int64_t lda, const int32_t* Bd, int64_t ldb, int64_t D, int64_t n, float* S,
               int64_t ldS) {
  dp_rows16(A, lda, 2, Bd, ldb, D / 2, n, S, ldS, false);
}

void tiles_ab64(const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t ldb, int64_t K, float* O) {
  const int32_t* Bd = reinterpret_cast<const int32_t*>(Bp);
  for (int64_t r0 = 0; r0 < kAttnRows; r0 += 4) {
    dp_tile<4, 4>(A + r0 * lda, lda, 2, Bd, ldb, K / 2, O + r0 * kAttnCols, kAttnCols, false);
  }
}

// As with AMX, but C[16, 64] (key rows) += Σ_i Y[i, key]·X[i, d]: A from Y's query-row pairs (a key's pair i, i + 1
// is one word, pairs 2·Tk elements apart), B from X's row pairs [Tk/2, D, 2], so no transposed copy of X is needed.
void key_grad_zero(float* C) { std::memset(C, 0, kAttnCols * kAttnRows * sizeof(float)); }

void key_grad_add(const uint16_t* Xh, const uint16_t* Yh, int64_t Tk, int64_t D, int64_t d0, int64_t j0,
                  int64_t i_first, float* C) {
  const uint16_t* A = Yh + (i_first / 2) * Tk * 2 + j0 * 2;
  const int32_t* Bd = reinterpret_cast<const int32_t*>(Xh) + (i_first / 2) * D + d0;
  for (int64_t r0 = 0; r0 < kAttnRows; r0 += 4) {
    dp_tile<4, 4>(A + r0 * 2, 2, Tk * 2, Bd, D, (Tk - i_first) / 2, C + r0 * kAttnCols, kAttnCols, true);
  }
}

void key_grad_store(float*) {}

inline float key_grad_at(const float* C, int64_t r, int64_t d) { return C[r * kAttnCols + d]; }

// X's layout key_grad_add reads: its row pairs [B, H, Tk/2, D, 2].
at::Tensor key_grad_operand(const at::Tensor& rows) { return row_pairs(rows); }
#endif

// The unit causal_attention_fwd/bwd run their products on: "AMX tiles", "AVX512-BF16", or "" (they do not run here).
std::string attention_bf16_unit() {
#if defined(LORAD_AMX)
  return amx_permitted() ? "AMX tiles" : "";
#elif defined(LORAD_AVX512BF16)
  return "AVX512-BF16";
#else
  return "";
#endif
}

// Whether causal_attention_fwd/bwd run for this head dim here (a unit above, D a multiple of kAttnCols); head_dim 0
// asks about the unit alone.
bool attention_bf16_ready(int64_t head_dim) { return head_dim % kAttnCols == 0 && !attention_bf16_unit().empty(); }

// Forward: (out [B, T, H·D] bf16, the rows o_proj multiplies; lse [B, H, T] fp32; v's bf16 rows [B, KV, Tk, D] for
// the backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                                     const at::Tensor& v, double scale_d) {
  check_attention(q, k, v, kAttnCols);
  TORCH_CHECK(attention_bf16_ready(0),
              "causal_attention_fwd needs AMX tiles or AVX512-BF16 (this build or process has neither)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), g = H / KV;
  const int64_t Tk = round_up(T, 32), nq = Tk / kAttnRows;
  const at::Tensor Qr = rows_bf16(q, Tk), Kd = column_dwords(rows_bf16(k, Tk)), Vr = rows_bf16(v, Tk);
  const at::Tensor Vp = row_pairs(Vr);
  at::Tensor out = at::empty({B, T, H * D}, q.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({B, H, T}, q.options().dtype(at::kFloat));
#ifdef LORAD_BF16_ATTENTION
  const uint16_t* qp = bits(Qr);
  const int32_t* kd = Kd.data_ptr<int32_t>();
  const uint16_t* vp = bits(Vp);
  uint16_t* op = bits(out);
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H * nq, 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    std::vector<float> S(kAttnRows * Tk), O(kAttnRows * kAttnCols);
    std::vector<uint16_t> P(kAttnRows * Tk);
    const float scale = static_cast<float>(scale_d);  // a local: see the note at the top
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nq, b = bh / H, h = bh % H, kvh = b * KV + h / g;
      const int64_t i0 = balanced_block(t % nq, nq) * kAttnRows;
      const int64_t n = std::max<int64_t>(1, std::min(T, i0 + kAttnRows)), n16 = round_up(n, 16), n32 = round_up(n, 32);
      tiles_abt(qp + (bh * Tk + i0) * D, D, kd + kvh * (D / 2) * Tk, Tk, D, n16, S.data(), Tk);
      for (int64_t r = 0; r < kAttnRows; ++r) {
        const int64_t i = i0 + r, valid = i < T ? i + 1 : 0;  // keys 0..i; padding rows get P = 0
        float* s = S.data() + r * Tk;
        uint16_t* pr = P.data() + r * Tk;
        const RowSoftmax sm = row_exps(s, valid, scale);
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) pr[j] = to_bf16(s[j] * sm.inv);
        for (int64_t j = valid; j < n32; ++j) pr[j] = 0;
        if (i < T) lp[bh * T + i] = sm.lse;
      }
      for (int64_t c0 = 0; c0 < D; c0 += kAttnCols) {
        tiles_ab64(P.data(), Tk, vp + kvh * Tk * D + c0 * 2, D, n32, O.data());
        for (int64_t r = 0; r < kAttnRows && i0 + r < T; ++r) {
          uint16_t* o = op + (b * T + i0 + r) * H * D + h * D + c0;
#pragma omp simd
          for (int64_t c = 0; c < kAttnCols; ++c) o[c] = to_bf16(O[r * kAttnCols + c]);
        }
      }
    }
  });
#endif
  return {out, lse, Vr};
}

// Backward from dout [B, T, H·D] (any float; bf16 from o_proj): (dq [B, H, T, D], dk, dv [B, KV, T, D]) in fp32.
// vr is the forward's bf16 rows of v, lse its log-sum-exp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                                     const at::Tensor& k, const at::Tensor& vr,
                                                                     const at::Tensor& lse, double scale_d) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), g = H / std::max<int64_t>(1, KV);
  const int64_t Tk = round_up(T, 32), nq = Tk / kAttnRows;
  check_attention(q, k, k, kAttnCols);
  TORCH_CHECK(vr.dim() == 4 && vr.size(0) == B && vr.size(1) == KV && vr.size(2) == Tk && vr.size(3) == D &&
                  vr.scalar_type() == at::kBFloat16 && vr.is_contiguous(),
              "vr must be causal_attention_fwd's bf16 rows of v [", B, ", ", KV, ", ", Tk, ", ", D, "], got ",
              vr.sizes(), " ", vr.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == T &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "lse must be a contiguous float32 [", B, ", ", H, ", ", T, "] tensor, got ", lse.sizes());
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == B && dout.size(1) == T && dout.size(2) == H * D,
              "dout must be [", B, ", ", T, ", ", H * D, "], got ", dout.sizes());
  TORCH_CHECK(attention_bf16_ready(0),
              "causal_attention_bwd needs AMX tiles or AVX512-BF16 (this build or process has neither)");
  const at::Tensor Qr = rows_bf16(q, Tk), Kr = rows_bf16(k, Tk);
  const at::Tensor dOr = rows_bf16(dout.reshape({B, T, H, D}).transpose(1, 2), Tk);
  const at::Tensor Kd = column_dwords(Kr), Vd = column_dwords(vr), Kp = row_pairs(Kr);
  // P and dS of every head as query-row pairs [Tk/2, Tk, 2]: an operand of dV = Pᵀ·dO and dK = dSᵀ·Q (key_grad_add)
  at::Tensor Pp = at::empty({B, H, Tk / 2, Tk, 2}, q.options().dtype(at::kBFloat16));
  at::Tensor dSp = at::empty({B, H, Tk / 2, Tk, 2}, q.options().dtype(at::kBFloat16));
  at::Tensor dq = at::empty({B, H, T, D}, q.options().dtype(at::kFloat));
  at::Tensor dk = at::empty({B, KV, T, D}, q.options().dtype(at::kFloat));
  at::Tensor dv = at::empty({B, KV, T, D}, q.options().dtype(at::kFloat));
#ifdef LORAD_BF16_ATTENTION
  const at::Tensor QX = key_grad_operand(Qr), dOX = key_grad_operand(dOr);
  const uint16_t *qr = bits(Qr), *dor = bits(dOr), *kp = bits(Kp), *qx = bits(QX), *dox = bits(dOX);
  const int32_t *kd = Kd.data_ptr<int32_t>(), *vd = Vd.data_ptr<int32_t>();
  uint16_t *pp = bits(Pp), *dsp = bits(dSp);
  const float* lp = lse.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  at::parallel_for(0, B * H * nq, 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    std::vector<float> S(kAttnRows * Tk), dP(kAttnRows * Tk), O(kAttnRows * kAttnCols);
    std::vector<uint16_t> dS(kAttnRows * Tk), Pb(kAttnRows * Tk);
    const float scale = static_cast<float>(scale_d);  // a local: see the note at the top
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nq, b = bh / H, h = bh % H, kvh = b * KV + h / g;
      const int64_t i0 = balanced_block(t % nq, nq) * kAttnRows;
      const int64_t n = std::max<int64_t>(1, std::min(T, i0 + kAttnRows)), n16 = round_up(n, 16), n32 = round_up(n, 32);
      tiles_abt(qr + (bh * Tk + i0) * D, D, kd + kvh * (D / 2) * Tk, Tk, D, n16, S.data(), Tk);
      tiles_abt(dor + (bh * Tk + i0) * D, D, vd + kvh * (D / 2) * Tk, Tk, D, n16, dP.data(), Tk);
      for (int64_t r = 0; r < kAttnRows; ++r) {
        const int64_t i = i0 + r, valid = i < T ? i + 1 : 0;
        float* p = S.data() + r * Tk;
        const float* dp = dP.data() + r * Tk;
        const float l = i < T ? lp[bh * T + i] : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) p[j] = exp_poly(p[j] * scale - l);
        for (int64_t j = valid; j < n32; ++j) p[j] = 0.0f;
        float di = 0.0f;
#pragma omp simd reduction(+ : di)
        for (int64_t j = 0; j < valid; ++j) di += p[j] * dp[j];
        uint16_t* ds = dS.data() + r * Tk;
        uint16_t* pb = Pb.data() + r * Tk;
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) {
          ds[j] = to_bf16(p[j] * (dp[j] - di) * scale);
          pb[j] = to_bf16(p[j]);
        }
        for (int64_t j = valid; j < n32; ++j) ds[j] = pb[j] = 0;
      }
      for (int64_t r = 0; r < kAttnRows; r += 2) {  // rows i0 + r and i0 + r + 1 as one row of pairs
        uint16_t* prow = pp + (bh * Tk / 2 + (i0 + r) / 2) * Tk * 2;
        uint16_t* dsrow = dsp + (bh * Tk / 2 + (i0 + r) / 2) * Tk * 2;
        const uint16_t *p0 = Pb.data() + r * Tk, *p1 = p0 + Tk, *d0 = dS.data() + r * Tk, *d1 = d0 + Tk;
#pragma omp simd
        for (int64_t j = 0; j < n32; ++j) {
          prow[2 * j] = p0[j];
          prow[2 * j + 1] = p1[j];
          dsrow[2 * j] = d0[j];
          dsrow[2 * j + 1] = d1[j];
        }
      }
      for (int64_t c0 = 0; c0 < D; c0 += kAttnCols) {
        tiles_ab64(dS.data(), Tk, kp + kvh * Tk * D + c0 * 2, D, n32, O.data());
        for (int64_t r = 0; r < kAttnRows && i0 + r < T; ++r) {
          std::memcpy(dqp + (bh * T + i0 + r) * D + c0, O.data() + r * kAttnCols, kAttnCols * sizeof(float));
        }
      }
    }
  });
  const int64_t nk = Tk / kAttnRows;
  at::parallel_for(0, B * KV * nk, 1, [&](int64_t begin, int64_t end) {
    TileScope tiles;
    std::vector<float> C(kAttnCols * kAttnRows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bk = t / nk, b = bk / KV, kh = bk % KV, j0 = balanced_block(t % nk, nk) * kAttnRows;
      if (j0 >= T) continue;
      // query rows from the 32-row block holding key j0 on (the pass above wrote P and dS there, zero where i < j)
      const int64_t i_first = j0 / 32 * 32;
      for (int which = 0; which < 2; ++which) {  // dV from dO and P, then dK from Q and dS
        const uint16_t* X = which == 0 ? dox : qx;
        const uint16_t* Y = which == 0 ? pp : dsp;
        float* grad = which == 0 ? dvp : dkp;
        for (int64_t d0 = 0; d0 < D; d0 += kAttnCols) {
          key_grad_zero(C.data());
          for (int64_t hh = 0; hh < g; ++hh) {
            const int64_t bh = b * H + kh * g + hh;
            key_grad_add(X + bh * D * Tk, Y + bh * Tk * Tk, Tk, D, d0, j0, i_first, C.data());
          }
          key_grad_store(C.data());
          for (int64_t r = 0; r < kAttnRows && j0 + r < T; ++r) {
            float* o = grad + (bk * T + j0 + r) * D + d0;
            for (int64_t d = 0; d < kAttnCols; ++d) o[d] = key_grad_at(C.data(), r, d);
          }
        }
      }
    }
  });
#endif
  return {dq, dk, dv};
}

// ---- fp32 causal attention, any CPU ------------------------------------------------------------------------------
// The AMX kernels' tasks (16 query rows a task over the causal half of the keys, the backward recomputing the
// probabilities from each row's log-sum-exp) with fp32 products: register tiles of kF32TileRows x 16 sums, FMA over
// broadcast A elements and B's 16-float rows. SmolLM2 layer at 214 tokens, 2 threads, AVX2 EPYC: forward 1.34 ms and
// backward 2.9 ms (~53 GFLOP/s over the causal half), where torch's flash SDPA took 2.29 ms forward and 9.1 ms forward
// + backward.
constexpr int64_t kF32TileRows = 4;  // x 16 columns: 4 of AVX-512's registers, 8 of AVX2's, 16 of NEON's 32

// C[kF32TileRows, 16] (rows ldc apart) = (add ? C : 0) + Σ_{k < K} A(r, k)·B[k, 0 : 16] with A(r, k) = a[r·ars + k·aks]
// and B's rows ldb apart; k in order.
inline void f32_tile(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t K, float* c,
                     int64_t ldc, bool add) {
  v16 acc[kF32TileRows];
  for (int64_t r = 0; r < kF32TileRows; ++r) acc[r] = add ? vload(c + r * ldc) : v16{};
  for (int64_t k = 0; k < K; ++k) {
    const v16 bk = vload(b + k * ldb);
    const float* ak = a + k * aks;
    for (int64_t r = 0; r < kF32TileRows; ++r) acc[r] += ak[r * ars] * bk;
  }
  for (int64_t r = 0; r < kF32TileRows; ++r) vstore(c + r * ldc, acc[r]);
}

// C[M, N] = (add ? C : 0) + A·B for A(r, k) as in f32_tile; M a multiple of kF32TileRows, N of 16. B's 16-column strip
// stays in L1 while the row tiles pass over it.
void f32_product(const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, int64_t M, int64_t N,
                 int64_t K, float* c, int64_t ldc, bool add) {
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    for (int64_t m0 = 0; m0 < M; m0 += kF32TileRows) {
      f32_tile(a + m0 * ars, ars, aks, b + n0, ldb, K, c + m0 * ldc + n0, ldc, add);
    }
  }
}

// x [B, G, T, D] (float32, any strides) as contiguous [B, G, rows, D], zero past T; x itself when it is that already.
at::Tensor padded_rows_f32(const at::Tensor& x, int64_t rows) {
  const int64_t T = x.size(2);
  if (x.is_contiguous() && T == rows) return x;
  at::Tensor o = at::empty({x.size(0), x.size(1), rows, x.size(3)}, x.options());
  o.narrow(2, 0, T).copy_(x);
  if (rows > T) o.narrow(2, T, rows - T).zero_();
  return o;
}

// x [B, G, T, D] (float32, any strides) as contiguous [B, G, D, cols], its transpose, zero past T.
at::Tensor padded_columns_f32(const at::Tensor& x, int64_t cols) {
  const int64_t T = x.size(2);
  at::Tensor o = at::empty({x.size(0), x.size(1), x.size(3), cols}, x.options());
  o.narrow(3, 0, T).copy_(x.transpose(2, 3));
  if (cols > T) o.narrow(3, T, cols - T).zero_();
  return o;
}

// Head dims the fp32 kernels take: whole vectors of 16 floats.
constexpr int64_t kF32HeadMultiple = 16;

bool attention_f32_ready(int64_t head_dim) { return head_dim > 0 && head_dim % kF32HeadMultiple == 0; }

void check_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_attention(q, k, v, kF32HeadMultiple);
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "q, k, v must be float32, got ", t->scalar_type());
  }
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v must have contiguous head dims (stride(3) == 1)");
}

// Forward in fp32: (out [B, T, H·D], the rows o_proj multiplies; lse [B, H, T], each row's log-sum-exp of its scaled
// scores).
std::tuple<at::Tensor, at::Tensor> causal_attention_f32_fwd(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, double scale_d) {
  check_attention_f32(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), g = H / KV;
  const int64_t Tk = round_up(T, kAttnRows), nq = Tk / kAttnRows;
  const at::Tensor Qp = padded_rows_f32(q, Tk), KT = padded_columns_f32(k, Tk);
  at::Tensor out = at::empty({B, T, H * D}, q.options());
  at::Tensor lse = at::empty({B, H, T}, q.options());
  const float *qp = Qp.data_ptr<float>(), *kt = KT.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(kAttnRows * Tk), O(kAttnRows * D);
    const float scale = static_cast<float>(scale_d);  // a local: see the note at the top
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nq, b = bh / H, h = bh % H, kvh = b * KV + h / g;
      const int64_t i0 = balanced_block(t % nq, nq) * kAttnRows;
      const int64_t n = std::min(T, i0 + kAttnRows), n16 = round_up(n, 16);
      f32_product(qp + (bh * Tk + i0) * D, D, 1, kt + kvh * D * Tk, Tk, kAttnRows, n16, D, S.data(), Tk, false);
      for (int64_t r = 0; r < kAttnRows; ++r) {
        const int64_t i = i0 + r, valid = i < T ? i + 1 : 0;  // keys 0..i; padding rows get P = 0
        float* s = S.data() + r * Tk;
        const RowSoftmax sm = row_exps(s, valid, scale);
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) s[j] *= sm.inv;
        for (int64_t j = valid; j < n16; ++j) s[j] = 0.0f;
        if (i < T) lp[bh * T + i] = sm.lse;
      }
      f32_product(S.data(), Tk, 1, vp + b * vs0 + (h / g) * vs1, vs2, kAttnRows, D, n, O.data(), D, false);
      for (int64_t r = 0; r < kAttnRows && i0 + r < T; ++r) {
        std::memcpy(op + (b * T + i0 + r) * H * D + h * D, O.data() + r * D, D * sizeof(float));
      }
    }
  });
  return {out, lse};
}

// Backward from dout [B, T, H·D] (float32): (dq [B, H, T, D], dk, dv [B, KV, T, D]), with the probabilities
// recomputed from the forward's lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_f32_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                                         const at::Tensor& k, const at::Tensor& v,
                                                                         const at::Tensor& lse, double scale_d) {
  check_attention_f32(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), g = H / KV;
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == T &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "lse must be a contiguous float32 [", B, ", ", H, ", ", T, "] tensor, got ", lse.sizes());
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == B && dout.size(1) == T && dout.size(2) == H * D &&
                  dout.scalar_type() == at::kFloat,
              "dout must be a float32 [", B, ", ", T, ", ", H * D, "] tensor, got ", dout.sizes(), " ",
              dout.scalar_type());
  const int64_t Tk = round_up(T, kAttnRows), nq = Tk / kAttnRows;
  const at::Tensor Qp = padded_rows_f32(q, Tk), dOp = padded_rows_f32(dout.reshape({B, T, H, D}).transpose(1, 2), Tk);
  const at::Tensor KT = padded_columns_f32(k, Tk), VT = padded_columns_f32(v, Tk);
  // every head's P and dS [Tk, Tk]: row i is written for keys up to its block's end (zero past i), which covers every
  // key block the second pass reads it for
  at::Tensor P = at::empty({B, H, Tk, Tk}, q.options()), dS = at::empty({B, H, Tk, Tk}, q.options());
  at::Tensor dq = at::empty({B, H, T, D}, q.options());
  at::Tensor dk = at::empty({B, KV, T, D}, q.options()), dv = at::empty({B, KV, T, D}, q.options());
  const float *qp = Qp.data_ptr<float>(), *dop = dOp.data_ptr<float>(), *kt = KT.data_ptr<float>();
  const float *vt = VT.data_ptr<float>(), *kp = k.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  float *pp = P.data_ptr<float>(), *dsp = dS.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  at::parallel_for(0, B * H * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> O(kAttnRows * D);
    const float scale = static_cast<float>(scale_d);  // a local: see the note at the top
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nq, b = bh / H, h = bh % H, kvh = b * KV + h / g;
      const int64_t i0 = balanced_block(t % nq, nq) * kAttnRows;
      const int64_t n = std::min(T, i0 + kAttnRows), n16 = round_up(n, 16);
      float* prows = pp + (bh * Tk + i0) * Tk;
      float* dsrows = dsp + (bh * Tk + i0) * Tk;
      f32_product(qp + (bh * Tk + i0) * D, D, 1, kt + kvh * D * Tk, Tk, kAttnRows, n16, D, prows, Tk, false);
      f32_product(dop + (bh * Tk + i0) * D, D, 1, vt + kvh * D * Tk, Tk, kAttnRows, n16, D, dsrows, Tk, false);
      for (int64_t r = 0; r < kAttnRows; ++r) {
        const int64_t i = i0 + r, valid = i < T ? i + 1 : 0;
        float* p = prows + r * Tk;
        float* ds = dsrows + r * Tk;  // dP in, dS out
        const float l = i < T ? lp[bh * T + i] : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) p[j] = exp_poly(p[j] * scale - l);
        float di = 0.0f;
#pragma omp simd reduction(+ : di)
        for (int64_t j = 0; j < valid; ++j) di += p[j] * ds[j];
#pragma omp simd
        for (int64_t j = 0; j < valid; ++j) ds[j] = p[j] * (ds[j] - di) * scale;
        for (int64_t j = valid; j < n16; ++j) p[j] = ds[j] = 0.0f;
      }
      f32_product(dsrows, Tk, 1, kp + b * ks0 + (h / g) * ks1, ks2, kAttnRows, D, n, O.data(), D, false);
      for (int64_t r = 0; r < kAttnRows && i0 + r < T; ++r) {
        std::memcpy(dqp + (bh * T + i0 + r) * D, O.data() + r * D, D * sizeof(float));
      }
    }
  });
  // dV[j] = Σ_i P[i, j]·dO[i] and dK[j] = Σ_i dS[i, j]·Q[i] over the query rows i >= j of the KV head's query heads
  at::parallel_for(0, B * KV * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> C(kAttnRows * D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bk = t / nq, b = bk / KV, kh = bk % KV, j0 = balanced_block(t % nq, nq) * kAttnRows;
      if (j0 >= T) continue;
      for (int which = 0; which < 2; ++which) {
        const float* X = which == 0 ? pp : dsp;
        const float* Y = which == 0 ? dop : qp;
        float* grad = which == 0 ? dvp : dkp;
        for (int64_t hh = 0; hh < g; ++hh) {
          const int64_t bh = b * H + kh * g + hh;
          f32_product(X + (bh * Tk + j0) * Tk + j0, 1, Tk, Y + (bh * Tk + j0) * D, D, kAttnRows, D, T - j0, C.data(),
                      D, hh > 0);
        }
        for (int64_t r = 0; r < kAttnRows && j0 + r < T; ++r) {
          std::memcpy(grad + (bk * T + j0 + r) * D, C.data() + r * D, D * sizeof(float));
        }
      }
    }
  });
  return {dq, dk, dv};
}

// ---- the LoRA SwiGLU node, one call a direction ------------------------------------------------------------------
// server/engine/models/mlp.py's node for its common case (gate/up stacked bf16 GEMMs, down a bf16 GEMM, no biases,
// the block's RMSNorm inside): the same kernels and ATen GEMMs on the same operands, in the same order, as its Python
// composition (lora_group.py), so the same bits, without ~30 Python calls and ~20 dispatches from Python per
// direction. x [R, C] is the norm's input; w_gu [2F, C] and w_d [C, F] are the bf16 weights; a_gu = [A_g; A_u].

// (out [R, C], rstd [R, 1], the gate/up product [R, 2F] bf16, h_gu [R, rg + ru], h_d [R, rd])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_mlp_fwd(
    const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& w_gu, const at::Tensor& a_gu,
    const at::Tensor& bg, const at::Tensor& bu, const at::Tensor& w_d, const at::Tensor& a_d, const at::Tensor& b_d,
    double s) {
  const int64_t F = bg.size(0);
  TORCH_CHECK(w_gu.dim() == 2 && w_gu.size(0) == 2 * F && bu.size(0) == F, "w_gu must be [", 2 * F, ", C], got ",
              w_gu.sizes());
  auto [x2, x2b, rstd] = rms_norm_fwd(x, norm_w, eps, true);
  const at::Tensor prod = at::mm(x2b, w_gu.t());
  const at::Tensor h_gu = lowrank_rows(x2, a_gu);
  auto [act, act_b, h_d] = lora_swiglu_fwd(prod.narrow(1, 0, F), prod.narrow(1, F, F), h_gu, bg, bu, s, true, a_d);
  const at::Tensor prod_d = at::mm(act_b, w_d.t());
  at::Tensor out = widen_lowrank(prod_d, h_d, b_d.t(), at::empty({0}, x.options()), s);
  return {out, rstd, prod, h_gu, h_d};
}

// The backward from dout [R, C] (float32 rows) and what lora_mlp_fwd saved: (dx [R, C], or an empty tensor without
// need_x; dA_gu [rg + ru, C]; dB_g [F, rg]; dB_u [F, ru]; dA_d [rd, F]; dB_d [C, rd]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_mlp_bwd(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& norm_w,
    const at::Tensor& w_gu, const at::Tensor& a_gu, const at::Tensor& bg, const at::Tensor& bu, const at::Tensor& prod,
    const at::Tensor& h_gu, const at::Tensor& w_d, const at::Tensor& a_d, const at::Tensor& b_d,
    const at::Tensor& h_d, double s, bool need_x) {
  const int64_t F = bg.size(0);
  // down: g, dB and dout's bf16 rows in one pass, then d_act = dout·W_d with the LoRA term added as it is widened
  auto [dout_b, g_d_rows, db_d] = lora_out_grads({dout}, h_d, {b_d}, s, true);
  const at::Tensor d_act = widen_lowrank(at::mm(dout_b, w_d), g_d_rows, a_d, at::empty({0}, x.options()), s);
  // [d_gate | d_up] in bf16, act, gate's and up's rank-space rows and dB in one pass
  auto [dgu_b, da_d, g_rows, db_g, db_u] =
      lora_swiglu_bwd_grads(d_act, prod.narrow(1, 0, F), prod.narrow(1, F, F), h_gu, bg, bu, g_d_rows, s);
  const at::Tensor da_gu = rms_norm_a_grads(x, rstd, norm_w, g_rows, s);
  at::Tensor dx;
  if (need_x) {
    const at::Tensor dx2 = widen_lowrank(at::mm(dgu_b, w_gu), g_rows, a_gu, at::empty({0}, x.options()), s);
    dx = rms_norm_bwd(dx2, x, rstd, norm_w);
  } else {
    dx = at::empty({0}, x.options());
  }
  return {dx, da_gu, db_g, db_u, da_d, db_d[0]};
}

// ---- layers reading one normed input, one call a direction -------------------------------------------------------
// lora_group.py's node (q/k/v) for its common case: the members' bf16 weights stacked into w [Σout, C] (bf16), the
// block's RMSNorm inside, the kernels taking every width. The same kernels and GEMMs, in the node's order, as its
// Python composition. a = [A_1; …] [Σr, C]; biases[i] empty where member i has none.

// (each member's output [R, out_i], rstd [R, 1], h [R, Σr])
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> lora_group_fwd(
    const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& w, const at::Tensor& a,
    at::TensorList bs, at::TensorList biases, double s) {
  TORCH_CHECK(!bs.empty() && bs.size() == biases.size(),
              "one lora_B and one bias (or an empty tensor) per member: got ", bs.size(), " and ", biases.size());
  auto [x2, x2b, rstd] = rms_norm_fwd(x, norm_w, eps, true);
  const at::Tensor prod = at::mm(x2b, w.t());
  const at::Tensor h = lowrank_rows(x2, a);
  std::vector<at::Tensor> outs;
  int64_t col = 0, rk = 0;
  for (size_t i = 0; i < bs.size(); ++i) {
    const int64_t out = bs[i].size(0), r = bs[i].size(1);
    outs.push_back(widen_lowrank(prod.narrow(1, col, out), h.narrow(1, rk, r), bs[i].t(), biases[i], s));
    col += out;
    rk += r;
  }
  TORCH_CHECK(col == w.size(0) && rk == a.size(0), "the members' widths (", col, ") and ranks (", rk,
              ") must add up to the stacked weight's rows (", w.size(0), ") and A's (", a.size(0), ")");
  return {outs, rstd, h};
}

// The backward from the members' output gradients dys[i] [R, out_i] (float32 rows) and what lora_group_fwd saved:
// (dx [R, C], or an empty tensor without need_x; dA [Σr, C]; each dB_i [out_i, r_i]).
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_group_bwd(
    at::TensorList dys, const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& norm_w, const at::Tensor& w,
    const at::Tensor& a, at::TensorList bs, const at::Tensor& h, double s, bool need_x) {
  auto [packed, g_rows, dbs] = lora_out_grads(dys, h, bs, s, need_x);
  at::Tensor dx = need_x ? rms_norm_bwd(widen_lowrank(at::mm(packed, w), g_rows, a, at::empty({0}, x.options()), s),
                                        x, rstd, norm_w)
                         : at::empty({0}, x.options());
  at::Tensor da = rms_norm_a_grads(x, rstd, norm_w, g_rows, s);
  return {dx, da, dbs};
}
}  // namespace

TORCH_LIBRARY(lorad_fused, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor w, float eps, bool want_bf16) -> (Tensor, Tensor, Tensor)", &rms_norm_fwd);
  m.def("rms_norm_apply(Tensor x, Tensor rstd, Tensor w) -> Tensor", &rms_norm_apply);
  m.def("rms_norm_bwd(Tensor g, Tensor x, Tensor rstd, Tensor w) -> Tensor", &rms_norm_bwd);
  m.def("rms_norm_a_grads(Tensor x, Tensor rstd, Tensor w, Tensor g, float s) -> Tensor", &rms_norm_a_grads);
  m.def("swiglu_fwd(Tensor gate, Tensor up, bool want_bf16) -> (Tensor, Tensor)", &swiglu_fwd);
  m.def("swiglu_bwd(Tensor d_act, Tensor gate, Tensor up, bool want_bf16) -> (Tensor, Tensor)", &swiglu_bwd);
  m.def("lora_swiglu_fwd(Tensor pg, Tensor pu, Tensor h, Tensor bg, Tensor bu, float s, bool want_bf16, "
        "Tensor a_next) -> (Tensor, Tensor, Tensor)",
        &lora_swiglu_fwd);
  m.def("lora_swiglu_bwd(Tensor d_act, Tensor pg, Tensor pu, Tensor h, Tensor bg, Tensor bu, float s, "
        "bool want_bf16) -> (Tensor, Tensor, Tensor)",
        &lora_swiglu_bwd);
  m.def("lora_swiglu_bwd_grads(Tensor d_act, Tensor pg, Tensor pu, Tensor h, Tensor bg, Tensor bu, Tensor g_d, "
        "float s) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
        &lora_swiglu_bwd_grads);
  m.def("lora_out_grads(Tensor[] dys, Tensor h, Tensor[] bs, float s, bool want_bf16) -> (Tensor, Tensor, Tensor[])",
        &lora_out_grads);
  m.def("widen_lowrank(Tensor prod, Tensor h, Tensor m, Tensor bias, float s) -> Tensor", &widen_lowrank);
  m.def("lowrank_rows(Tensor x, Tensor a) -> Tensor", &lowrank_rows);
  m.def("lowrank_a_grads(Tensor x, Tensor g, float s) -> Tensor", &lowrank_a_grads);
  m.def("small_rows_bf16(Tensor x, Tensor w) -> Tensor", &small_rows_bf16);
  m.def("quantize_rows_i8(Tensor a, Tensor c) -> (Tensor, Tensor)", &quantize_rows_i8);
  m.def("int8_rescale(Tensor acc, Tensor s, Tensor c, Tensor bias) -> Tensor", &int8_rescale);
  m.def("rope_fwd(Tensor x, Tensor cos, Tensor sin, bool bf16) -> Tensor", &rope_fwd);
  m.def("rope_bwd(Tensor g, Tensor cos, Tensor sin) -> Tensor", &rope_bwd);
  m.def("softmax_xent_bf16_(Tensor(a!) logits, Tensor labels, float denom) -> Tensor", &softmax_xent_bf16_);
  m.def("attention_bf16_ready(int head_dim) -> bool", &attention_bf16_ready);
  m.def("attention_bf16_unit() -> str", &attention_bf16_unit);
  m.def("causal_attention_fwd(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor, Tensor)",
        &causal_attention_fwd);
  m.def("causal_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor vr, Tensor lse, float scale) -> (Tensor, "
        "Tensor, Tensor)",
        &causal_attention_bwd);
  m.def("lora_mlp_fwd(Tensor x, Tensor norm_w, float eps, Tensor w_gu, Tensor a_gu, Tensor bg, Tensor bu, Tensor w_d, "
        "Tensor a_d, Tensor b_d, float s) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        &lora_mlp_fwd);
  m.def("lora_mlp_bwd(Tensor dout, Tensor x, Tensor rstd, Tensor norm_w, Tensor w_gu, Tensor a_gu, Tensor bg, "
        "Tensor bu, Tensor prod, Tensor h_gu, Tensor w_d, Tensor a_d, Tensor b_d, Tensor h_d, float s, bool need_x) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        &lora_mlp_bwd);
  m.def("lora_group_fwd(Tensor x, Tensor norm_w, float eps, Tensor w, Tensor a, Tensor[] bs, Tensor[] biases, "
        "float s) -> (Tensor[], Tensor, Tensor)",
        &lora_group_fwd);
  m.def("lora_group_bwd(Tensor[] dys, Tensor x, Tensor rstd, Tensor norm_w, Tensor w, Tensor a, Tensor[] bs, "
        "Tensor h, float s, bool need_x) -> (Tensor, Tensor, Tensor[])",
        &lora_group_bwd);
  m.def("attention_f32_ready(int head_dim) -> bool", &attention_f32_ready);
  m.def("causal_attention_f32_fwd(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)",
        &causal_attention_f32_fwd);
  m.def("causal_attention_f32_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor lse, float scale) -> (Tensor, "
        "Tensor, Tensor)",
        &causal_attention_f32_bwd);
}
