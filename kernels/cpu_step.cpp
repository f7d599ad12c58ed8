// The CPU AdamW step over group-compressed moments: decode, update and encode in one pass.
//
// Built at run time by coatstate.kernels.cpu_step (the C++ compiler torch.compile uses, no torch
// headers) and called through ctypes. It computes what coatstate.optim.reference_step computes,
// bit for bit: the same float32 operations in the same order, per group of one row. The codec's
// math (cpu_codec.h) is IEEE basic operations and integer arithmetic only, built with
// -ffp-contract=off, so its bits do not depend on the vector width; the update's lerp and addcmul
// round as torch's eager kernels do on this machine (the launcher probes whether those use FMA).
//
// Each thread takes a contiguous run of groups. A group (at most group_size elements) passes
// through three loops over per-thread scratch that stays in L1: decode the moments, update (which
// also reads the gradient and reads and writes the parameter), encode. Every loop is branch-free
// and vectorizes (check with -fopt-info-vec-missed); the format and parameter mode are template
// arguments picked once per call, so no per-element test remains.

#include <cstdlib>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_codec.h"

using namespace coat;

extern "C" {

// One compressed moment of one parameter (kind: 1 E4M3, 2 E5M2, 3 e2m1, 4 ue3m1_sqrt).
struct CoatMoment {
  uint8_t* codes;      // FP8: (rows, cols); 4-bit: (rows, ceil(cols / 2)) packed
  float* scales;       // (rows, groups per row)
  uint8_t* exponents;  // 16k per group (FP8 with expansion), else null
  int32_t kind;
  int32_t second;      // a second moment: a NaN read back is +Inf (formats.optimizer_state)
  float scale_max;     // plain FP8: the largest scale (FP8_MAX * scale stays finite)
  float k_numerator;   // expanded FP8: 16 log2(Rf)
  float log2_max;      // expanded FP8: log2(FP8_MAX)
};

struct CoatStep {
  void* param;             // float32 or bfloat16, (rows, cols) contiguous
  void* correction;        // int8 (master 24) / int16 (master 32) or null
  const void* grad;        // float32 or bfloat16
  CoatMoment m, v, vmax;   // vmax: amsgrad only
  int64_t rows, cols;
  int64_t first_element;   // offset of element 0 in the whole (unsharded) parameter
  int32_t group_size;
  int32_t param_bf16, grad_bf16, master_bits, amsgrad, maximize, has_inv_scale, weight_decay;
  int32_t fma_lerp, fma_addcmul;  // torch's eager lerp / addcmul round once (FMA) on this machine
  float decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, inv_scale;
  uint32_t master_key, rounding_key;  // mix32 of (seed, step, stream): the hashes' keys
  uint16_t bf16_nan;                  // the bfloat16 bits torch's cast gives a NaN here
  int32_t threads;
  int64_t nonfinite;                  // out: moment values that came out NaN/Inf
};

}  // extern "C"

