// The CPU AdamW step over group-compressed moments: decode, update and encode in one pass.
//
// Built at run time by coatstate.kernels.cpu_step (the C++ compiler torch.compile uses, no torch
// headers) and called through ctypes. It computes what coatstate.optim.reference_step computes,
// bit for bit: the same float32 operations in the same order, per group of one row. The codec's
// math is IEEE basic operations and integer arithmetic only (formats/portable_math.py), built with
// -ffp-contract=off, so its bits do not depend on the vector width; the update's lerp and addcmul
// round as torch's eager kernels do on this machine (the launcher probes whether those use FMA).
//
// Every loop below runs over one group (at most group_size elements) held in per-thread scratch
// arrays: the data stays in L1, and each loop is simple enough for the compiler to vectorize.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ---- bit views ----------------------------------------------------------------------------

inline float as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t as_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline float copy_sign(float mag, float sign_of) {
  return as_float((as_bits(mag) & 0x7FFFFFFFu) | (as_bits(sign_of) & 0x80000000u));
}
inline bool is_finite(float x) { return (as_bits(x) & 0x7F800000u) != 0x7F800000u; }

// ---- portable log2 / exp2 (formats/portable_math.py spells out the same operations) --------

// float32 constants as hex literals, exactly the values formats/portable_math.py uses
constexpr float kSqrt2 = 0x1.6a09e6p+0f;
// 2 / (ln2 (2n + 1)): log2(m) = s (C1 + C3 s^2 + C5 s^4 + C7 s^6 + C9 s^8), s = (m - 1) / (m + 1)
constexpr float kLog2C[5] = {0x1.715476p+1f, 0x1.ec709ep-1f, 0x1.2776c6p-1f, 0x1.a61762p-2f, 0x1.484b14p-2f};
// (ln2)^n / n!, n = 0..7: 2^f for |f| <= 1/2
constexpr float kExp2C[8] = {0x1p+0f,         0x1.62e430p-1f, 0x1.ebfbe0p-3f,  0x1.c6b08ep-5f,
                             0x1.3b2ab6p-7f,  0x1.5d87fep-10f, 0x1.430912p-13f, 0x1.ffcbfcp-17f};

// log2 of the mantissa m in [sqrt(1/2), sqrt(2)): the part of log2 that depends on m alone
inline float log2_mantissa(float m) {
  float s = (m - 1.0f) / (m + 1.0f);
  float s2 = s * s;
  float p = kLog2C[4];
  p = p * s2 + kLog2C[3];
  p = p * s2 + kLog2C[2];
  p = p * s2 + kLog2C[1];
  p = p * s2 + kLog2C[0];
  return s * p;
}

// log2 of x >= 0 (x = 0: -inf, +inf: +inf, NaN: NaN), subnormals included
inline float log2_portable(float x) {
  bool sub = x < 1.17549435e-38f;  // below 2^-126: scaled up by 2^23 first (exact)
  float xs = sub ? x * 8388608.0f : x;
  uint32_t b = as_bits(xs);
  int32_t e = (int32_t)((b >> 23) & 0xFF) - 127 - (sub ? 23 : 0);
  float m = as_float((b & 0x7FFFFFu) | 0x3F800000u);
  bool high = m >= kSqrt2;
  m = high ? m * 0.5f : m;
  e = high ? e + 1 : e;
  float r = log2_mantissa(m) + (float)e;
  r = x == 0.0f ? -INFINITY : r;
  r = (x == INFINITY || x != x) ? x : r;
  return r;
}

// 2^y (y = -inf: 0, +inf: +inf, NaN: NaN)
inline float exp2_portable(float y) {
  float yc = y < -151.0f ? -151.0f : (y > 129.0f ? 129.0f : y);
  float n = (yc + 12582912.0f) - 12582912.0f;  // round to nearest even: exact for |y| < 2^22
  float f = yc - n;                            // exact, |f| <= 1/2
  float p = kExp2C[7];
  for (int i = 6; i >= 0; --i) p = p * f + kExp2C[i];
  int32_t ni = yc == yc ? (int32_t)n : 0;
  int32_t n1 = ni < -100 ? -100 : (ni > 127 ? 127 : ni);  // p * 2^n1 stays a normal float
  int32_t n2 = ni - n1;                                    // then one rounding into subnormals
  return (p * as_float((uint32_t)(n1 + 127) << 23)) * as_float((uint32_t)(n2 + 127) << 23);
}

// ---- FP8 codes ------------------------------------------------------------------------------

