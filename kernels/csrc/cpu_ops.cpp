// CPU ops that read each weight once for every row of a small batch, and a decoder layer in one call
// (kernels/native.py builds this file; kernels/int4.py, kernels/int8.py, specstream/models/attention.py
// and specstream/models/base.py call it, each beside its torch reference).
//
// Batch invariance: every output element is computed by one fixed sequence of operations over its
// own inputs, whatever the number of rows in the call and however the work is split between threads
// (threads split the output features, never a reduction). So a row's result is the same bits alone,
// as one of γ+1 verify positions, or beside other sequences' rows: greedy speculation reproduces
// plain decoding only then.
//
// Weights stay in GGUF's blocks of 32: Q4_1 (a 4-bit code per weight, a float scale d and minimum m per
// block: w = d * q + m) and Q8_0 (an int8 code per weight, a scale d per block: w = d * q). A block's
// contribution to a dot product is d * Σ x_i q_i (+ m * Σ x_i): the codes are exact in float32, so
// this is the dequantized matrix's dot product up to the order of float32 additions.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

// ---------------------------------------------------------------------------------------------------
// Activations as float32 rows, and each row's sum per block (the Q4_1 minimum's term).

at::Tensor as_float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}

bool has_avx512_bf16() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

bool has_avx512_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

constexpr int kTile = 8;  // rows per pass over a weight row (their accumulators stay in registers)

// ---------------------------------------------------------------------------------------------------
// Q8_0: codes [N, K] int8, d [N, K/32] float32.

template <int R>
__attribute__((target("avx512f,avx512bw")))
void q8_rows_avx512(const int8_t* codes, const float* d, const float* x, int64_t blocks, int64_t K, float* out,
                    int64_t N) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* c = codes + kBlock * b;
    __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
    __m512 scale = _mm512_set1_ps(d[b]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + kBlock * b;
      __m512 s = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), q_hi, _mm512_mul_ps(_mm512_loadu_ps(xb), q_lo));
      acc[r] = _mm512_fmadd_ps(scale, s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(acc[r]);
}

// AVX2: the generic path's 16 lanes as two vectors of 8, each lane the same operations (x q, a fused
// x q + s, a fused d s + acc), then the 16 lanes summed in index order: the generic path's bits.
template <int R>
__attribute__((target("avx2,fma")))
void q8_rows_avx2(const int8_t* codes, const float* d, const float* x, int64_t blocks, int64_t K, float* out,
                  int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* c = codes + kBlock * b;
    __m256 q[4];  // codes 0..7, 8..15, 16..23, 24..31
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i))));
    }
    const __m256 scale = _mm256_set1_ps(d[b]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + kBlock * b;
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16 + 8 * h), q[2 + h],
                                         _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * h), q[h]));
        acc[r][h] = _mm256_fmadd_ps(scale, s, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[16];
    _mm256_storeu_ps(lanes, acc[r][0]);
    _mm256_storeu_ps(lanes + 8, acc[r][1]);
    float total = 0.0f;
    for (float v : lanes) total += v;
    out[r * N] = total;
  }
}

// bfloat16 activations: each block's weights are formed once, w = d * q in float32 (exact: a half
// scale times an 8-bit code) rounded to bfloat16 — the very values of the dense bfloat16 matrix
// dequantized from the same blocks — then each row takes the block's 32 products in one dot-product
// instruction. Two accumulators per row (even and odd blocks), in the same order for every row.
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline
__m512bh q8_block_bf16(const int8_t* codes, float d) {
  __m512 scale = _mm512_set1_ps(d);
  __m512 lo = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)))));
  __m512 hi = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // weights 0..31 in order
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void q8_rows_bf16(const int8_t* codes, const float* d, const uint16_t* x, int64_t blocks, int64_t K, float* out,
                  int64_t N) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    __m512bh w0 = q8_block_bf16(codes + kBlock * b, d[b]);
    __m512bh w1 = q8_block_bf16(codes + kBlock * (b + 1), d[b + 1]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = x + r * K + kBlock * b;
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(xr), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(xr + kBlock), w1);
    }
  }
  if (b < blocks) {
    __m512bh w0 = q8_block_bf16(codes + kBlock * b, d[b]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + r * K + kBlock * b), w0);
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

using Q8Rows = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, float*, int64_t);
using Q8RowsBf16 = void (*)(const int8_t*, const float*, const uint16_t*, int64_t, int64_t, float*, int64_t);
constexpr Q8RowsBf16 kQ8RowsBf16[] = {q8_rows_bf16<1>, q8_rows_bf16<2>, q8_rows_bf16<3>, q8_rows_bf16<4>,
                                      q8_rows_bf16<5>, q8_rows_bf16<6>, q8_rows_bf16<7>, q8_rows_bf16<8>};
constexpr Q8Rows kQ8Rows[] = {q8_rows_avx512<1>, q8_rows_avx512<2>, q8_rows_avx512<3>, q8_rows_avx512<4>,
                              q8_rows_avx512<5>, q8_rows_avx512<6>, q8_rows_avx512<7>, q8_rows_avx512<8>};
constexpr Q8Rows kQ8RowsAvx2[] = {q8_rows_avx2<1>, q8_rows_avx2<2>, q8_rows_avx2<3>, q8_rows_avx2<4>};

float q8_dot_generic(const int8_t* codes, const float* d, const float* x, int64_t blocks) {
  float lanes[16] = {0};
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* c = codes + kBlock * b;
    const float* xb = x + kBlock * b;
    for (int i = 0; i < 16; ++i) {
      float s = xb[i] * float(c[i]);
      s = std::fma(xb[16 + i], float(c[16 + i]), s);
      lanes[i] = std::fma(d[b], s, lanes[i]);
    }
  }
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kChar, "q8_matmul: x [M, K], codes [N, K] int8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), blocks = K / kBlock;
  TORCH_CHECK(codes.size(1) == K && K % kBlock == 0, "q8_matmul: codes [N, K] with K = ", K, " a multiple of 32");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({N, blocks}) && d.scalar_type() == at::kFloat, "q8_matmul: d [N, K/32] float32");
  const bool bf16 = x.scalar_type() == at::kBFloat16 && has_avx512_bf16();
  at::Tensor xin = bf16 ? x.contiguous() : as_float_rows(x);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* xp = bf16 ? nullptr : xin.data_ptr<float>();
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>()) : nullptr;
  float* op = out.data_ptr<float>();
  const bool wide = has_avx512(), avx2 = !wide && has_avx2_fma();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r0 = 0; r0 < M; r0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, M - r0);
        if (bf16) {
          kQ8RowsBf16[rows - 1](cp + n * K, dp + n * blocks, xh + r0 * K, blocks, K, op + r0 * N + n, N);
          continue;
        }
        if (wide) {
          kQ8Rows[rows - 1](cp + n * K, dp + n * blocks, xp + r0 * K, blocks, K, op + r0 * N + n, N);
          continue;
        }
        if (avx2) {  // four rows at a time: their 8 accumulators and a block's codes fit the registers
          for (int64_t r1 = r0; r1 < r0 + rows; r1 += 4) {
            const int64_t four = std::min<int64_t>(4, r0 + rows - r1);
            kQ8RowsAvx2[four - 1](cp + n * K, dp + n * blocks, xp + r1 * K, blocks, K, op + r1 * N + n, N);
          }
          continue;
        }
        for (int64_t r = r0; r < r0 + rows; ++r) {
          op[r * N + n] = q8_dot_generic(cp + n * K, dp + n * blocks, xp + r * K, blocks);
        }
      }
    }
  });
  return out;  // float32 logits
}

// ---------------------------------------------------------------------------------------------------
// Q4_1 with bfloat16 activations: a weight-stationary kernel whose lanes are 16 output features.
//
// Layout (kernels/int4.py ``native_layout``): per tile of 16 output features t and block of 32 inputs b,
// 256 bytes: 8 chunks of 32 bytes, chunk c covering inputs k0 = 32 b + 4 c .. k0 + 3; byte 2 i + j of a
// chunk holds feature i's code for input k0 + j in its low nibble and for k0 + 2 + j in its high one.
// d and m [T, B, 16] float16 (the file's half-precision scale and minimum), widened to float32 exactly.
//
// A chunk's 32 bytes widen to 32 words; a table lookup (vpermw reads the low 5 bits of each word) turns
// the low nibbles, then the high ones, into the codes as bfloat16 (exact: integers 0..15): 64 weights
// formed with four instructions, once for every row of the call. Each row then takes them in two
// dot-product instructions against its inputs (k0, k0 + 1) and (k0 + 2, k0 + 3) broadcast to every lane:
// s += q x exactly per product, summed in float32. A block ends with y += d s, then y += m Σx (Σx: the
// row's sum over the block in float32, by a fixed sequence of vector additions). Everything a row's output sees is fixed by its
// own inputs: the same bits whatever the number of rows.

constexpr int64_t kQ4Tile = 16;                   // output features per tile: the lanes
constexpr int64_t kQ4TileBytes = kQ4Tile * kBlock / 2;  // one tile's codes for one block