namespace {

constexpr float kMinScale = 0x1p-126f;   // formats.group.MIN_SCALE
constexpr float kMinScale4 = 0x1p-120f;  // formats.fp4_moment.MIN_SCALE
constexpr float kFloat32Max = 3.40282347e+38f;

// Where one group lies: its row, first column, index among the moment's groups, length, and
// its first element's offset in the whole parameter (the stochastic roundings' counter).
struct Group {
  int64_t row, col0, index, base, offset;
  int n;
};

const Log2Fp8Table<3> kLog2E4M3;
const Log2Fp8Table<2> kLog2E5M2;
template <int MB> const Log2Fp8Table<MB>& log2_table() {
  if constexpr (MB == 3) return kLog2E4M3; else return kLog2E5M2;
}

// ---- decode: the group's moment values into x[0..n) ---------------------------------------

template <int MB, bool EXPAND, int N>
void decode_fp8(const CoatMoment& mo, const CoatStep& a, const Group& gr, float* __restrict x) {
  const uint8_t* __restrict c = mo.codes + gr.base;
  const float scale = mo.scales[gr.index];
  const int n = N ? N : gr.n;  // N: a full group of the default size, known to the compiler
  const bool second = mo.second;
  if (!EXPAND) {
    for (int j = 0; j < n; ++j) {
      float r = fp8_value<MB>(c[j]) * scale;
      x[j] = (r != r) & second ? INFINITY : r;  // (not &&: a branch)
    }
    return;
  }
  float mant[1 << MB];  // a loop-invariant copy: the selects read registers
  for (int i = 0; i < (1 << MB); ++i) mant[i] = log2_table<MB>().mantissa[i];
  const float inv_k = 16.0f / (float)mo.exponents[gr.index];
  const float log_scale = log2_portable(scale);
  for (int j = 0; j < n; ++j) {
    uint32_t code = c[j];
    float r = exp2_portable(fp8_log2_abs<MB>(code, mant) * inv_k + log_scale);
    r = r > kFloat32Max ? kFloat32Max : r;
    r = (code & 0x7Fu) != 0 ? r : 0.0f;
    r = as_float((as_bits(r) & 0x7FFFFFFFu) | ((code & 0x80u) << 24));
    x[j] = (r != r) & second ? INFINITY : r;  // (not &&: a branch)
  }
}

// the 16 levels of a 4-bit codebook, signed for e2m1: one register, indexed by vpermps below
template <bool SQ> struct Fp4Levels {
  alignas(64) float level[16];
  Fp4Levels() {
    for (uint32_t k = 0; k < 16; ++k) {
      level[k] = SQ ? ue3m1_level(k) : with_sign_of(e2m1_level(k), as_float(k << 28));
    }
  }
};
const Fp4Levels<false> kE2m1Levels;
const Fp4Levels<true> kUe3m1Levels;

template <bool SQ, int N>
void decode_fp4(const CoatMoment& mo, const CoatStep& a, const Group& gr, float* __restrict x) {
  const uint8_t* __restrict c = mo.codes + gr.row * ((a.cols + 1) / 2) + gr.col0 / 2;
  const float step = mo.scales[gr.index] / (SQ ? 192.0f : 6.0f);
  const bool second = mo.second;
#if defined(__AVX512F__)
  if constexpr (N % 32 == 0 && N > 0) {  // full groups: 16 bytes (32 codes) a pass, the level by
    // a register permute (gcc turns the portable loop's per-element level arithmetic into ~a dozen
    // instructions); the same products, so the same bits
    const __m512 levels = _mm512_load_ps(SQ ? kUe3m1Levels.level : kE2m1Levels.level);
    const __m512 stepv = _mm512_set1_ps(step);
    const __m512i low_first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high_first = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int b = 0; b < N / 2; b += 16) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + b)));
      const __m512i low_codes = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
      __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(low_codes, levels), stepv);
      __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), levels), stepv);
      if (SQ) {
        lo = _mm512_mul_ps(lo, lo);
        hi = _mm512_mul_ps(hi, hi);
      }
      if (second) {  // a NaN read back is +Inf
        lo = _mm512_mask_mov_ps(lo, _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q), _mm512_set1_ps(INFINITY));
        hi = _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q), _mm512_set1_ps(INFINITY));
      }
      _mm512_storeu_ps(x + 2 * b, _mm512_permutex2var_ps(lo, low_first, hi));  // codes 2k (low nibble), 2k + 1
      _mm512_storeu_ps(x + 2 * b + 16, _mm512_permutex2var_ps(lo, high_first, hi));
    }
    return;
  }
#endif
  const int pairs = ((N ? N : gr.n) + 1) / 2;  // an odd group's last high nibble lands in scratch padding
  for (int j = 0; j < pairs; ++j) {
    for (int h = 0; h < 2; ++h) {
      uint32_t code = (c[j] >> (4 * h)) & 15u;
      float u = (SQ ? ue3m1_level(code) : with_sign_of(e2m1_level(code), as_float(code << 28))) * step;
      float r = SQ ? u * u : u;
      x[2 * j + h] = second && r != r ? INFINITY : r;
    }
  }
}

// ---- encode: x[0..n) into the group's codes, scale (and exponent) -------------------------