struct Fp8 {
  int mbits, bias;    // mantissa bits; exponent bias (7 for E4M3, 15 for E5M2)
  float max;          // largest finite magnitude
  float sub_scale;    // 2^(emin - mbits): the subnormal spacing
  float inv_sub;      // its inverse
  float min_normal;   // 2^emin
};
const Fp8 kE4M3 = {3, 7, 448.0f, 0.001953125f, 512.0f, 0.015625f};
const Fp8 kE5M2 = {2, 15, 57344.0f, 1.52587890625e-05f, 65536.0f, 6.103515625e-05f};

// value of an FP8 code (NaN codes: NaN; E5M2's Inf codes: Inf)
inline float fp8_value(uint32_t code, const Fp8& f) {
  uint32_t mag = code & 0x7Fu;
  uint32_t field = mag >> f.mbits;
  float normal = as_float((mag << (23 - f.mbits)) + ((uint32_t)(127 - f.bias) << 23));
  float sub = (float)(int32_t)(mag & ((1u << f.mbits) - 1)) * f.sub_scale;
  float v = field == 0 ? sub : normal;
  uint32_t top = (uint32_t)(0x7Fu >> f.mbits);  // all-ones exponent field
  bool special = f.mbits == 3 ? mag == 0x7Fu : field == top;
  bool inf = f.mbits == 2 && mag == 0x7Cu;
  v = special ? (inf ? INFINITY : NAN) : v;
  return copy_sign(v, as_float((code & 0x80u) << 24));
}

// code of y rounded to nearest even onto the FP8 grid, saturating (NaN: 0x7F)
inline uint32_t fp8_code(float y, const Fp8& f) {
  float mag = std::fabs(y);
  mag = mag > f.max ? f.max : mag;
  // below the normal range the grid is uniform: round mag / spacing to an integer
  float q = (mag * f.inv_sub + 12582912.0f) - 12582912.0f;
  uint32_t sub = (uint32_t)(int32_t)q;
  uint32_t b = as_bits(mag);
  uint32_t drop = 23 - f.mbits;
  b = b + ((1u << (drop - 1)) - 1) + ((b >> drop) & 1u);
  uint32_t normal = (((b >> 23) - (uint32_t)(127 - f.bias)) << f.mbits) | ((b >> drop) & ((1u << f.mbits) - 1));
  uint32_t code = mag < f.min_normal ? sub : normal;
  code |= (as_bits(y) >> 24) & 0x80u;
  return y != y ? 0x7Fu : code;
}

// ---- 4-bit codes ----------------------------------------------------------------------------

inline float e2m1_level(uint32_t i) {  // {0, .5, 1, 1.5, 2, 3, 4, 6}[i & 7]
  uint32_t j = i & 7u;
  float big = as_float((((j >> 1) + 126u) << 23) | ((j & 1u) << 22));
  return j >= 2 ? big : (float)(int32_t)j * 0.5f;
}
inline float ue3m1_level(uint32_t i) {  // (1 + (i & 1) / 2) * 2^(i >> 1)
  return as_float((((i >> 1) + 127u) << 23) | ((i & 1u) << 22));
}

inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; return h ^ (h >> 16);
}

}  // namespace

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

constexpr float kMinScale = 1.17549435e-38f;   // 2^-126: formats.group.MIN_SCALE
constexpr float kMinScale4 = 7.52316385e-37f;  // 2^-120: formats.fp4_moment.MIN_SCALE
constexpr float kFloat32Max = 3.40282347e+38f;

struct Scratch {
  std::vector<float> p, g, m, v, vmax, tmp;
  explicit Scratch(int n) : p(n), g(n), m(n), v(n), vmax(n), tmp(n) {}
};

const Fp8& fp8_of(int kind) { return kind == 1 ? kE4M3 : kE5M2; }