// bfloat16 of the codes 0..15, twice (word j holds code j & 15): exact, small integers.
alignas(64) constexpr uint16_t kCodeBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
void q4_tile_bf16(const uint16_t* d, const uint16_t* m, const uint8_t* w, const uint16_t* x, const float* xsum,
                  int64_t blocks, int64_t K, uint16_t* out, int64_t N) {
  const __m512i lut = _mm512_load_si512(kCodeBf16);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    const uint8_t* wb = w + kQ4TileBytes * b;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, lut);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + kBlock * b + 4 * c;
        int32_t pair0, pair1;
        std::memcpy(&pair0, xr, 4);
        std::memcpy(&pair1, xr + 2, 4);
        s[r] = _mm512_dpbf16_ps(s[r], lo, (__m512bh)_mm512_set1_epi32(pair0));
        s[r] = _mm512_dpbf16_ps(s[r], hi, (__m512bh)_mm512_set1_epi32(pair1));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kQ4Tile * b)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + kQ4Tile * b)));
    for (int r = 0; r < R; ++r) {
      y[r] = _mm512_fmadd_ps(dv, s[r], y[r]);
      y[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * blocks + b]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N), (__m256i)_mm512_cvtneps_pbh(y[r]));
  }
}

using Q4Tile = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const uint16_t*, const float*, int64_t,
                        int64_t, uint16_t*, int64_t);
constexpr Q4Tile kQ4Tiles[] = {q4_tile_bf16<1>, q4_tile_bf16<2>, q4_tile_bf16<3>, q4_tile_bf16<4>,
                               q4_tile_bf16<5>, q4_tile_bf16<6>, q4_tile_bf16<7>, q4_tile_bf16<8>};

// ---------------------------------------------------------------------------------------------------
// Q4_1 with 8-bit activations (opt-in: `activations="int8"`): the same native layout, integer dot
// products four codes at a time (AVX-512 VNNI), as llama.cpp multiplies its 4-bit blocks.
//
// Each row's block of 32 inputs is quantised once per call, from its own values only: a scale
// dx = max|x| / 127 and codes qx = nearest integer of x / dx (|qx| <= 127), stored in the order the
// weight lanes want (below). A chunk's 32 bytes widen to 32 words; (v | v << 4) & 0x0F0F puts byte
// 2 i + j's two codes into the two bytes of word 2 i + j, so lane i (words 2 i, 2 i + 1) holds
// feature i's codes for inputs k0, k0 + 2, k0 + 1, k0 + 3: one instruction pair forms 64 weights as
// bytes, and each row takes them in ONE dot-product instruction (64 products, summed exactly in
// int32) against its four codes in that order. A block ends with y += (d dx) s, then y += m Σx (Σx in
// float32 from the bfloat16 inputs, as the bfloat16 kernel). The weights' arithmetic is exact; the
// activations are rounded to 8 bits per block of 32 (the error `bench step` and the tests measure).

template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vnni,f16c")))
void q4_tile_i8(const uint16_t* d, const uint16_t* m, const uint8_t* w, const int8_t* xq, const float* xd,
                const float* xsum, int64_t blocks, int64_t K, uint16_t* out, int64_t N) {
  const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
    const uint8_t* wb = w + kQ4TileBytes * b;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c)));
      const __m512i q = _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(v, 4), nibbles, 0xA8);  // (v | v << 4) & 0x0F0F
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + kBlock * b + 4 * c, 4);
        s[r] = _mm512_dpbusd_epi32(s[r], q, _mm512_set1_epi32(four));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kQ4Tile * b)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + kQ4Tile * b)));
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * blocks + b]));
      y[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s[r]), y[r]);
      y[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * blocks + b]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N), (__m256i)_mm512_cvtneps_pbh(y[r]));
  }
}

using Q4TileI8 = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const int8_t*, const float*, const float*,
                          int64_t, int64_t, uint16_t*, int64_t);
constexpr Q4TileI8 kQ4TilesI8[] = {q4_tile_i8<1>, q4_tile_i8<2>, q4_tile_i8<3>, q4_tile_i8<4>,
                                   q4_tile_i8<5>, q4_tile_i8<6>, q4_tile_i8<7>, q4_tile_i8<8>};

float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A call's per-row scratch: each row's sum per block, and for 8-bit activations its codes and scales.
struct Q4Scratch {
  std::vector<float> xsum, xd;  // [M, K/32]
  std::vector<int8_t> xq;       // [M, K], each group of 4 in the order k0, k0 + 2, k0 + 1, k0 + 3
};

// One call's operands: x [M, K] bfloat16 rows, the scratch, the weight in the native layout.
struct Q4Call {
  const uint16_t* x;
  float* xsum;  // [M, K/32]
  float* xd;    // [M, K/32] (int8 only)
  int8_t* xq;   // [M, K] (int8 only)
  bool int8;
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
  int64_t M, K, blocks, tiles, N;
  uint16_t* out;  // [M, N] bfloat16
};

Q4Call q4_call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, bool int8,
               Q4Scratch& scratch, at::Tensor& out) {
  TORCH_CHECK(has_avx512_bf16(), "q4_matmul: needs AVX-512 BF16 (kernels/int4.py checks q4_native first)");
  TORCH_CHECK(!int8 || has_avx512_vnni(), "q4_matmul: 8-bit activations need AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "q4_matmul: x [M, K] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, tiles = d.size(0), N = tiles * kQ4Tile;
  TORCH_CHECK(K % kBlock == 0 && codes.scalar_type() == at::kByte && codes.numel() == N * K / 2,
              "q4_matmul: codes of [N, K] in the native layout, K a multiple of 32");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({tiles, blocks, kQ4Tile}) && m.sizes() == d.sizes() &&
              d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "q4_matmul: d, m [N/16, K/32, 16] float16");
  scratch.xsum.resize(M * blocks);
  if (int8) {
    scratch.xd.resize(M * blocks);
    scratch.xq.resize(M * K);
  }
  if (!out.defined()) out = at::empty({M, N}, x.options());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({M, N}) && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "q4_matmul: out [M, N] bfloat16");
  return {reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), scratch.xsum.data(), scratch.xd.data(),
          scratch.xq.data(), int8, codes.data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()),
          M, K, blocks, tiles, N, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
}

// Each row's sum over each block of 32 inputs (the minimum's term), and for 8-bit activations each
// block's scale and codes: before any tile. A block's 32 values as two vectors of 16 floats;
// their sum and largest magnitude by fixed sequences of vector operations (the same bits wherever the
// row is computed); codes x / dx rounded to the nearest integer (ties to even), then put in the order
// k0, k0 + 2, k0 + 1, k0 + 3 of each group of four that the weight lanes hold.
__attribute__((target("avx512f,avx512bw")))
void q4_prepare(const Q4Call& c) {
  // Bytes of a 16-byte group in the order 0, 2, 1, 3 of every four.
  const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                         0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t r = 0; r < c.M; ++r) {
    for (int64_t b = 0; b < c.blocks; ++b) {
      const uint16_t* xb = c.x + r * c.K + kBlock * b;
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16))), 16));
      c.xsum[r * c.blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      if (!c.int8) continue;
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float dx = top / 127.0f;
      c.xd[r * c.blocks + b] = dx;
      __m256i codes = _mm256_setzero_si256();
      if (dx != 0.0f) {
        const __m512 div = _mm512_set1_ps(dx);
        const __m128i qlo = _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_div_ps(lo, div),
                                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m128i qhi = _mm512_cvtepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_div_ps(hi, div),
                                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        codes = _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(qlo), qhi, 1), order);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.xq + r * c.K + kBlock * b), codes);
    }
  }
}