template <int MB, bool EXPAND, int N>
void encode_fp8(const CoatMoment& mo, const CoatStep& a, const Group& gr, const float* __restrict x) {
  using F = Fp8<MB>;
  uint8_t* __restrict c = mo.codes + gr.base;
  const int n = N ? N : gr.n;  // N: a full group of the default size, known to the compiler
  int32_t mx_bits = 0, mn_bits = 0x7F800000;  // non-negative floats compare as their bits
  for (int j = 0; j < n; ++j) {
    int32_t b = (int32_t)(as_bits(x[j]) & 0x7FFFFFFFu);
    b = b < 0x7F800000 ? b : 0;  // NaN and Inf are left out
    mx_bits = b > mx_bits ? b : mx_bits;
    int32_t nz = b != 0 ? b : 0x7F800000;  // the minimum is over nonzero magnitudes
    mn_bits = nz < mn_bits ? nz : mn_bits;
  }
  const float mx = as_float((uint32_t)mx_bits);
  if (!EXPAND) {
    float s = mx / F::max;
    s = s < kMinScale ? kMinScale : (s > mo.scale_max ? mo.scale_max : s);
    s = mx > 0.0f ? s : 0.0f;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int j = 0; j < n; ++j) c[j] = (uint8_t)fp8_code<MB>(is_finite(x[j]) ? x[j] * inv : NAN);
    mo.scales[gr.index] = s;
    return;
  }
  const float mn = as_float((uint32_t)mn_bits);
  const float log_mx = log2_portable(mx);
  const float log_range = log_mx - log2_portable(mn);
  float k16 = std::floor(mo.k_numerator / log_range);
  k16 = k16 < 1.0f ? 1.0f : (k16 > 255.0f ? 255.0f : k16);
  k16 = mx > 0.0f ? k16 : 16.0f;
  const float k = k16 / 16.0f;
  float s = exp2_portable(log_mx - mo.log2_max * (16.0f / k16));
  s = s < kMinScale ? kMinScale : s;
  s = mx > 0.0f ? s : 0.0f;
  const float log_s = log2_portable(s);
  for (int j = 0; j < n; ++j) {
    // the twin takes log2 of 0 for a non-finite x, but its code is NaN either way; a select
    // before log2 would let gcc thread jumps through log2's own selects, and not vectorize
    float y = exp2_portable(k * (log2_portable(std::fabs(x[j])) - log_s));
    y = x[j] != 0.0f ? y : 0.0f;
    y = with_sign_of(y, x[j]);
    c[j] = (uint8_t)fp8_code<MB>(is_finite(x[j]) ? y : NAN);
  }
  mo.scales[gr.index] = s;
  mo.exponents[gr.index] = (uint8_t)k16;
}

// floats per scratch array of one thread: a group, padded by a vector for odd groups
COAT_INLINE int64_t scratch_stride(int64_t group_size) { return (group_size + 64) & ~int64_t(15); }

// the 4-bit code of u (sqrt(v) or m) in units where the group's largest magnitude is `top`;
// r: ue3m1_sqrt's stochastic rounding bits, already placed below the kept mantissa bit
template <bool SQ>
COAT_INLINE uint32_t fp4_code(float u, float to_units, uint32_t r) {
  constexpr float top = SQ ? 192.0f : 6.0f;
  u = is_finite(u) ? u : 0.0f;
  float y = std::fabs(u) * to_units;
  y = y > top ? top : y;
  if (SQ) {
    int32_t i = (int32_t)((as_bits(y) + r) >> 22) - 254;  // y <= 192: no carry out of 32 bits
    return (uint32_t)(i < 0 ? 0 : (i > 15 ? 15 : i));
  }
  return e2m1_index(y) | (u < 0.0f ? 8u : 0u);
}

COAT_INLINE uint32_t rounding_bits(uint32_t hash, uint32_t half) {  // half 0: low 16 bits, 1: high
  return (((hash >> (half * 16)) & 0xFFFFu) << 6) | 32u;
}