// values of one group of a moment into x[0..n)
void decode(const CoatMoment& mo, int64_t row, int64_t col0, int64_t gidx, int64_t cols, int n, float* x) {
  float scale = mo.scales[gidx];
  if (mo.kind <= 2) {
    const Fp8& f = fp8_of(mo.kind);
    const uint8_t* c = mo.codes + row * cols + col0;
    if (!mo.exponents) {
      for (int j = 0; j < n; ++j) x[j] = fp8_value(c[j], f) * scale;
    } else {
      float inv_k = 16.0f / (float)mo.exponents[gidx];
      float log_scale = log2_portable(scale);
      for (int j = 0; j < n; ++j) {
        float q = fp8_value(c[j], f);
        float r = exp2_portable(log2_portable(std::fabs(q)) * inv_k + log_scale);
        r = r > kFloat32Max ? kFloat32Max : r;
        r = q != 0.0f ? r : 0.0f;
        x[j] = copy_sign(r, q);
      }
    }
  } else {
    const uint8_t* c = mo.codes + row * ((cols + 1) / 2) + col0 / 2;
    bool sq = mo.kind == 4;
    float step = scale / (sq ? 192.0f : 6.0f);
    for (int j = 0; j < n; ++j) {
      uint32_t code = (c[j >> 1] >> ((j & 1) * 4)) & 15u;
      float lev = sq ? ue3m1_level(code) : e2m1_level(code);
      lev = (!sq && code >= 8) ? -lev : lev;
      float u = lev * step;
      x[j] = sq ? u * u : u;
    }
  }
  if (mo.second)
    for (int j = 0; j < n; ++j) x[j] = x[j] != x[j] ? INFINITY : x[j];
}

// encode x[0..n) into one group of a moment; rounding offsets (ue3m1) from the group's first
// element `offset` in the whole parameter
void encode(const CoatMoment& mo, const CoatStep& a, int64_t row, int64_t col0, int64_t gidx,
            int64_t cols, int n, const float* x, float* mag, int64_t offset) {
  if (mo.kind <= 2) {
    const Fp8& f = fp8_of(mo.kind);
    uint8_t* c = mo.codes + row * cols + col0;
    uint32_t mx_bits = 0;  // magnitudes compare as their bit patterns
    for (int j = 0; j < n; ++j) {
      mag[j] = is_finite(x[j]) ? std::fabs(x[j]) : 0.0f;
      uint32_t b = as_bits(mag[j]);
      mx_bits = b > mx_bits ? b : mx_bits;
    }
    float mx = as_float(mx_bits);
    if (!mo.exponents) {
      float s = mx / f.max;
      s = s < kMinScale ? kMinScale : (s > mo.scale_max ? mo.scale_max : s);
      s = mx > 0.0f ? s : 0.0f;
      float inv = s > 0.0f ? 1.0f / s : 0.0f;
      for (int j = 0; j < n; ++j) c[j] = (uint8_t)fp8_code(is_finite(x[j]) ? x[j] * inv : NAN, f);
      mo.scales[gidx] = s;
      return;
    }
    uint32_t mn_bits = 0x7F800000u;
    for (int j = 0; j < n; ++j) {
      uint32_t b = mag[j] > 0.0f ? as_bits(mag[j]) : 0x7F800000u;
      mn_bits = b < mn_bits ? b : mn_bits;
    }
    float mn = as_float(mn_bits);
    float log_mx = log2_portable(mx);
    float log_range = log_mx - log2_portable(mn);
    float k16 = std::floor(mo.k_numerator / log_range);
    k16 = k16 < 1.0f ? 1.0f : (k16 > 255.0f ? 255.0f : k16);
    k16 = mx > 0.0f ? k16 : 16.0f;
    float inv_k = 16.0f / k16;
    float k = k16 / 16.0f;
    float s = exp2_portable(log_mx - mo.log2_max * inv_k);
    s = s < kMinScale ? kMinScale : s;
    s = mx > 0.0f ? s : 0.0f;
    float log_s = log2_portable(s);
    for (int j = 0; j < n; ++j) {
      float y = exp2_portable(k * (log2_portable(mag[j]) - log_s));
      y = mag[j] > 0.0f ? y : 0.0f;
      y = copy_sign(y, x[j]);
      c[j] = (uint8_t)fp8_code(is_finite(x[j]) ? y : NAN, f);
    }
    mo.scales[gidx] = s;
    mo.exponents[gidx] = (uint8_t)k16;
    return;
  }
  // 4-bit: u = sqrt(x) for ue3m1_sqrt, x for e2m1
  bool sq = mo.kind == 4;
  uint32_t mx_bits = 0;
  bool all_finite = true;
  for (int j = 0; j < n; ++j) {
    float u = sq ? std::sqrt(x[j]) : x[j];
    bool fin = is_finite(u);
    all_finite = all_finite && fin;
    mag[j] = fin ? u : 0.0f;
    uint32_t b = as_bits(mag[j]) & 0x7FFFFFFFu;
    mx_bits = b > mx_bits ? b : mx_bits;
  }
  float mx = as_float(mx_bits);
  float s = mx > 0.0f ? (mx < kMinScale4 ? kMinScale4 : mx) : 0.0f;
  float top = sq ? 192.0f : 6.0f;
  float to_units = s > 0.0f ? top / s : 0.0f;
  uint8_t* c = mo.codes + row * ((cols + 1) / 2) + col0 / 2;
  for (int j = 0; j < n; j += 2) {
    uint32_t pair = 0;
    for (int h = 0; h < 2 && j + h < n; ++h) {
      float u = mag[j + h];
      float y = std::fabs(u) * to_units;
      y = y > top ? top : y;
      uint32_t code;
      if (sq) {
        uint64_t off = (uint64_t)(offset + j + h) & 0xFFFFFFFFu;
        uint32_t hash = mix32((uint32_t)((off >> 1) * 0x85EBCA77u) ^ a.rounding_key);
        uint64_t r = ((uint64_t)((hash >> ((off & 1) * 16)) & 0xFFFFu) << 6) | 32u;
        int64_t i = (int64_t)(((uint64_t)as_bits(y) + r) >> 22) - 254;
        code = (uint32_t)(i < 0 ? 0 : (i > 15 ? 15 : i));
      } else {  // nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even index
        const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
        uint32_t idx = 0;
        for (int t = 0; t < 7; ++t) idx += y > mids[t] ? 1u : 0u;
        float mid = mids[idx > 6 ? 6 : idx];
        idx += (y == mid && (idx & 1u)) ? 1u : 0u;
        code = idx | (u < 0.0f ? 8u : 0u);
      }
      pair |= code << (4 * h);
    }
    c[j >> 1] = (uint8_t)pair;
  }
  mo.scales[gidx] = all_finite ? s : NAN;
}