// Output tiles [begin, end) of 16 features for every row: a thread's share.
void q4_tiles(const Q4Call& c, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t r0 = 0; r0 < c.M; r0 += kTile) {
      const int64_t rows = std::min<int64_t>(kTile, c.M - r0);
      const uint16_t *d = c.d + t * c.blocks * kQ4Tile, *m = c.m + t * c.blocks * kQ4Tile;
      const uint8_t* w = c.codes + t * c.blocks * kQ4TileBytes;
      uint16_t* out = c.out + r0 * c.N + t * kQ4Tile;
      if (c.int8) {
        kQ4TilesI8[rows - 1](d, m, w, c.xq + r0 * c.K, c.xd + r0 * c.blocks, c.xsum + r0 * c.blocks, c.blocks, c.K,
                             out, c.N);
      } else {
        kQ4Tiles[rows - 1](d, m, w, c.x + r0 * c.K, c.xsum + r0 * c.blocks, c.blocks, c.K, out, c.N);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Q4_1 with float32 activations, on any x86-64 CPU with AVX2, FMA and F16C: the same native layout,
// 8 lanes a vector, so a tile's 16 features are two vectors per row.
//
// A chunk's 32 bytes hold features 0..7 in their first 16 (bytes 2 i + j) and 8..15 in the others.
// The low nibbles, then the high ones, are masked out and each 16-byte half shuffled to its even
// bytes (j = 0) then its odd ones (j = 1): inputs k0 and k0 + 1 from the low nibbles, k0 + 2 and
// k0 + 3 from the high. Each 8 codes widen to 8 floats (exact: integers 0..15), once per call for
// every row of it; each row then takes them by fused multiply-adds against its inputs broadcast to
// every lane: s = Σ q x per block, in the order c = 0..7, j = 0..3. A block ends with y += d s,
// then y += m Σx (Σx: the row's sum over the block, by a fixed sequence of vector additions), as
// the bfloat16 kernel. Everything a row's output sees is fixed by its own inputs: the same bits
// whatever the number of rows. Four rows share a pass (their 8 accumulators and a chunk's codes fit
// the 16 vector registers).

constexpr int kTileF32 = 4;  // rows per pass of the float32 kernel

template <int R>
__attribute__((target("avx2,fma,f16c")))
void q4_tile_f32(const uint16_t* d, const uint16_t* m, const uint8_t* w, const float* x, const float* xsum,
                 int64_t blocks, int64_t K, float* out, int64_t N) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // In each 16-byte half: its even bytes, then its odd ones.
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  __m256 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    const uint8_t* wb = w + kQ4TileBytes * b;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      // [features 0..7 | 8..15] x [k0 + j per half]: nibbles (j: byte order of each half)
      const __m256i nib[2] = {_mm256_shuffle_epi8(_mm256_and_si256(v, low4), split),
                              _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), split)};
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i half = nib[j >> 1];
        const __m128i a = _mm256_castsi256_si128(half), z = _mm256_extracti128_si256(half, 1);
        const __m128i first = (j & 1) ? _mm_srli_si128(a, 8) : a, second = (j & 1) ? _mm_srli_si128(z, 8) : z;
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));   // features 0..7
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));  // features 8..15
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256 xj = _mm256_broadcast_ss(x + r * K + kBlock * b + 4 * c + j);
          s[r][0] = _mm256_fmadd_ps(w0, xj, s[r][0]);
          s[r][1] = _mm256_fmadd_ps(w1, xj, s[r][1]);
        }
      }
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kQ4Tile * b)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kQ4Tile * b + 8)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + kQ4Tile * b)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + kQ4Tile * b + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 sum = _mm256_set1_ps(xsum[r * blocks + b]);
      y[r][0] = _mm256_fmadd_ps(m0, sum, _mm256_fmadd_ps(d0, s[r][0], y[r][0]));
      y[r][1] = _mm256_fmadd_ps(m1, sum, _mm256_fmadd_ps(d1, s[r][1], y[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * N, y[r][0]);
    _mm256_storeu_ps(out + r * N + 8, y[r][1]);
  }
}

using Q4TileF32 = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const float*, const float*, int64_t,
                           int64_t, float*, int64_t);
constexpr Q4TileF32 kQ4TilesF32[] = {q4_tile_f32<1>, q4_tile_f32<2>, q4_tile_f32<3>, q4_tile_f32<4>};

// Each row's sum over each block of 32 inputs: four vectors of 8, added pairwise, then the 8 lanes
// in a fixed order.
__attribute__((target("avx2,fma")))
void q4_block_sums_f32(const float* x, int64_t M, int64_t K, float* xsum) {
  const int64_t blocks = K / kBlock;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + kBlock * b;
      const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
      xsum[r * blocks + b] = _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
    }
  }
}

// One float32 call's operands (`q4_matmul` and `LayerStack`): x [M, K] rows, each row's block sums,
// the weight in the native layout, out [M, N].
struct Q4CallF32 {
  const float* x;
  float* xsum;  // [M, K/32]
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
  int64_t M, K, blocks, tiles, N;
  float* out;
};

Q4CallF32 q4_call_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                      std::vector<float>& xsum, at::Tensor& out) {
  TORCH_CHECK(has_avx2_fma(), "q4_matmul: float32 activations need AVX2, FMA and F16C (kernels/int4.py checks "
              "q4_native first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q4_matmul: x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, tiles = d.size(0), N = tiles * kQ4Tile;
  TORCH_CHECK(K % kBlock == 0 && codes.scalar_type() == at::kByte && codes.numel() == N * K / 2,
              "q4_matmul: codes of [N, K] in the native layout, K a multiple of 32");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({tiles, blocks, kQ4Tile}) && m.sizes() == d.sizes() &&
              d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "q4_matmul: d, m [N/16, K/32, 16] float16");
  xsum.resize(M * blocks);
  if (!out.defined()) out = at::empty({M, N}, x.options());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({M, N}) && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "q4_matmul: out [M, N] float32");
  return {x.data_ptr<float>(), xsum.data(), codes.data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()),
          M, K, blocks, tiles, N, out.data_ptr<float>()};
}

void q4_prepare(const Q4CallF32& c) { q4_block_sums_f32(c.x, c.M, c.K, c.xsum); }

// Output tiles [begin, end) of 16 features for every row: a thread's share.
void q4_tiles(const Q4CallF32& c, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t r0 = 0; r0 < c.M; r0 += kTileF32) {
      const int64_t rows = std::min<int64_t>(kTileF32, c.M - r0);
      kQ4TilesF32[rows - 1](c.d + t * c.blocks * kQ4Tile, c.m + t * c.blocks * kQ4Tile,
                            c.codes + t * c.blocks * kQ4TileBytes, c.x + r0 * c.K, c.xsum + r0 * c.blocks, c.blocks,
                            c.K, c.out + r0 * c.N + t * kQ4Tile, c.N);
    }
  }
}

// One call on its own: the rows' preparation, then the tiles split between threads.
template <typename Call>
void q4_run(const Call& call) {
  q4_prepare(call);
  at::parallel_for(0, call.tiles, 1, [&](int64_t begin, int64_t end) { q4_tiles(call, begin, end); });
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     bool int8) {
  const at::Tensor xin = x.contiguous();
  at::Tensor out;
  if (x.scalar_type() == at::kFloat) {  // AVX2: x [M, K] float32 -> [M, N] float32
    TORCH_CHECK(!int8, "q4_matmul: 8-bit activations are for bfloat16 inputs");
    std::vector<float> xsum;
    q4_run(q4_call_f32(xin, codes, d, m, xsum, out));
    return out;
  }
  Q4Scratch scratch;
  q4_run(q4_call(xin, codes, d, m, int8, scratch, out));
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Attention over the slot KV cache, for every forward of a model (prefill, decode, verify).
//
// For each row b and its T new positions p = start[b] + t: RoPE on the query and key heads, the key
// and value written into the cache at p (in the cache's dtype), then for every query head
// softmax(q · k_j * scale) · v over exactly its keys j in [lo, p] (lo: the sliding window's start)
// — never over masked ones — in index order, in float32, rounded to the activations' dtype once at
// the end. A position's output therefore depends only on its query, its keys and values: not on T,
// the other rows, or how many keys the batch's longest row has (which changed the last bits of a
// float32 softmax over masked keys in the torch path).

inline float load_value(const float* p) { return *p; }
inline float load_value(const at::BFloat16* p) { return static_cast<float>(*p); }
inline void store_value(float* p, float v) { *p = v; }
inline void store_value(at::BFloat16* p, float v) { *p = static_cast<at::BFloat16>(v); }

// 16 values of a row as float32 (bfloat16 widened exactly).
template <typename T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
}

// Dot product over D values in a fixed order: 16 lanes over the vector, then the lanes summed.
template <typename T>
__attribute__((target("avx512f,avx512bw")))
float dot_avx512(const float* q, const T* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
float dot_generic(const float* q, const T* k, int64_t D) {
  float lanes[16] = {0};
  for (int64_t i = 0; i < D; ++i) lanes[i % 16] = std::fma(q[i], load_value(k + i), lanes[i % 16]);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

// AVX2: 8 values of a row as float32, and the generic paths (dot_generic above, axpy_generic below)
// computed 8 lanes at a time: the same fused multiply-adds on the same lanes and the lanes summed in
// index order, so the same bits as the generic paths (D a multiple of 16).
template <typename T>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
}

template <typename T>
__attribute__((target("avx2,fma")))
float dot_avx2(const float* q, const T* k, int64_t D) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0..7 and 8..15 of dot_generic
  for (int64_t i = 0; i < D; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), hi);
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

template <typename T>
__attribute__((target("avx2,fma")))
void axpy_avx2(float w, const T* v, float* out, int64_t D) {
  const __m256 scale = _mm256_set1_ps(w);
  for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(scale, load8(v + i), _mm256_loadu_ps(out + i)));
}

// out[0..D) += w * v[0..D), in float32.
template <typename T>
__attribute__((target("avx512f,avx512bw")))
void axpy_avx512(float w, const T* v, float* out, int64_t D) {
  const __m512 scale = _mm512_set1_ps(w);
  for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(out + i, _mm512_fmadd_ps(scale, load16(v + i), _mm512_loadu_ps(out + i)));
}