// u = sqrt(x) (ue3m1_sqrt, rounded stochastically) or x (e2m1, to nearest); codes[] is scratch
template <bool SQ, int N>
void encode_fp4(const CoatMoment& mo, const CoatStep& a, const Group& gr, const float* __restrict x,
                uint32_t* __restrict codes) {
  const int n = N ? N : gr.n;  // N: a full group of the default size, known to the compiler
  int32_t mx_bits = 0, finite = 0;
  // ue3m1_sqrt is exp_avg_sq's format: update() left sqrt(x) in this scratch beside codes
  const float* __restrict roots = (const float*)(codes + scratch_stride(a.group_size));
  const float* __restrict us = SQ ? roots : x;
  for (int j = 0; j < n; ++j) {
    int32_t b = (int32_t)(as_bits(us[j]) & 0x7FFFFFFFu);
    finite += b < 0x7F800000;
    b = b < 0x7F800000 ? b : 0;
    mx_bits = b > mx_bits ? b : mx_bits;
  }
  const float mx = as_float((uint32_t)mx_bits);
  const float s = mx > 0.0f ? (mx < kMinScale4 ? kMinScale4 : mx) : 0.0f;
  const float to_units = s > 0.0f ? (SQ ? 192.0f : 6.0f) / s : 0.0f;
  const uint32_t key = a.rounding_key, off0 = (uint32_t)gr.offset;  // offsets count mod 2^32
  uint8_t* __restrict c = mo.codes + gr.row * ((a.cols + 1) / 2) + gr.col0 / 2;
  if (n % 2 == 0 && (!SQ || off0 % 2 == 0)) {
    // a byte's two elements share one hash (elements 2k and 2k + 1 of the tensor): taken once
    for (int i = 0; i < n / 2; ++i) {
      const uint32_t hash = SQ ? mix32((((off0 + 2u * (uint32_t)i) >> 1) * 0x85EBCA77u) ^ key) : 0u;
      const uint32_t lo = fp4_code<SQ>(us[2 * i], to_units, rounding_bits(hash, 0));
      const uint32_t hi = fp4_code<SQ>(us[2 * i + 1], to_units, rounding_bits(hash, 1));
      c[i] = (uint8_t)(lo | (hi << 4));
    }
  } else {  // an odd group, or one starting at an odd element: element by element
    for (int j = 0; j < n; ++j) {
      const uint32_t off = off0 + (uint32_t)j;
      const uint32_t hash = SQ ? mix32(((off >> 1) * 0x85EBCA77u) ^ key) : 0u;
      codes[j] = fp4_code<SQ>(us[j], to_units, rounding_bits(hash, off & 1u));
    }
    codes[n] = 0;  // an odd group's last high nibble is 0
    for (int j = 0; j < (n + 1) / 2; ++j) c[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
  }
  mo.scales[gr.index] = finite == n ? s : NAN;
}

// ---- the update -----------------------------------------------------------------------------

enum ParamMode { kFloat32, kBf16, kMaster16, kMaster24, kMaster32 };

// the parameter's (and correction's) pointers, copied out of CoatStep: stores through them could
// alias the struct, and reloading its fields every element stops vectorization
struct ParamPtrs {
  float* __restrict p32;
  uint16_t* __restrict w;
  int8_t* __restrict c8;
  int16_t* __restrict c16;
};

template <int PM>
COAT_INLINE float load_param(const ParamPtrs& q, int64_t i) {
  if (PM == kFloat32) return q.p32[i];
  uint32_t w = q.w[i];
  float wf = bf16_to_float(w);
  if (PM == kMaster24) return wf + (float)q.c8[i] * correction_scale(w);
  if (PM == kMaster32) {
    float x = as_float((w << 16) + (uint32_t)(int32_t)q.c16[i]);
    return wf != wf ? wf : x;
  }
  return wf;
}

template <int PM>
COAT_INLINE void store_param(const ParamPtrs& q, int64_t i, float p, uint32_t offset, uint32_t nan, uint32_t key) {
  if (PM == kFloat32) {
    q.p32[i] = p;
    return;
  }
  uint16_t* __restrict w = q.w;
  if (PM == kMaster24) {
    uint32_t h = round_bf16(p, nan);
    float d = std::nearbyint((p - bf16_to_float(h)) / correction_scale(h));
    d = d < -128.0f ? -128.0f : (d > 127.0f ? 127.0f : d);
    d = is_finite(d) ? d : 0.0f;
    w[i] = (uint16_t)h;
    q.c8[i] = (int8_t)(int32_t)d;
  } else if (PM == kMaster32) {
    uint32_t b = as_bits(p);
    uint32_t high = (b + 0x8000u) >> 16;  // wraps only for NaN bits; the remainder is b mod 2^16 anyway
    q.c16[i] = (int16_t)(uint16_t)(b - (high << 16));
    w[i] = (uint16_t)(p != p ? nan : high);
  } else if (PM == kMaster16) {
    uint32_t bits = as_bits(p) + (mix32((offset * 0x85EBCA77u) ^ key) & 0xFFFFu);
    w[i] = (uint16_t)(p != p ? nan : bits >> 16);
  } else {
    w[i] = (uint16_t)round_bf16(p, nan);
  }
}

// torch's single-tensor AdamW on one group: m, v (and vm) in scratch, p and g in place. COMMON:
// no maximize, gradient scale or amsgrad, known to the compiler (fewer selects per element)
template <int N, int PM, bool GRAD_BF16, bool FMA_LERP, bool FMA_ADDCMUL, bool COMMON>
int64_t update(const CoatStep& a, const Group& gr, float* __restrict m, float* __restrict v,
               float* __restrict vm, float* __restrict roots) {
  const int n = N ? N : gr.n;  // N: a full group of the default size, known to the compiler
  const int64_t base = gr.base;
  const float* __restrict g32 = (const float*)a.grad + base;
  const uint16_t* __restrict g16 = (const uint16_t*)a.grad + base;
  // torch's lerp: weight < 1/2 steps from the start, otherwise back from the end
  const bool from_start = std::fabs(a.lerp_weight) < 0.5f;
  const float coeff = from_start ? a.lerp_weight : a.lerp_weight - 1.0f;
  const float inv_scale = a.has_inv_scale ? a.inv_scale : 1.0f, decay = a.decay;
  const bool maximize = !COMMON && a.maximize, decayed = a.weight_decay;
  const bool scaled = !COMMON && a.has_inv_scale, amsgrad = !COMMON && a.amsgrad;
  const float beta2 = a.beta2, omb2 = a.one_minus_beta2, bc2 = a.bc2_sqrt, eps = a.eps, nstep = a.neg_step_size;
  const uint32_t off0 = (uint32_t)gr.offset, nan = a.bf16_nan, key = a.master_key;
  const ParamPtrs q = {(float*)a.param + base, (uint16_t*)a.param + base, (int8_t*)a.correction + base,
                       (int16_t*)a.correction + base};
  int32_t nonfinite = 0;  // (a group is short: 32-bit lanes, no widening per element)
  for (int j = 0; j < n; ++j) {
    float p = load_param<PM>(q, j);
    float g = GRAD_BF16 ? bf16_to_float(g16[j]) : g32[j];
    g = scaled ? g * inv_scale : g;
    g = maximize ? -g : g;
    p = decayed ? p * decay : p;
    float mj = m[j], vj = v[j];
    float start = from_start ? mj : g;
    mj = FMA_LERP ? std::fma(coeff, g - mj, start) : start + coeff * (g - mj);
    vj = FMA_ADDCMUL ? std::fma(omb2 * g, g, vj * beta2) : vj * beta2 + omb2 * g * g;
    float den = vj;
    if (amsgrad) {
      float mx = (vm[j] != vm[j] || vj != vj) ? NAN : (vj > vm[j] ? vj : vm[j]);
      vm[j] = mx;
      den = mx;
    }
    const float root = std::sqrt(vj);  // (kept for a ue3m1_sqrt encode of v)
    float denom = (amsgrad ? std::sqrt(den) : root) / bc2 + eps;
    p = p + (nstep * mj) / denom;
    float t = mj + vj;
    nonfinite += (t - t) != 0.0f;
    m[j] = mj;
    v[j] = vj;
    roots[j] = root;
    store_param<PM>(q, j, p, off0 + (uint32_t)j, nan, key);
  }
  return nonfinite;
}

using DecodeFn = void (*)(const CoatMoment&, const CoatStep&, const Group&, float*);
using EncodeFn = void (*)(const CoatMoment&, const CoatStep&, const Group&, const float*, uint32_t*);
using UpdateFn = int64_t (*)(const CoatStep&, const Group&, float*, float*, float*, float*);

template <int MB, bool EXPAND, int N>
void encode_fp8_(const CoatMoment& mo, const CoatStep& a, const Group& gr, const float* x, uint32_t*) {
  encode_fp8<MB, EXPAND, N>(mo, a, gr, x);
}

template <int N>
DecodeFn decoder(const CoatMoment& mo) {
  bool ex = mo.exponents != nullptr;
  switch (mo.kind) {
    case 1: return ex ? decode_fp8<3, true, N> : decode_fp8<3, false, N>;
    case 2: return ex ? decode_fp8<2, true, N> : decode_fp8<2, false, N>;
    case 3: return decode_fp4<false, N>;
    default: return decode_fp4<true, N>;
  }
}

template <int N>
EncodeFn encoder(const CoatMoment& mo) {
  bool ex = mo.exponents != nullptr;
  switch (mo.kind) {
    case 1: return ex ? encode_fp8_<3, true, N> : encode_fp8_<3, false, N>;
    case 2: return ex ? encode_fp8_<2, true, N> : encode_fp8_<2, false, N>;
    case 3: return encode_fp4<false, N>;
    default: return encode_fp4<true, N>;
  }
}

template <int N, int PM, bool COMMON>
UpdateFn updater_for(const CoatStep& a) {
  int which = (a.grad_bf16 ? 4 : 0) | (a.fma_lerp ? 2 : 0) | (a.fma_addcmul ? 1 : 0);
  constexpr UpdateFn table[8] = {
      update<N, PM, false, false, false, COMMON>, update<N, PM, false, false, true, COMMON>,
      update<N, PM, false, true, false, COMMON>,  update<N, PM, false, true, true, COMMON>,
      update<N, PM, true, false, false, COMMON>,  update<N, PM, true, false, true, COMMON>,
      update<N, PM, true, true, false, COMMON>,   update<N, PM, true, true, true, COMMON>};
  return table[which];
}

template <int N, int PM>
UpdateFn updater_for(const CoatStep& a) {
  if constexpr (N == 0) {  // groups of other sizes: the general update only (a faster build)
    return updater_for<N, PM, false>(a);
  } else {
    const bool common = !a.maximize && !a.has_inv_scale && !a.amsgrad;
    return common ? updater_for<N, PM, true>(a) : updater_for<N, PM, false>(a);
  }
}

template <int N>
UpdateFn updater(const CoatStep& a) {
  if (!a.param_bf16) return updater_for<N, kFloat32>(a);
  switch (a.master_bits) {
    case 16: return updater_for<N, kMaster16>(a);
    case 24: return updater_for<N, kMaster24>(a);
    case 32: return updater_for<N, kMaster32>(a);
    default: return updater_for<N, kBf16>(a);
  }
}

// The functions one group runs, picked once per call: for groups of any length (N = 0) or for full
// groups of the default size (N = 128), whose loops the compiler lays out without remainders.
struct Kernels {
  DecodeFn dm, dv, dvm;
  UpdateFn up;
  EncodeFn em, ev, evm;
  template <int N>
  static Kernels make(const CoatStep& a) {
    return {decoder<N>(a.m), decoder<N>(a.v), a.amsgrad ? decoder<N>(a.vmax) : nullptr, updater<N>(a),
            encoder<N>(a.m), encoder<N>(a.v), a.amsgrad ? encoder<N>(a.vmax) : nullptr};
  }
  int64_t run(const CoatStep& a, const Group& gr, float* m, float* v, float* vm, uint32_t* codes) const {
    dm(a.m, a, gr, m);
    dv(a.v, a, gr, v);
    if (dvm) dvm(a.vmax, a, gr, vm);
    int64_t bad = up(a, gr, m, v, vm, (float*)(codes + scratch_stride(a.group_size)));
    em(a.m, a, gr, m, codes);
    ev(a.v, a, gr, v, codes);
    if (evm) evm(a.vmax, a, gr, vm, codes);
    return bad;
  }
};

constexpr int kDefaultGroup = 128;  // formats.defaults.GROUP_SIZE

// Hints every stream's memory of elements [first, first + count) into the cache, a few groups
// before the step reaches them. The hardware's prefetcher falls behind on these interleaved
// streams (parameter, gradient and the moments' one-byte codes): without the hints the step
// stalls on loads more than it computes. A prefetch never faults: addresses past the end are
// harmless.
COAT_INLINE void prefetch_ahead(const CoatStep& a, int64_t first, int64_t count) {
  const char* p = (const char*)a.param + first * (a.param_bf16 ? 2 : 4);
  const char* g = (const char*)a.grad + first * (a.grad_bf16 ? 2 : 4);
  for (int64_t o = 0; o < count * (a.param_bf16 ? 2 : 4); o += 64) __builtin_prefetch(p + o, 1);
  for (int64_t o = 0; o < count * (a.grad_bf16 ? 2 : 4); o += 64) __builtin_prefetch(g + o, 0);
  if (a.correction != nullptr) {
    const char* c = (const char*)a.correction + first * (a.master_bits == 32 ? 2 : 1);
    for (int64_t o = 0; o < count * (a.master_bits == 32 ? 2 : 1); o += 64) __builtin_prefetch(c + o, 1);
  }
  const CoatMoment* moments[3] = {&a.m, &a.v, &a.vmax};
  for (const CoatMoment* mo : moments) {
    if (mo == &a.vmax && !a.amsgrad) break;
    const bool packed = mo->kind >= 3;  // 4-bit: two codes a byte (rows padded to a byte: near enough)
    const uint8_t* c = mo->codes + (packed ? first / 2 : first);
    for (int64_t o = 0; o < (packed ? count / 2 : count); o += 64) __builtin_prefetch(c + o, 1);
  }
}

// how far ahead prefetch_ahead looks: a few groups, well inside the L2 cache
constexpr int64_t kPrefetchDistance = 512;

constexpr int64_t kMinElementsPerThread = 1 << 15;  // below it, a second thread costs more than it saves

}  // namespace

