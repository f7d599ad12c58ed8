// The codec's per-element math for kernels/cpu_step.cpp: portable log2/exp2, FP8 and 4-bit codes.
//
// Every function here is branch-free (selects on values computed unconditionally, integer bit
// manipulation, no table lookups), so that the loops calling them vectorize: a lookup or a branch
// per element keeps gcc from vectorizing a loop, and AVX-512 gathers are slow where the GDS
// mitigation is on. The float operations are formats/portable_math.py's, one IEEE basic operation
// each, and the file is built with -ffp-contract=off: the bits do not depend on the vector width.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define COAT_INLINE inline __attribute__((always_inline))

namespace coat {

// ---- bit views ----------------------------------------------------------------------------

COAT_INLINE float as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
COAT_INLINE uint32_t as_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
COAT_INLINE float with_sign_of(float mag, float sign_of) {
  return as_float((as_bits(mag) & 0x7FFFFFFFu) | (as_bits(sign_of) & 0x80000000u));
}
COAT_INLINE bool is_finite(float x) { return (as_bits(x) & 0x7F800000u) != 0x7F800000u; }
COAT_INLINE float bf16_to_float(uint32_t h) { return as_float(h << 16); }

// ---- portable log2 / exp2 (formats/portable_math.py spells out the same operations) --------

// float32 constants as hex literals, exactly the values formats/portable_math.py uses
constexpr float kSqrt2 = 0x1.6a09e6p+0f;
// 2 / (ln2 (2n + 1)): log2(m) = s (C1 + C3 s^2 + C5 s^4 + C7 s^6 + C9 s^8), s = (m - 1) / (m + 1)
constexpr float kL0 = 0x1.715476p+1f, kL1 = 0x1.ec709ep-1f, kL2 = 0x1.2776c6p-1f,
                kL3 = 0x1.a61762p-2f, kL4 = 0x1.484b14p-2f;
// (ln2)^n / n!, n = 0..7: 2^f for |f| <= 1/2
constexpr float kE0 = 0x1p+0f, kE1 = 0x1.62e430p-1f, kE2 = 0x1.ebfbe0p-3f, kE3 = 0x1.c6b08ep-5f,
                kE4 = 0x1.3b2ab6p-7f, kE5 = 0x1.5d87fep-10f, kE6 = 0x1.430912p-13f,
                kE7 = 0x1.ffcbfcp-17f;
constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: (y + it) - it rounds y to an integer

// log2 of a mantissa m in [sqrt(1/2), sqrt(2)): the part of log2 that depends on m alone
COAT_INLINE float log2_mantissa(float m) {
  float s = (m - 1.0f) / (m + 1.0f);
  float s2 = s * s;
  float p = kL4 * s2 + kL3;  // (no FMA: -ffp-contract=off)
  p = p * s2 + kL2;
  p = p * s2 + kL1;
  p = p * s2 + kL0;
  return s * p;
}

// log2 of x >= 0 (x = 0: -inf, +inf: +inf, NaN: NaN), subnormals included
COAT_INLINE float log2_portable(float x) {
  bool sub = x < 1.17549435e-38f;  // below 2^-126: scaled up by 2^23 first (exact)
  float xs = sub ? x * 8388608.0f : x;
  uint32_t b = as_bits(xs);
  int32_t e = (int32_t)((b >> 23) & 0xFFu) - 127 - (sub ? 23 : 0);
  float m = as_float((b & 0x7FFFFFu) | 0x3F800000u);
  bool high = m >= kSqrt2;
  m = high ? m * 0.5f : m;
  e = high ? e + 1 : e;
  float r = log2_mantissa(m) + (float)e;
  r = x == 0.0f ? -INFINITY : r;
  return (x == INFINITY || x != x) ? x : r;
}

// 2^y (y = -inf: 0, +inf: +inf, NaN: NaN)
COAT_INLINE float exp2_portable(float y) {
  float yc = y < -151.0f ? -151.0f : (y > 129.0f ? 129.0f : y);
  float n = (yc + kShifter) - kShifter;  // round to nearest even: exact for |y| < 2^22
  float f = yc - n;                      // exact, |f| <= 1/2
  float p = kE7 * f + kE6;
  p = p * f + kE5;
  p = p * f + kE4;
  p = p * f + kE3;
  p = p * f + kE2;
  p = p * f + kE1;
  p = p * f + kE0;
  int32_t ni = (int32_t)(yc == yc ? n : 0.0f);
  int32_t n1 = ni < -100 ? -100 : (ni > 127 ? 127 : ni);  // p * 2^n1 stays a normal float
  int32_t n2 = ni - n1;                                    // then one rounding into subnormals
  return (p * as_float((uint32_t)(n1 + 127) << 23)) * as_float((uint32_t)(n2 + 127) << 23);
}

// ---- FP8 codes: MB = 3 is E4M3 (float8_e4m3fn), MB = 2 is E5M2 ------------------------------

template <int MB> struct Fp8;
template <> struct Fp8<3> {
  static constexpr uint32_t bias = 7;
  static constexpr float max = 448.0f, sub_scale = 0x1p-9f, inv_sub = 0x1p+9f, min_normal = 0x1p-6f;
};
template <> struct Fp8<2> {
  static constexpr uint32_t bias = 15;
  static constexpr float max = 57344.0f, sub_scale = 0x1p-16f, inv_sub = 0x1p+16f, min_normal = 0x1p-14f;
};

// value of an FP8 code (NaN codes: NaN; E5M2's Inf codes: Inf)
template <int MB> COAT_INLINE float fp8_value(uint32_t code) {
  using F = Fp8<MB>;
  uint32_t mag = code & 0x7Fu;
  uint32_t field = mag >> MB;
  uint32_t mant = mag & ((1u << MB) - 1);
  float normal = as_float((mag << (23 - MB)) + ((127u - F::bias) << 23));
  float sub = (float)(int32_t)mant * F::sub_scale;
  float v = field == 0 ? sub : normal;
  if constexpr (MB == 3) {
    v = mag == 0x7Fu ? NAN : v;
  } else {
    v = field == 31u ? as_float(mant == 0 ? 0x7F800000u : 0x7FC00000u) : v;  // Inf or NaN
  }
  return as_float(as_bits(v) | ((code & 0x80u) << 24));
}

// code of y rounded to nearest even onto the FP8 grid, saturating (NaN: 0x7F)
template <int MB> COAT_INLINE uint32_t fp8_code(float y) {
  using F = Fp8<MB>;
  float mag = std::fabs(y);
  mag = mag > F::max ? F::max : mag;
  // below the normal range the grid is uniform: round mag / spacing to an integer
  float q = (mag * F::inv_sub + kShifter) - kShifter;
  uint32_t sub = (uint32_t)(int32_t)q;
  uint32_t b = as_bits(mag);
  constexpr uint32_t drop = 23 - MB;
  b = b + ((1u << (drop - 1)) - 1) + ((b >> drop) & 1u);
  uint32_t normal = (((b >> 23) - (127u - F::bias)) << MB) | ((b >> drop) & ((1u << MB) - 1));
  uint32_t code = mag < F::min_normal ? sub : normal;
  code |= (as_bits(y) >> 24) & 0x80u;
  return y != y ? 0x7Fu : code;
}

// log2 |value| of an FP8 code as log2_portable computes it (-inf at zero, NaN/Inf at NaN/Inf
// codes), without a 128-entry lookup. Every nonzero FP8 magnitude, subnormal ones included, is a
// normal float32 (1 + i/2^MB) 2^e, so log2_portable ends with log2_mantissa of that mantissa
// (halved at and above sqrt(2): the top half of i) plus the exponent: the same float addition
// here, with log2_mantissa's 2^MB possible results computed once by that very function.
template <int MB> struct Log2Fp8Table {
  float mantissa[1 << MB];
  Log2Fp8Table() {
    for (int i = 0; i < (1 << MB); ++i) {
      float m = 1.0f + (float)i / (float)(1 << MB);
      mantissa[i] = log2_mantissa(m >= kSqrt2 ? m * 0.5f : m);
    }
  }
};

// t[i] for i < 2^MB as a tree of selects on i's bits: gcc turns a chain of `i == k` tests into a
// switch (control flow), which does not vectorize; this does (7 blends for MB = 3)
template <int MB> COAT_INLINE float pick(uint32_t i, const float (&t)[1 << MB]) {
  bool b0 = i & 1u, b1 = i & 2u;
  float r = b1 ? (b0 ? t[3] : t[2]) : (b0 ? t[1] : t[0]);
  if constexpr (MB == 3) {
    float h = b1 ? (b0 ? t[7] : t[6]) : (b0 ? t[5] : t[4]);
    r = (i & 4u) ? h : r;
  }
  return r;
}

template <int MB> COAT_INLINE float fp8_log2_abs(uint32_t code, const float (&mant)[1 << MB]) {
  uint32_t b = as_bits(fp8_value<MB>(code)) & 0x7FFFFFFFu;
  uint32_t i = (b >> (23 - MB)) & ((1u << MB) - 1);
  int32_t e = (int32_t)(b >> 23) - 127 + (int32_t)(i >> (MB - 1));  // + 1 where halved
  float r = pick<MB>(i, mant) + (float)e;
  r = b == 0 ? -INFINITY : r;
  return b >= 0x7F800000u ? as_float(b) : r;  // Inf and NaN codes: log2 is the value itself
}

// ---- 4-bit codes (formats/fp4.py) ---------------------------------------------------------

COAT_INLINE float e2m1_level(uint32_t i) {  // {0, .5, 1, 1.5, 2, 3, 4, 6}[i & 7]
  uint32_t j = i & 7u;
  float big = as_float((((j >> 1) + 126u) << 23) | ((j & 1u) << 22));
  return j >= 2 ? big : (float)(int32_t)j * 0.5f;
}
COAT_INLINE float ue3m1_level(uint32_t i) {  // (1 + (i & 1) / 2) * 2^(i >> 1)
  return as_float((((i >> 1) + 127u) << 23) | ((i & 1u) << 22));
}

// nearest level of {0, .5, 1, 1.5, 2, 3, 4, 6} to y in [0, 6], ties to the even index: a tie at
// the midpoint between levels t and t + 1 goes up where t + 1 is even
COAT_INLINE uint32_t e2m1_index(float y) {
  return (uint32_t)(y > 0.25f) + (uint32_t)(y >= 0.75f) + (uint32_t)(y > 1.25f) + (uint32_t)(y >= 1.75f) +
         (uint32_t)(y > 2.5f) + (uint32_t)(y >= 3.5f) + (uint32_t)(y > 5.0f);
}

COAT_INLINE uint32_t mix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; return h ^ (h >> 16);
}

// ---- master weights (formats/master_weights.py) -------------------------------------------

COAT_INLINE float correction_scale(uint32_t w) {  // ulp(w) / 256
  int32_t field = (int32_t)((w >> 7) & 0xFFu);
  field = field < 16 ? 16 : field;
  return as_float((uint32_t)(field - 15) << 23);
}

// float32 -> bfloat16 bits to nearest even (the NaN bits as torch's cast gives them)
COAT_INLINE uint32_t round_bf16(float x, uint32_t nan_bits) {
  uint32_t b = as_bits(x);  // no NaN: b + 0x8000 stays below 2^32
  uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return x != x ? nan_bits : r;
}

}  // namespace coat