template <typename T>
void axpy_generic(float w, const T* v, float* out, int64_t D) {
  for (int64_t i = 0; i < D; ++i) out[i] = std::fma(w, load_value(v + i), out[i]);
}

// RoPE as transformers applies it: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1),
// computed in float32 from the row's values and the tables' (in the model's dtype).
template <typename T>
void rope(const T* x, const T* cos, const T* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rotated = i < half ? -load_value(x + i + half) : load_value(x + i - half);
    out[i] = load_value(x + i) * load_value(cos + i) + rotated * load_value(sin + i);
  }
}

// exp over 16 lanes: x = n ln2 + r (Cody-Waite, two parts of ln 2), e^r by its degree-7 Taylor
// polynomial (|r| <= ln2 / 2: relative error under 2e-7), times 2^n. A fixed sequence of operations,
// so the same inputs give the same bits wherever they are computed.
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));  // below: e^x underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Where key j of a query's window lies in its slot: lo + j for the first `head` keys (all of a
// chain's; a tree node's prefix), then base + tail[j - head] (a tree node's ancestors, root first,
// as offsets from the row's start). No list is built per query: the prefix stays a range.
struct KeyRows {
  int64_t lo, head = INT64_MAX, base = 0;
  const int64_t* tail = nullptr;
  int64_t at(int64_t j) const { return j < head ? lo + j : base + tail[j - head]; }
};

// One query head at one position over its keys, D = 16 NV, a slot's keys and values contiguous (no
// shared prefix): the AVX-512 path of step 2 below. Key j of the n = pos + 1 - lo it reads is the
// slot's position `keys.at(j)` (KeyRows: a chain's lo + j; a tree node's prefix, then its
// ancestors, so a node at depth d reads its keys in the order a chain's position d does). The
// query in registers; scores one key at a time (16 lanes over D, then the lanes summed), their
// exponentials 16 at a time (exp512), the weighted values into NV accumulators held in registers.
template <typename T, int NV>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void attend_avx512(const float* q, const T* keys, const T* values, int64_t lo, int64_t pos, float scale,
                   std::vector<float>& weights, T* dst, const KeyRows& rows) {
  __m512 qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(q + 16 * v);
  const int64_t n = pos + 1 - lo;
  weights.resize((n + 15) / 16 * 16);
  // Scores four keys at a time: four dot products of 16 lanes, their lanes summed together by one
  // shuffle-and-add tree (the last group padded with zero vectors), so every key's score takes the
  // same operations wherever it falls.
  __m128 top4 = _mm_set1_ps(-INFINITY);
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 4) {
    __m512 a[4];
    for (int r = 0; r < 4; ++r) {
      if (j + r < n) {
        const T* k = keys + rows.at(j + r) * 16 * NV;
        a[r] = _mm512_mul_ps(qv[0], load16(k));
        for (int v = 1; v < NV; ++v) a[r] = _mm512_fmadd_ps(qv[v], load16(k + 16 * v), a[r]);
      } else {
        a[r] = _mm512_setzero_ps();
      }
    }
    const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512d t01d = _mm512_castps_pd(t01), t23d = _mm512_castps_pd(t23);
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t01d, t23d)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(t01d, t23d)));  // 4 keys per 128-bit lane
    const __m512 v2 = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E));
    const __m512 v4 = _mm512_add_ps(v2, _mm512_shuffle_f32x4(v2, v2, 0xB1));
    const __m128 s4 = _mm_mul_ps(_mm512_castps512_ps128(v4), scale4);  // keys j..j+3
    const int live = int(std::min<int64_t>(4, n - j));
    const __mmask8 mask = __mmask8((1u << live) - 1);
    _mm_mask_storeu_ps(weights.data() + j, mask, s4);
    top4 = _mm_mask_max_ps(top4, mask, top4, s4);
  }
  top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
  top4 = _mm_max_ps(top4, _mm_shuffle_ps(top4, top4, 0x55));
  const float top = _mm_cvtss_f32(top4);
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, weights.data() + j), top_v));
    _mm512_mask_storeu_ps(weights.data() + j, live, e);
    sums = _mm512_mask_add_ps(sums, live, sums, e);
  }
  const float total = _mm512_reduce_add_ps(sums);
  __m512 out[NV];
  for (int v = 0; v < NV; ++v) out[v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* val = values + rows.at(j) * 16 * NV;
    const __m512 w = _mm512_set1_ps(weights[j]);
    for (int v = 0; v < NV; ++v) out[v] = _mm512_fmadd_ps(w, load16(val + 16 * v), out[v]);
  }
  const __m512 inv = _mm512_set1_ps(total);
  for (int v = 0; v < NV; ++v) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, _mm512_div_ps(out[v], inv));
    for (int i = 0; i < 16; ++i) store_value(dst + 16 * v + i, lanes[i]);
  }
}

// One layer's attention over the cache, in two passes a thread team can share: `write` the new keys
// and values (items: the B T new positions), then `attend` (items: every query head at every new
// position). The second reads what the first wrote: all of `write` must finish before `attend` starts.
template <typename T>
struct Attention {
  const T* x;  // qkv [B, T, (Hq + 2 Hkv) D]
  T *kc, *vc;  // caches [slots, Hkv, L, D]
  const T *ct, *st;  // RoPE tables [positions, D]
  T* o;  // out [B, T, Hq D]
  const int64_t* slots;
  const int64_t* starts;
  const int64_t* sources;  // [B, kv_len] slot of each key, or null: the row's own slot
  // A tree (null: a chain): node t of row b sits in the cache at starts[b] + t but at position
  // starts[b] + depth[b T + t] (its RoPE), and reads the prefix and its ancestors, whose offsets
  // from starts[b] are path[(b T + t) T + 0 .. depth] (the root 0 first, itself last).
  const int64_t *depth, *path;
  int64_t kv_len, B, T_, width, L, Hq, Hkv, D, window;
  float scale;
  bool wide;  // the AVX-512 paths (D a multiple of 16)
  bool avx2;  // else the AVX2 paths: the generic paths' bits (D a multiple of 16)

  T* cache_at(T* cache, int64_t slot, int64_t head, int64_t pos) const { return cache + ((slot * Hkv + head) * L + pos) * D; }

  void write(int64_t begin, int64_t end) const {  // 1. This forward's keys (with RoPE) and values into the cache.
    std::vector<float> rotated(D);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T_, pos = starts[b] + bt % T_, at = depth != nullptr ? starts[b] + depth[bt] : pos;
      const T* row = x + bt * width;
      for (int64_t g = 0; g < Hkv; ++g) {
        rope(row + (Hq + g) * D, ct + at * D, st + at * D, D, rotated.data());
        T* k = cache_at(kc, slots[b], g, pos);
        for (int64_t i = 0; i < D; ++i) store_value(k + i, rotated[i]);
        const T* v = row + (Hq + Hkv + g) * D;
        std::copy(v, v + D, cache_at(vc, slots[b], g, pos));
      }
    }
  }

  void attend(int64_t begin, int64_t end) const {  // 2. Every query head over its keys.
    const int64_t group = Hq / Hkv;
    std::vector<float> q(D), acc(D), weights;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % Hq, bt = item / Hq, b = bt / T_, g = h / group;
      const int64_t pos = starts[b] + (depth != nullptr ? depth[bt] : bt % T_);  // the query's position
      rope(x + bt * width + h * D, ct + pos * D, st + pos * D, D, q.data());
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      KeyRows rows{lo};
      if (depth != nullptr) {  // the prefix in [lo, start), then the ancestors at depth >= lo - start
        const int64_t first = std::max<int64_t>(0, lo - starts[b]);
        rows.head = std::max<int64_t>(0, starts[b] - lo);
        rows.base = starts[b];
        rows.tail = path + bt * T_ + first;
      }
      T* dst = o + bt * Hq * D + h * D;
      if (wide && sources == nullptr && (D == 64 || D == 128)) {
        const T* keys = cache_at(kc, slots[b], g, 0);
        const T* values = cache_at(vc, slots[b], g, 0);
        if (D == 64) {
          attend_avx512<T, 4>(q.data(), keys, values, lo, pos, scale, weights, dst, rows);
        } else {
          attend_avx512<T, 8>(q.data(), keys, values, lo, pos, scale, weights, dst, rows);
        }
        continue;
      }
      weights.resize(pos + 1 - lo);
      float top = -INFINITY;
      for (int64_t i = lo; i <= pos; ++i) {
        const int64_t j = rows.at(i - lo);
        const int64_t slot = sources != nullptr ? sources[b * kv_len + j] : slots[b];
        const T* k = cache_at(kc, slot, g, j);
        const float s = (wide ? dot_avx512(q.data(), k, D) : avx2 ? dot_avx2(q.data(), k, D)
                                                                   : dot_generic(q.data(), k, D)) * scale;
        weights[i - lo] = s;
        top = std::max(top, s);
      }
      float total = 0.0f;
      for (float& w : weights) {
        w = std::exp(w - top);
        total += w;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = lo; i <= pos; ++i) {
        const int64_t j = rows.at(i - lo);
        const int64_t slot = sources != nullptr ? sources[b * kv_len + j] : slots[b];
        const T* v = cache_at(vc, slot, g, j);
        if (wide) {
          axpy_avx512(weights[i - lo], v, acc.data(), D);
        } else if (avx2) {
          axpy_avx2(weights[i - lo], v, acc.data(), D);
        } else {
          axpy_generic(weights[i - lo], v, acc.data(), D);
        }
      }
      for (int64_t i = 0; i < D; ++i) store_value(dst + i, acc[i] / total);
    }
  }
};