extern "C" int coat_adamw_step(CoatStep* ap) {
  const CoatStep& a = *ap;
  const int64_t gs = a.group_size;
  const int64_t per_row = a.cols > 0 ? (a.cols + gs - 1) / gs : 1;
  const int64_t total = a.rows * per_row;
  const Kernels any = Kernels::make<0>(a), full = Kernels::make<kDefaultGroup>(a);
  int64_t threads = a.rows * a.cols / kMinElementsPerThread;
  threads = threads < 1 ? 1 : (threads > a.threads ? a.threads : threads);
  int64_t bad = 0;
#pragma omp parallel num_threads((int)threads) reduction(+ : bad)
  {
    // scratch: m, v, vm as float, the 4-bit codes and the square roots encode_fp4 takes
    const int64_t stride = scratch_stride(gs);
    float* buf = (float*)std::aligned_alloc(64, sizeof(float) * 5 * stride);
    float *m = buf, *v = buf + stride, *vm = buf + 2 * stride;
    uint32_t* codes = (uint32_t*)(buf + 3 * stride);
#pragma omp for schedule(static)
    for (int64_t index = 0; index < total; ++index) {
      Group gr;
      gr.index = index;
      gr.row = index / per_row;
      gr.col0 = (index - gr.row * per_row) * gs;
      gr.n = (int)(a.cols - gr.col0 < gs ? a.cols - gr.col0 : gs);
      if (gr.n <= 0) continue;
      gr.base = gr.row * a.cols + gr.col0;
      gr.offset = a.first_element + gr.base;
      prefetch_ahead(a, gr.base + kPrefetchDistance, gr.n);
      bad += (gr.n == kDefaultGroup ? full : any).run(a, gr, m, v, vm, codes);
    }
    std::free(buf);
  }
  ap->nonfinite = bad;
  return 0;
}

// a * b + c rounded once (fused) and twice (plain): the launcher compares both with torch's
// eager lerp and addcmul on this machine, to round as they do
extern "C" void coat_probe(const float* a, const float* b, const float* c, int64_t n, float* fused, float* plain) {
  for (int64_t j = 0; j < n; ++j) {
    fused[j] = std::fma(a[j], b[j], c[j]);
    plain[j] = a[j] * b[j] + c[j];
  }
}