inline float bf16_to_float(uint16_t h) { return as_float((uint32_t)h << 16); }

// float32 -> bfloat16 to nearest even (the NaN bits as torch's cast gives them)
inline uint16_t round_bf16(float x, uint16_t nan_bits) {
  uint64_t b = as_bits(x);
  uint16_t r = (uint16_t)(((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) & 0xFFFFu);
  return x != x ? nan_bits : r;
}

inline float correction_scale(uint16_t w) {  // ulp(w) / 256 (formats.master_weights)
  int32_t field = (w >> 7) & 0xFF;
  field = field < 16 ? 16 : field;
  return as_float((uint32_t)(field - 15) << 23);
}

void step_group(CoatStep& a, Scratch& s, int64_t row, int64_t col0, int64_t gidx, int n, int64_t* bad) {
  int64_t base = row * a.cols + col0;
  float* p = s.p.data();
  float* g = s.g.data();
  float* m = s.m.data();
  float* v = s.v.data();
  if (a.param_bf16) {
    const uint16_t* w = (const uint16_t*)a.param + base;
    if (a.master_bits == 24) {
      const int8_t* c = (const int8_t*)a.correction + base;
      for (int j = 0; j < n; ++j) p[j] = bf16_to_float(w[j]) + (float)c[j] * correction_scale(w[j]);
    } else if (a.master_bits == 32) {
      const int16_t* r = (const int16_t*)a.correction + base;
      for (int j = 0; j < n; ++j) {
        float x = as_float(((uint32_t)w[j] << 16) + (uint32_t)(int32_t)r[j]);
        float wf = bf16_to_float(w[j]);
        p[j] = wf != wf ? wf : x;
      }
    } else {
      for (int j = 0; j < n; ++j) p[j] = bf16_to_float(w[j]);
    }
  } else {
    std::memcpy(p, (const float*)a.param + base, sizeof(float) * n);
  }
  if (a.grad_bf16) {
    const uint16_t* gg = (const uint16_t*)a.grad + base;
    for (int j = 0; j < n; ++j) g[j] = bf16_to_float(gg[j]);
  } else {
    std::memcpy(g, (const float*)a.grad + base, sizeof(float) * n);
  }
  if (a.has_inv_scale)
    for (int j = 0; j < n; ++j) g[j] = g[j] * a.inv_scale;
  if (a.maximize)
    for (int j = 0; j < n; ++j) g[j] = -g[j];
  decode(a.m, row, col0, gidx, a.cols, n, m);
  decode(a.v, row, col0, gidx, a.cols, n, v);
  if (a.weight_decay)
    for (int j = 0; j < n; ++j) p[j] = p[j] * a.decay;
  // torch's lerp: weight < 1/2 steps from the start, otherwise back from the end
  bool from_start = std::fabs(a.lerp_weight) < 0.5f;
  float coeff = from_start ? a.lerp_weight : a.lerp_weight - 1.0f;
  if (a.fma_lerp) {
    for (int j = 0; j < n; ++j) m[j] = std::fma(coeff, g[j] - m[j], from_start ? m[j] : g[j]);
  } else {
    for (int j = 0; j < n; ++j) m[j] = (from_start ? m[j] : g[j]) + coeff * (g[j] - m[j]);
  }
  if (a.fma_addcmul) {
    for (int j = 0; j < n; ++j) v[j] = std::fma(a.one_minus_beta2 * g[j], g[j], v[j] * a.beta2);
  } else {
    for (int j = 0; j < n; ++j) v[j] = v[j] * a.beta2 + a.one_minus_beta2 * g[j] * g[j];
  }
  const float* den_src = v;
  if (a.amsgrad) {
    float* vm = s.vmax.data();
    decode(a.vmax, row, col0, gidx, a.cols, n, vm);
    for (int j = 0; j < n; ++j) vm[j] = (vm[j] != vm[j] || v[j] != v[j]) ? NAN : (v[j] > vm[j] ? v[j] : vm[j]);
    den_src = vm;
  }
  int64_t nonfinite = 0;
  for (int j = 0; j < n; ++j) {
    float denom = std::sqrt(den_src[j]) / a.bc2_sqrt + a.eps;
    p[j] = p[j] + (a.neg_step_size * m[j]) / denom;
    float t = m[j] + v[j];
    nonfinite += (t - t) != 0.0f ? 1 : 0;
  }
  *bad += nonfinite;
  int64_t offset = a.first_element + base;
  encode(a.m, a, row, col0, gidx, a.cols, n, m, s.tmp.data(), offset);
  encode(a.v, a, row, col0, gidx, a.cols, n, v, s.tmp.data(), offset);
  if (a.amsgrad) encode(a.vmax, a, row, col0, gidx, a.cols, n, s.vmax.data(), s.tmp.data(), offset);
  if (!a.param_bf16) {
    std::memcpy((float*)a.param + base, p, sizeof(float) * n);
    return;
  }
  uint16_t* w = (uint16_t*)a.param + base;
  if (a.master_bits == 24) {
    int8_t* c = (int8_t*)a.correction + base;
    for (int j = 0; j < n; ++j) {
      uint16_t h = round_bf16(p[j], a.bf16_nan);
      float d = std::nearbyint((p[j] - bf16_to_float(h)) / correction_scale(h));
      d = d < -128.0f ? -128.0f : (d > 127.0f ? 127.0f : d);
      d = is_finite(d) ? d : 0.0f;
      w[j] = h;
      c[j] = (int8_t)(int32_t)d;
    }
  } else if (a.master_bits == 32) {
    int16_t* r = (int16_t*)a.correction + base;
    for (int j = 0; j < n; ++j) {
      uint32_t b = as_bits(p[j]);
      uint32_t high = (uint32_t)(((uint64_t)b + 0x8000u) >> 16);
      r[j] = (int16_t)(uint16_t)(b - (high << 16));
      w[j] = p[j] != p[j] ? a.bf16_nan : (uint16_t)high;
    }
  } else if (a.master_bits == 16) {
    for (int j = 0; j < n; ++j) {
      uint32_t off = (uint32_t)(uint64_t)(offset + j);
      uint32_t bits = as_bits(p[j]) + (mix32((off * 0x85EBCA77u) ^ a.master_key) & 0xFFFFu);
      w[j] = p[j] != p[j] ? a.bf16_nan : (uint16_t)(bits >> 16);
    }
  } else {
    for (int j = 0; j < n; ++j) w[j] = round_bf16(p[j], a.bf16_nan);
  }
}

}  // namespace

extern "C" int coat_adamw_step(CoatStep* a) {
  const int64_t gs = a->group_size;
  const int64_t per_row = a->cols > 0 ? (a->cols + gs - 1) / gs : 1;
  const int64_t total = a->rows * per_row;
  int64_t bad = 0;
#pragma omp parallel num_threads(a->threads) reduction(+ : bad)
  {
    Scratch s((int)gs);
#pragma omp for schedule(static)
    for (int64_t gidx = 0; gidx < total; ++gidx) {
      int64_t row = gidx / per_row;
      int64_t col0 = (gidx - row * per_row) * gs;
      int64_t n = a->cols - col0 < gs ? a->cols - col0 : gs;
      if (n > 0) step_group(*a, s, row, col0, gidx, (int)n, &bad);
    }
  }
  a->nonfinite = bad;
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