// The checked operands of one layer's attention (`attention` and `LayerStack`); `out` is allocated.
struct AttentionCall {
  std::vector<int64_t> slots, starts, depth, path;  // depth, path: a tree's (Attention), empty for chains
  at::Tensor sources, out;
  int64_t kv_len = 0;

  template <typename T>
  Attention<T> bind(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cos_table,
                    const at::Tensor& sin_table, int64_t Hq, int64_t Hkv, int64_t D, double scale, int64_t window) {
    return {qkv.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), cos_table.data_ptr<T>(),
            sin_table.data_ptr<T>(), out.data_ptr<T>(), slots.data(), starts.data(),
            sources.defined() ? sources.data_ptr<int64_t>() : nullptr, depth.empty() ? nullptr : depth.data(),
            path.empty() ? nullptr : path.data(), kv_len, qkv.size(0), qkv.size(1), qkv.size(2),
            k_cache.size(2), Hq, Hkv, D, window, static_cast<float>(scale), has_avx512() && D % 16 == 0,
            !has_avx512() && has_avx2_fma() && D % 16 == 0};
  }
};

AttentionCall attention_call(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                             const at::Tensor& starts, const c10::optional<at::Tensor>& sources,
                             const c10::optional<at::Tensor>& parents, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "attention: qkv [B, T, (Hq + 2 Hkv) * D], contiguous");
  TORCH_CHECK(qkv.size(2) == (num_heads + 2 * num_kv_heads) * head_dim, "attention: qkv width ", qkv.size(2));
  TORCH_CHECK(num_heads % num_kv_heads == 0 && head_dim % 2 == 0, "attention: heads and head_dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.size(1) == num_kv_heads && k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "attention: caches [slots, Hkv, max_len, D], contiguous");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && cos_table.scalar_type() == qkv.scalar_type() &&
              sin_table.scalar_type() == qkv.scalar_type() && cos_table.is_contiguous() && sin_table.is_contiguous(),
              "attention: qkv, caches and RoPE tables share one dtype");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "attention: float32 or bfloat16, got ", qkv.scalar_type());
  const int64_t B = qkv.size(0), T_ = qkv.size(1);
  AttentionCall call;
  call.slots.assign(slots.data_ptr<int64_t>(), slots.data_ptr<int64_t>() + B);
  call.starts.assign(starts.data_ptr<int64_t>(), starts.data_ptr<int64_t>() + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(call.starts[b] + T_ <= k_cache.size(2) && call.starts[b] + T_ <= cos_table.size(0),
                "attention: positions past the cache or the RoPE tables");
  }
  if (sources.has_value()) {
    call.sources = sources->contiguous();
    call.kv_len = call.sources.size(1);
  }
  if (parents.has_value()) {  // a tree: each node's parent, before it; the root (node 0) has none (-1)
    const at::Tensor p = parents->contiguous();
    TORCH_CHECK(p.scalar_type() == at::kLong && p.dim() == 2 && p.size(0) == B && p.size(1) == T_,
                "attention: parents [B, T] int64");
    const int64_t* up = p.data_ptr<int64_t>();
    call.depth.assign(B * T_, 0);
    call.path.assign(B * T_ * T_, 0);
    for (int64_t bt = 0; bt < B * T_; ++bt) {
      const int64_t t = bt % T_, parent = up[bt];
      TORCH_CHECK(t == 0 ? parent == -1 : (parent >= 0 && parent < t), "attention: node ", t, " of row ", bt / T_,
                  " has parent ", parent, " (the root's is -1, every other node's is an earlier node)");
      if (t > 0) {
        const int64_t from = bt - t + parent;  // the parent's (b, t) index
        call.depth[bt] = call.depth[from] + 1;
        std::copy(call.path.begin() + from * T_, call.path.begin() + from * T_ + call.depth[from] + 1,
                  call.path.begin() + bt * T_);
      }
      call.path[bt * T_ + call.depth[bt]] = t;
    }
  }
  call.out = at::empty({B, T_, num_heads * head_dim}, qkv.options());
  return call;
}

template <typename T>
void attention_run(const Attention<T>& a) {
  at::parallel_for(0, a.B * a.T_, 1, [&](int64_t begin, int64_t end) { a.write(begin, end); });
  at::parallel_for(0, a.B * a.T_ * a.Hq, 1, [&](int64_t begin, int64_t end) { a.attend(begin, end); });
}

at::Tensor attention(const at::Tensor& qkv, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos_table,
                     const at::Tensor& sin_table, const at::Tensor& slots, const at::Tensor& starts,
                     const c10::optional<at::Tensor>& sources, const c10::optional<at::Tensor>& parents,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     double scale, int64_t window) {
  AttentionCall call = attention_call(qkv, k_cache, v_cache, cos_table, sin_table, slots, starts, sources, parents,
                                      num_heads, num_kv_heads, head_dim);
  if (qkv.scalar_type() == at::kFloat) {
    attention_run(call.bind<float>(qkv, k_cache, v_cache, cos_table, sin_table, num_heads, num_kv_heads, head_dim,
                                   scale, window));
  } else {
    attention_run(call.bind<at::BFloat16>(qkv, k_cache, v_cache, cos_table, sin_table, num_heads, num_kv_heads,
                                          head_dim, scale, window));
  }
  return call.out;
}


// ---------------------------------------------------------------------------------------------------
// Llama decoder layers in one call, for bfloat16 or float32 activations and 4-bit projections on
// the native kernel (specstream/models/llama.py, `_LlamaLayer.native_weights`, decides when): the ~20
// small torch ops a layer dispatches one by one from Python (two RMS norms, the residual adds, the
// split of the fused projections) cost more than its matrix products on a small model. Each step
// keeps the eager layer's rounding (specstream/models/llama.py): in bfloat16, RMS norm normalised in
// float32 and rounded to bfloat16 before the weight's product, the residual adds, the activation and
// its product with `up` rounded to bfloat16 as torch does; in float32, the native RMS norm and
// float32 adds, as the eager layer computes them; every row computed on its own, so the layer stays
// batch-invariant.

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch converts
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// One row of H values: normalised in float32, rounded to bfloat16, times the weight, rounded again.
void rms_row(const uint16_t* x, const uint16_t* w, int64_t H, double eps, uint16_t* out) {
  float total = 0.0f;
  for (int64_t i = 0; i < H; ++i) {
    const float v = bf16_to_float(x[i]);
    total += v * v;
  }
  const float inv = 1.0f / std::sqrt(total / float(H) + float(eps));
  for (int64_t i = 0; i < H; ++i) {
    const float normed = bf16_to_float(to_bf16(bf16_to_float(x[i]) * inv));
    out[i] = to_bf16(bf16_to_float(w[i]) * normed);
  }
}

// One row of H float32 values: the sum of squares in index order, then w * (x * inv); one call in
// place of the ~8 ops torch's float32 RMS norm dispatches (on a slow 2-core CPU ~20 us a call, against 2-7).
void rms_row_f32(const float* x, const float* w, int64_t H, double eps, float* out) {
  float total = 0.0f;
  for (int64_t i = 0; i < H; ++i) total += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(total / float(H) + float(eps));
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}


// The share of n items that thread `tid` of a team of `team` takes: contiguous, fixed by (n, team).
std::pair<int64_t, int64_t> share(int64_t n, int tid, int team) {
  const int64_t chunk = (n + team - 1) / team, begin = std::min<int64_t>(n, tid * chunk);
  return {begin, std::min<int64_t>(n, begin + chunk)};
}

// A stack of Llama decoder layers run in ONE OpenMP parallel region per forward: the team splits each
// projection's output tiles and attention's positions and heads, and meets at a barrier between
// phases; the small serial parts (norms, residual adds, block sums, the activation) run on the calling
// thread while the others wait. A parallel region per phase cost a fork and a join each (~5 per layer,
// 150 per step on a 30-layer model) and a Python call per layer its own overhead: together about a
// sixth of a step on a small model. Every element is computed exactly as the phase-by-phase ops
// compute it (specstream/models/llama.py's layer), so the result is the same bits.
//
// Each layer's operands: input norm, post-attention norm ([H], the activations' dtype), then qkv, o,
// gate_up, down, each as (codes, d, m) in the native layout: 14 tensors. Activations are bfloat16
// (AVX-512 BF16) or float32 (AVX2): `Act` below names what differs between them.
template <typename E>
struct Act;

template <>
struct Act<uint16_t> {  // bfloat16: rounded after every step, as torch rounds
  using Call = Q4Call;
  using Scratch = Q4Scratch;
  using Cache = at::BFloat16;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float f) { return to_bf16(f); }
  static uint16_t* data(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
  static Call call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, bool int8,
                   Scratch& scratch, at::Tensor& out) {
    return q4_call(x, codes, d, m, int8, scratch, out);
  }
  static void rms(const uint16_t* x, const uint16_t* w, int64_t H, double eps, uint16_t* out) {
    rms_row(x, w, H, eps, out);
  }
};

template <>
struct Act<float> {  // float32
  using Call = Q4CallF32;
  using Scratch = std::vector<float>;
  using Cache = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
  static float* data(const at::Tensor& t) { return t.data_ptr<float>(); }
  static Call call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, bool int8,
                   Scratch& scratch, at::Tensor& out) {
    TORCH_CHECK(!int8, "LayerStack: 8-bit activations are for bfloat16 layers");
    return q4_call_f32(x, codes, d, m, scratch, out);
  }
  static void rms(const float* x, const float* w, int64_t H, double eps, float* out) { rms_row_f32(x, w, H, eps, out); }
};

// RMS norm of rows (the op models/base.py calls): each row on its own, so batch-invariant.
template <typename E>
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& weight, double eps) {
  using A = Act<E>;
  const at::Tensor xin = x.contiguous(), win = weight.contiguous();
  const int64_t M = xin.size(0), H = xin.size(1);
  at::Tensor out = at::empty({M, H}, xin.options());
  const E *xp = A::data(xin), *wp = A::data(win);
  E* op = A::data(out);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) A::rms(xp + r * H, wp, H, eps, op + r * H);
  });
  return out;
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && (f32 || x.scalar_type() == at::kBFloat16) && weight.scalar_type() == x.scalar_type() &&
              weight.numel() == x.size(1), "rms_norm: x [M, H] and weight [H], both bfloat16 or both float32");
  return f32 ? rms_norm_of<float>(x, weight, eps) : rms_norm_of<uint16_t>(x, weight, eps);
}

template <typename E>
class LayerStackOf {
  using A = Act<E>;
 public:
  LayerStackOf(std::vector<std::vector<at::Tensor>> layers, double eps, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double scale, std::vector<int64_t> windows, bool int8)
      : layers_(std::move(layers)), eps_(eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), scale_(scale), windows_(std::move(windows)), int8_(int8) {
    TORCH_CHECK(!layers_.empty() && windows_.size() == layers_.size(), "LayerStack: one window per layer");
    for (const auto& l : layers_) {
      TORCH_CHECK(l.size() == 14, "LayerStack: 2 norms and 4 projections as (codes, d, m) per layer");
      TORCH_CHECK(l[0].scalar_type() == A::kType && l[1].scalar_type() == A::kType && l[0].is_contiguous() &&
                  l[1].is_contiguous() && l[0].numel() == l[1].numel(), "LayerStack: norm weights [H] of the activations' dtype");
    }
  }

  // x [B, T, H] (bfloat16 or float32, as the norms); k, v: each layer's cache; the rest as `attention` takes them. -> [B, T, H]
  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                     const at::Tensor& starts, const c10::optional<at::Tensor>& sources,
                     const c10::optional<at::Tensor>& parents) const {
    const int64_t L = layers_.size();
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == A::kType, "LayerStack: x [B, T, H] of the norms' dtype");
    TORCH_CHECK(int64_t(k.size()) == L && int64_t(v.size()) == L, "LayerStack: a cache per layer");
    const int64_t B = x.size(0), T_ = x.size(1), H = x.size(2), M = B * T_;
    TORCH_CHECK(layers_[0][0].numel() == H, "LayerStack: norm weights of ", H);
    const auto opts = x.options();
    const at::Tensor rows = x.reshape({M, H}).contiguous();
    at::Tensor normed = at::empty({M, H}, opts), normed2 = at::empty({M, H}, opts);
    at::Tensor outs[2] = {at::empty({M, H}, opts), at::empty({M, H}, opts)};
    AttentionCall attn_call;
    at::Tensor qkv, hidden, gate_up, act, down;
    typename A::Scratch sums[4];
    std::vector<Layer> work;
    for (int64_t l = 0; l < L; ++l) {
      const auto& w = layers_[l];
      Layer layer;
      layer.x = A::data(l == 0 ? rows : outs[(l - 1) % 2]);
      layer.out = A::data(outs[l % 2]);
      layer.in_w = A::data(w[0]);
      layer.post_w = A::data(w[1]);
      layer.qkv = A::call(normed, w[2], w[3], w[4], int8_, sums[0], qkv);
      const at::Tensor qkv3 = qkv.view({B, T_, qkv.size(1)});
      if (l == 0) {
        attn_call = attention_call(qkv3, k[0], v[0], cos_table, sin_table, slots, starts, sources, parents,
                                   num_heads_, num_kv_heads_, head_dim_);
      } else {
        TORCH_CHECK(k[l].sizes() == k[0].sizes() && v[l].sizes() == k[0].sizes() && k[l].is_contiguous() &&
                    v[l].is_contiguous() && k[l].scalar_type() == k[0].scalar_type() &&
                    v[l].scalar_type() == k[0].scalar_type(), "LayerStack: every layer's cache like the first's");
      }
      at::Tensor kl = k[l], vl = v[l];
      layer.attn = attn_call.bind<typename A::Cache>(qkv3, kl, vl, cos_table, sin_table, num_heads_, num_kv_heads_,
                                                head_dim_, scale_, windows_[l]);
      layer.o = A::call(attn_call.out.view({M, attn_call.out.size(2)}), w[5], w[6], w[7], int8_, sums[1], hidden);
      TORCH_CHECK(hidden.size(1) == H, "LayerStack: o_proj gives ", hidden.size(1), " features, not ", H);
      layer.gate_up = A::call(normed2, w[8], w[9], w[10], int8_, sums[2], gate_up);
      const int64_t I = gate_up.size(1) / 2;
      if (!act.defined()) act = at::empty({M, I}, opts);
      TORCH_CHECK(act.size(1) == I, "LayerStack: every layer's intermediate size like the first's");
      layer.down = A::call(act, w[11], w[12], w[13], int8_, sums[3], down);
      TORCH_CHECK(down.size(1) == H, "LayerStack: down_proj gives ", down.size(1), " features, not ", H);
      work.push_back(layer);
    }
    Shared shared{M, H, B * T_, B * T_ * num_heads_, eps_, A::data(normed), A::data(normed2), A::data(hidden),
                  A::data(down), gate_up, act};
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      for (const Layer& layer : work) run(layer, shared, tid, team);
    }
    return outs[(L - 1) % 2].view({B, T_, H});
  }

 private:
  struct Layer {
    const E *x, *in_w, *post_w;
    E* out;
    typename A::Call qkv, o, gate_up, down;
    Attention<typename A::Cache> attn;
  };
  struct Shared {  // the scratch every layer reuses
    int64_t M, H, positions, heads;
    double eps;
    E *normed, *normed2, *hidden, *down;
    at::Tensor gate_up, act;
  };

  // One layer's phases; every thread of the team calls it (the barriers need them all).
  static void run(const Layer& l, const Shared& s, int tid, int team) {
    const int64_t M = s.M, H = s.H, I = s.act.size(1);
#pragma omp single
    {
      for (int64_t r = 0; r < M; ++r) A::rms(l.x + r * H, l.in_w, H, s.eps, s.normed + r * H);
      q4_prepare(l.qkv);
    }  // (a single ends at a barrier)
    auto [q0, q1] = share(l.qkv.tiles, tid, team);
    q4_tiles(l.qkv, q0, q1);
#pragma omp barrier
    auto [w0, w1] = share(s.positions, tid, team);
    l.attn.write(w0, w1);
#pragma omp barrier
    auto [a0, a1] = share(s.heads, tid, team);
    l.attn.attend(a0, a1);
#pragma omp barrier
#pragma omp single
    q4_prepare(l.o);
    auto [o0, o1] = share(l.o.tiles, tid, team);
    q4_tiles(l.o, o0, o1);
#pragma omp barrier
#pragma omp single
    {
      for (int64_t i = 0; i < M * H; ++i) s.hidden[i] = A::store(A::load(s.hidden[i]) + A::load(l.x[i]));  // o + x
      for (int64_t r = 0; r < M; ++r) A::rms(s.hidden + r * H, l.post_w, H, s.eps, s.normed2 + r * H);
      q4_prepare(l.gate_up);
    }
    auto [g0, g1] = share(l.gate_up.tiles, tid, team);
    q4_tiles(l.gate_up, g0, g1);
#pragma omp barrier
#pragma omp master
    {
      // As torch: silu(gate) * up, by ATen's own kernels, on the calling thread: it carries the
      // caller's thread-local state (inference mode), which the team's other threads do not.
      at::Tensor act = s.act;
      at::mul_out(act, at::silu(s.gate_up.narrow(1, 0, I)), s.gate_up.narrow(1, I, I));
      q4_prepare(l.down);
    }
#pragma omp barrier
    auto [d0, d1] = share(l.down.tiles, tid, team);
    q4_tiles(l.down, d0, d1);
#pragma omp barrier
#pragma omp single
    for (int64_t i = 0; i < M * H; ++i) l.out[i] = A::store(A::load(s.down[i]) + A::load(s.hidden[i]));  // down + hidden
  }

  std::vector<std::vector<at::Tensor>> layers_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::vector<int64_t> windows_;
  bool int8_;  // 8-bit activations in the projections (q4_tile_i8)
};

// The stack as Python builds it: its activations' dtype is its norms' (bfloat16 or float32).
class LayerStack {
 public:
  LayerStack(std::vector<std::vector<at::Tensor>> layers, double eps, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double scale, std::vector<int64_t> windows, bool int8) {
    TORCH_CHECK(!layers.empty() && !layers[0].empty(), "LayerStack: at least one layer");
    if (layers[0][0].scalar_type() == at::kFloat) {
      f32_ = std::make_unique<LayerStackOf<float>>(std::move(layers), eps, num_heads, num_kv_heads, head_dim, scale,
                                                   std::move(windows), int8);
    } else {
      bf16_ = std::make_unique<LayerStackOf<uint16_t>>(std::move(layers), eps, num_heads, num_kv_heads, head_dim,
                                                       scale, std::move(windows), int8);
    }
  }

  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                     const at::Tensor& starts, const c10::optional<at::Tensor>& sources,
                     const c10::optional<at::Tensor>& parents) const {
    return f32_ ? f32_->forward(x, k, v, cos_table, sin_table, slots, starts, sources, parents)
                : bf16_->forward(x, k, v, cos_table, sin_table, slots, starts, sources, parents);
  }

 private:
  std::unique_ptr<LayerStackOf<float>> f32_;
  std::unique_ptr<LayerStackOf<uint16_t>> bf16_;
};

// ---------------------------------------------------------------------------------------------------
// Greedy verification on CPU logits in one call (kernels/verify.py): each row's argmax (the first
// largest value, NaN above everything, as torch.argmax), then the accepted prefix of the proposals.
// A row's result depends on its own logits only. logits [B, G+1, V] float32 contiguous, draft [B, G]
// int64, num_draft [B] int64 -> (accepted [B], tokens [B, G+1]).

int64_t argmax_generic(const float* x, int64_t V) {
  int64_t best = 0;
  float top = x[0];
  if (std::isnan(top)) return 0;
  for (int64_t i = 1; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) { top = x[i]; best = i; }
  }
  return best;
}

// The largest value 16 lanes at a time, then the first index holding it: the same answer as the
// scalar scan (the first NaN if any, else the first largest).
__attribute__((target("avx512f")))
int64_t argmax_avx512(const float* x, int64_t V) {
  __m512 top_v = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return argmax_generic(x, V);  // a NaN: the scan finds the first
    top_v = _mm512_max_ps(top_v, v);
  }
  float top = _mm512_reduce_max_ps(top_v);
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(x[j])) return argmax_generic(x, V);
    top = std::max(top, x[j]);
  }
  const __m512 want = _mm512_set1_ps(top);
  for (i = 0; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), want, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i) {
    if (x[i] == top) return i;
  }
  return 0;  // every value -inf
}

std::vector<at::Tensor> greedy_verify(const at::Tensor& logits, const at::Tensor& draft, const at::Tensor& num_draft) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat, "greedy_verify: logits [B, G+1, V] float32");
  const at::Tensor scores = logits.contiguous();
  const int64_t B = scores.size(0), P = scores.size(1), V = scores.size(2), G = P - 1;
  TORCH_CHECK(draft.dim() == 2 && draft.size(0) == B && draft.size(1) == G && draft.scalar_type() == at::kLong &&
              num_draft.numel() == B && num_draft.scalar_type() == at::kLong, "greedy_verify: draft [B, G], num_draft [B] int64");
  const at::Tensor d = draft.contiguous(), n = num_draft.contiguous();
  at::Tensor tokens = at::empty({B, P}, draft.options());
  at::Tensor accepted = at::empty({B}, draft.options());
  const float* sp = scores.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, B * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      tp[row] = has_avx512() ? argmax_avx512(sp + row * V, V) : argmax_generic(sp + row * V, V);
    }
  });
  const int64_t* dp = d.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  int64_t* ap = accepted.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t k = 0;
    while (k < std::min(np[b], G) && dp[b * G + k] == tp[b * P + k]) ++k;
    ap[b] = k;
  }
  return {accepted, tokens};
}

// ---------------------------------------------------------------------------------------------------
// The exponential race's candidates (kernels/random.py, ``race``): a sample from a probability table is
// the token with the largest p / E, E = -log(u) for the token's counter-based uniform u. Computing the
// two logs of every token of a 49,152-token row costs more than the rest of a sampled pass, and all
// but a few tokens cannot win: since 1 - u <= -log(u) <= (1 - u) / u for u in (0, 1),
//     p u / (1 - u) <= p / E <= p / (1 - u),
// bounds with no logarithm. A token whose upper bound is below the best lower bound of its row cannot
// win. Where several remain (a handful), their scores in double precision settle the row unless the
// best two are within kRaceResolve (below), and only then are they returned, for ``race`` to score them
// with the torch ops the dense race uses (the same bits). The bounds hold for the exact values; torch's
// float32 noise is within ~1e-5 of them (two logs of 1-ulp accuracy), so keeping every token within a
// factor kRaceSlack of the best lower bound (1e-3 in log space) keeps every token torch could rank
// first. The uniforms are kernels/random.py's bits: two rounds of murmur3's fmix32 over (key, id).

constexpr double kRaceSlack = 1.0 - 1e-3;

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

inline double race_uniform(uint32_t lo, uint32_t hi, uint32_t id) {
  uint32_t h = fmix32((id * 0x9E3779B1u + 0x7F4A7C15u) ^ lo);
  h = fmix32(h ^ hi);
  return (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);  // float32, as the kernels draw it
}

// The bounds in two passes over the row: the best lower bound, then the tokens whose upper bound
// reaches it (scalar; AVX-512 below computes the same decisions 16 tokens at a time).
// ids: each column's token id (nullptr: the column's index).
template <typename T>
void race_row_generic(const T* p, const int64_t* ids, int64_t C, uint32_t lo, uint32_t hi, std::vector<int64_t>& out,
                      int64_t base) {
  auto token = [ids](int64_t c) { return static_cast<uint32_t>(ids ? ids[c] : c); };
  double best = 0.0;  // the largest lower bound p u / (1 - u)
  for (int64_t c = 0; c < C; ++c) {
    const double mass = static_cast<double>(p[c]);
    if (!(mass > 0.0)) continue;  // zeros (and NaN) are never picked
    const double u = race_uniform(lo, hi, token(c));
    best = std::max(best, mass * u / (1.0 - u));
  }
  if (!(best > 0.0)) return;  // no mass: the caller's column 0
  const double cut = best * kRaceSlack;
  for (int64_t c = 0; c < C; ++c) {
    const double mass = static_cast<double>(p[c]);
    if (mass > 0.0 && mass >= cut * (1.0 - race_uniform(lo, hi, token(c)))) out.push_back(base + c);
  }
}

__attribute__((target("avx512f"), always_inline)) inline __m512i fmix32x16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

__attribute__((target("avx512f"), always_inline)) inline __m512 race_uniform16(__m512i ids, __m512i lo, __m512i hi) {
  __m512i h = _mm512_add_epi32(_mm512_mullo_epi32(ids, _mm512_set1_epi32(static_cast<int>(0x9E3779B1u))),
                               _mm512_set1_epi32(0x7F4A7C15));
  h = fmix32x16(_mm512_xor_si512(h, lo));
  h = fmix32x16(_mm512_xor_si512(h, hi));
  const __m512 top = _mm512_cvtepi32_ps(_mm512_srli_epi32(h, 9));  // < 2^23: exact
  return _mm512_mul_ps(_mm512_add_ps(top, _mm512_set1_ps(0.5f)), _mm512_set1_ps(1.0f / 8388608.0f));
}

__attribute__((target("avx512f"), always_inline)) inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// 16 tokens' masses as two halves of 8 doubles.
__attribute__((target("avx512f"), always_inline)) inline void load_mass16(const float* p, __m512d& a,
                                                                                    __m512d& b) {
  const __m512 v = _mm512_loadu_ps(p);
  a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  b = _mm512_cvtps_pd(upper_half(v));
}
__attribute__((target("avx512f"), always_inline)) inline void load_mass16(const double* p, __m512d& a,
                                                                                    __m512d& b) {
  a = _mm512_loadu_pd(p);
  b = _mm512_loadu_pd(p + 8);
}

template <typename T>
__attribute__((target("avx512f")))
void race_row_avx512(const T* p, int64_t C, uint32_t lo, uint32_t hi, std::vector<int64_t>& out, int64_t base) {
  const __m512i lo_v = _mm512_set1_epi32(static_cast<int>(lo)), hi_v = _mm512_set1_epi32(static_cast<int>(hi));
  const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512d zero = _mm512_setzero_pd(), one = _mm512_set1_pd(1.0);
  __m512d best_v = zero;
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const __m512 u = race_uniform16(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c)), step), lo_v, hi_v);
    __m512d m0, m1;
    load_mass16(p + c, m0, m1);
    const __m512d u0 = _mm512_cvtps_pd(_mm512_castps512_ps256(u)), u1 = _mm512_cvtps_pd(upper_half(u));
    // p u / (1 - u) where p > 0 (zeros and NaN contribute nothing)
    const __m512d l0 = _mm512_div_pd(_mm512_mul_pd(m0, u0), _mm512_sub_pd(one, u0));
    const __m512d l1 = _mm512_div_pd(_mm512_mul_pd(m1, u1), _mm512_sub_pd(one, u1));
    best_v = _mm512_mask_max_pd(best_v, _mm512_cmp_pd_mask(m0, zero, _CMP_GT_OQ), best_v, l0);
    best_v = _mm512_mask_max_pd(best_v, _mm512_cmp_pd_mask(m1, zero, _CMP_GT_OQ), best_v, l1);
  }
  double best = _mm512_reduce_max_pd(best_v);
  for (int64_t t = c; t < C; ++t) {
    const double mass = static_cast<double>(p[t]);
    if (!(mass > 0.0)) continue;
    const double u = race_uniform(lo, hi, static_cast<uint32_t>(t));
    best = std::max(best, mass * u / (1.0 - u));
  }
  if (!(best > 0.0)) return;
  const double cut = best * kRaceSlack;
  const __m512d cut_v = _mm512_set1_pd(cut);
  for (c = 0; c + 16 <= C; c += 16) {
    const __m512 u = race_uniform16(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c)), step), lo_v, hi_v);
    __m512d m0, m1;
    load_mass16(p + c, m0, m1);
    const __m512d u0 = _mm512_cvtps_pd(_mm512_castps512_ps256(u)), u1 = _mm512_cvtps_pd(upper_half(u));
    const __mmask8 h0 = _mm512_cmp_pd_mask(m0, zero, _CMP_GT_OQ) &
                        _mm512_cmp_pd_mask(m0, _mm512_mul_pd(cut_v, _mm512_sub_pd(one, u0)), _CMP_GE_OQ);
    const __mmask8 h1 = _mm512_cmp_pd_mask(m1, zero, _CMP_GT_OQ) &
                        _mm512_cmp_pd_mask(m1, _mm512_mul_pd(cut_v, _mm512_sub_pd(one, u1)), _CMP_GE_OQ);
    for (uint32_t hit = h0 | (static_cast<uint32_t>(h1) << 8); hit; hit &= hit - 1) {
      out.push_back(base + c + __builtin_ctz(hit));
    }
  }
  for (; c < C; ++c) {
    const double mass = static_cast<double>(p[c]);
    if (mass > 0.0 && mass >= cut * (1.0 - race_uniform(lo, hi, static_cast<uint32_t>(c)))) out.push_back(base + c);
  }
}

// Several candidates left: their scores log p - log(-log u) in double precision (error ~1e-13) decide
// when the best leads the next by more than kRaceResolve, since torch's float32 noise is within ~4e-6
// of the exact value (a row keeps all its candidates otherwise, for the torch ops to score: ~1e-4 of
// contested rows).
constexpr double kRaceResolve = 1e-4;

template <typename T>
void resolve_candidates(const T* p, const int64_t* ids, uint32_t lo, uint32_t hi, std::vector<int64_t>& out,
                        int64_t base) {
  if (out.size() < 2) return;
  double best = -INFINITY, second = -INFINITY;
  int64_t winner = out[0];
  for (const int64_t flat : out) {
    const int64_t c = flat - base;
    const double u = race_uniform(lo, hi, static_cast<uint32_t>(ids ? ids[c] : c));
    const double score = std::log(static_cast<double>(p[c])) - std::log(-std::log(u));
    if (score > best) {
      second = best;
      best = score;
      winner = flat;
    } else {
      second = std::max(second, score);
    }
  }
  if (best - second > kRaceResolve) out.assign(1, winner);
}

template <typename T>
void race_row(const T* p, const int64_t* ids, int64_t C, int64_t key, std::vector<int64_t>& out, int64_t base) {
  const uint32_t lo = static_cast<uint32_t>(key & 0xFFFFFFFF), hi = static_cast<uint32_t>((key >> 32) & 0xFFFFFFFF);
  if (has_avx512() && ids == nullptr) {  // a whole row of the vocabulary: ids are the columns
    race_row_avx512(p, C, lo, hi, out, base);
  } else {
    race_row_generic(p, ids, C, lo, hi, out, base);
  }
  resolve_candidates(p, ids, lo, hi, out, base);
}

// probs [N, C] float32 or float64, keys [N] int64, ids [N, C] int64 each column's token id (an undefined
// tensor: the column's index) -> (winner [N] int64: the row's only candidate, column 0 for a row without
// mass, -1 where several remain; contested [P] int64: the flat indices row * C + column of the
// candidates of the rows with several, row-major).
std::vector<at::Tensor> race_candidates(const at::Tensor& probs, const at::Tensor& keys,
                                        const c10::optional<at::Tensor>& ids) {
  TORCH_CHECK(probs.dim() == 2 && (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble),
              "race_candidates: probs [N, C] float32 or float64");
  TORCH_CHECK(keys.dim() == 1 && keys.numel() == probs.size(0) && keys.scalar_type() == at::kLong,
              "race_candidates: keys [N] int64");
  TORCH_CHECK(!ids.has_value() || (ids->sizes() == probs.sizes() && ids->scalar_type() == at::kLong),
              "race_candidates: ids [N, C] int64");
  const at::Tensor table = probs.contiguous(), k = keys.contiguous();
  const at::Tensor tokens = ids.has_value() ? ids->contiguous() : at::Tensor();
  const int64_t N = table.size(0), C = table.size(1);
  std::vector<std::vector<int64_t>> found(N);
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* ip = tokens.defined() ? tokens.data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t* row_ids = ip ? ip + row * C : nullptr;
      if (table.scalar_type() == at::kFloat) {
        race_row(table.data_ptr<float>() + row * C, row_ids, C, kp[row], found[row], row * C);
      } else {
        race_row(table.data_ptr<double>() + row * C, row_ids, C, kp[row], found[row], row * C);
      }
    }
  });
  at::Tensor winner = at::empty({N}, k.options());
  int64_t* wp = winner.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t row = 0; row < N; ++row) {
    const auto& f = found[row];
    wp[row] = f.empty() ? 0 : f.size() == 1 ? f[0] - row * C : -1;
    if (f.size() > 1) total += static_cast<int64_t>(f.size());
  }
  at::Tensor contested = at::empty({total}, k.options());
  int64_t* op = contested.data_ptr<int64_t>();
  for (const auto& f : found) {
    if (f.size() > 1) op = std::copy(f.begin(), f.end(), op);
  }
  return {winner, contested};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_matmul", &q4_matmul,
             "x [M, K] bfloat16 (float32) @ Q4_1 codes in the native layout -> [M, N] bfloat16 (float32)",
             pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("d"), pybind11::arg("m"),
             pybind11::arg("int8") = false);
  module.def("q8_matmul", &q8_matmul, "x [M, K] @ Q8_0 codes [N, K] (d [N, K/32]) -> [M, N] float32");
  module.def("greedy_verify", &greedy_verify, "argmax of every row of CPU float32 logits and the accepted prefix");
  module.def("race_candidates", &race_candidates,
             "per row, the one column that can win its exponential race, or the candidates where several can",
             pybind11::arg("probs"), pybind11::arg("keys"), pybind11::arg("ids") = pybind11::none());
  module.def("rms_norm", &rms_norm_rows,
             "RMS norm of bfloat16 or float32 rows, normalised in float32 (each row on its own)");
  pybind11::class_<LayerStack>(module, "LayerStack", "Llama decoder layers in one parallel region per forward")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, double, int64_t, int64_t, int64_t, double,
                          std::vector<int64_t>, bool>())
      .def("forward", &LayerStack::forward);
  module.def("attention", &attention, "RoPE, the cache write and attention over each row's own keys, for one layer");
  module.def("has_avx2_fma", &has_avx2_fma, "whether float32 activations take the native 4-bit and 8-bit paths");
  module.def("has_avx512", &has_avx512, "whether the AVX-512 paths run on this CPU");
  module.def("has_avx512_bf16", &has_avx512_bf16, "whether bfloat16 activations take the dot-product path");
  module.def("has_avx512_vnni", &has_avx512_vnni, "whether 8-bit activations can take the integer dot-product path");
}
