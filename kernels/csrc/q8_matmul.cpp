// The 8-bit matmul (`q8_matmul`, kernels/int8.py): x [M, K] @ Q8_0 codes [N, K] -> [M, N] float32, for
// bfloat16 rows (AVX-512 BF16), float32 rows (AVX-512 or AVX2) and a generic path for any CPU.

#include "cpu_ops.h"

namespace cpu_ops {
namespace {

// Activations as float32 rows.
at::Tensor as_float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

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
// x q + s, a fused d s + acc), then the 16 lanes summed in index order: the generic path's bits. F
// output features a call, one after another: with F = 8 their lanes are transposed so that one
// vector addition a lane sums the 8 features' totals together, in the same order (0 + l0 + l1 + ...
// + l15), instead of 16 dependent scalar additions each (one thread, a 49,152 x 576 matrix, AVX2
// EPYC: the output layer 0.90x the time at 1 row, 0.92x at 4 rows; the same bits).
__attribute__((target("avx2"), always_inline)) inline void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

template <int R, int F>
__attribute__((target("avx2,fma")))
void q8_rows_avx2(const int8_t* codes, const float* d, const float* x, int64_t blocks, int64_t K, float* out,
                  int64_t N) {
  static_assert(F == 1 || F == 8, "one feature a call, or eight");
  __m256 lanes[R][2][F];  // [row][lanes 0..7, 8..15][feature]
  for (int f = 0; f < F; ++f) {
    const int8_t* cf = codes + f * K;
    const float* df = d + f * blocks;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* c = cf + kBlock * b;
      __m256 q[4];  // codes 0..7, 8..15, 16..23, 24..31
      for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i))));
      }
      const __m256 scale = _mm256_set1_ps(df[b]);
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
      lanes[r][0][f] = acc[r][0];
      lanes[r][1][f] = acc[r][1];
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (F == 1) {
      float each[16];
      _mm256_storeu_ps(each, lanes[r][0][0]);
      _mm256_storeu_ps(each + 8, lanes[r][1][0]);
      float total = 0.0f;
      for (float v : each) total += v;
      out[r * N] = total;
    } else {
      transpose8(lanes[r][0]);  // [i]: lane i of features 0..7
      transpose8(lanes[r][1]);  // [i]: lane 8 + i
      __m256 total = _mm256_setzero_ps();
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 8; ++i) total = _mm256_add_ps(total, lanes[r][h][i]);
      _mm256_storeu_ps(out + r * N, total);
    }
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

// ---------------------------------------------------------------------------------------------------
// Float32 rows rounded to 16 bits per block of 32 (AVX2; `q8_matmul_i16`), over Q8_0 codes in the
// tile layout (kernels/int8.py ``tile_layout``): per tile of 8 output features t, block b and pair
// of inputs p (32 b + 2 p, + 1), 16 bytes, byte 2 f + j feature 8 t + f's code for input 32 b + 2 p + j;
// the scales [T, K/32, 8], feature 8 t + f's at [t, b, f].
//
// Each row's block as 16-bit codes qx and a scale dx (quantize_rows_i16, q4_matmul.cpp: the 4-bit
// kernel's rounding). A pair's 16 codes widen to words once for every row of the pass (lane f holds
// feature f's two codes); one word multiply-add against the row's two codes broadcast gives the 8
// features' products, added as int32: the block's Σ q qx exactly (at most 32 * 127 * 32,767 in
// magnitude). The block ends with y = fma(d dx, Σ, y), Σ as a float32 rounded to nearest: the generic
// path's operations (q8_dot_i16_generic), so its bits, whatever the rows and the threads.
//
// Against the float32 inputs' path (each block's codes widened to float32 and scaled per feature
// and row, an FMA per 8 products) a row's 16 products take a multiply-add and an addition: on Zen 3
// the word multiply-adds issue two a cycle, as the FMAs do.

constexpr int64_t kQ8TileFeatures = 8;
// Rows per pass (a verify over up to 8 positions in one): their sums, a pair's codes and a row's inputs
// in registers (the outputs, touched once a block, may spill).
constexpr int kQ8TileRows = 8;

// How far ahead a pass asks for its codes: 16 blocks of a tile (4 KB). On AMD EPYC (Zen 3), against 4
// blocks (1 KB): the output layer alone 11-18% faster for 1 row and 8-21% for 2, 2-4% for 4 (2 threads,
// the two in turns in one process, one-off); a step 1.5-4.6% with the 4-bit kernels' prefetch moved too.
constexpr int64_t kQ8Ahead = 4096;

template <int R>
__attribute__((target("avx2,fma")))
void q8_tile_i16(const int8_t* w, const float* d, const int16_t* xq, const float* xd, int64_t blocks, int64_t K,
                 float* out, int64_t N) {
  __m256 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    const int8_t* wb = w + b * kQ8TileFeatures * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wb + kQ8Ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + kQ8Ahead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + kQ8Ahead + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + kQ8Ahead + 192), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16 * p)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * K + kBlock * b + 2 * p, 4);
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(codes, _mm256_set1_epi32(pair)));
      }
      for (int r = 0; r < R; ++r) __asm__("" : "+x"(s[r]));  // as q4_tile_i16_f32's sums: kept in registers
    }
    const __m256 dv = _mm256_loadu_ps(d + kQ8TileFeatures * b);
    for (int r = 0; r < R; ++r) {
      y[r] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(xd[r * blocks + b])), _mm256_cvtepi32_ps(s[r]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N, y[r]);
}

using Q8TileI16 = void (*)(const int8_t*, const float*, const int16_t*, const float*, int64_t, int64_t, float*,
                           int64_t);
constexpr Q8TileI16 kQ8TilesI16[] = {q8_tile_i16<1>, q8_tile_i16<2>, q8_tile_i16<3>, q8_tile_i16<4>,
                                     q8_tile_i16<5>, q8_tile_i16<6>, q8_tile_i16<7>, q8_tile_i16<8>};

// One feature and row of the 16-bit path, one value at a time (codes and scales in the tile layout,
// at feature f of its tile): the AVX2 path's operations.
float q8_dot_i16_generic(const int8_t* w, const float* d, int64_t f, const int16_t* xq, const float* xd,
                         int64_t blocks) {
  float y = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t total = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      total += int32_t(w[(b * 16 + i / 2) * 16 + 2 * f + i % 2]) * int32_t(xq[kBlock * b + i]);
    }
    y = std::fma(d[kQ8TileFeatures * b + f] * xd[b], float(total), y);
  }
  return y;
}

using Q8Rows = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, float*, int64_t);
using Q8RowsBf16 = void (*)(const int8_t*, const float*, const uint16_t*, int64_t, int64_t, float*, int64_t);
constexpr Q8RowsBf16 kQ8RowsBf16[] = {q8_rows_bf16<1>, q8_rows_bf16<2>, q8_rows_bf16<3>, q8_rows_bf16<4>,
                                      q8_rows_bf16<5>, q8_rows_bf16<6>, q8_rows_bf16<7>, q8_rows_bf16<8>};
constexpr Q8Rows kQ8Rows[] = {q8_rows_avx512<1>, q8_rows_avx512<2>, q8_rows_avx512<3>, q8_rows_avx512<4>,
                              q8_rows_avx512<5>, q8_rows_avx512<6>, q8_rows_avx512<7>, q8_rows_avx512<8>};
// [F == 8][rows - 1]
constexpr Q8Rows kQ8RowsAvx2[2][4] = {{q8_rows_avx2<1, 1>, q8_rows_avx2<2, 1>, q8_rows_avx2<3, 1>, q8_rows_avx2<4, 1>},
                                      {q8_rows_avx2<1, 8>, q8_rows_avx2<2, 8>, q8_rows_avx2<3, 8>, q8_rows_avx2<4, 8>}};

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

}  // namespace

at::Tensor q8_matmul_i16(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(has_avx2_fma(), "q8_matmul_i16: needs AVX2, FMA and F16C (kernels/int4.py's q4_rounded_native)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_matmul_i16: x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, T = scales.size(0);
  TORCH_CHECK(K % kBlock == 0 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
              tiles.numel() == T * kQ8TileFeatures * K, "q8_matmul_i16: codes in the tile layout, K a multiple of 32");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({T, blocks, kQ8TileFeatures}) && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous(), "q8_matmul_i16: scales [N/8, K/32, 8] float32");
  TORCH_CHECK(n > (T - 1) * kQ8TileFeatures && n <= T * kQ8TileFeatures, "q8_matmul_i16: ", n, " features in ", T,
              " tiles of 8");
  const at::Tensor xin = x.contiguous();
  std::vector<float> xsum(M * blocks), xd(M * blocks);
  std::vector<int16_t> xq(M * K);
  quantize_rows_i16(xin.data_ptr<float>(), M, K, xsum.data(), xd.data(), xq.data());
  at::Tensor out = at::empty({M, n}, x.options());
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const float* dp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* w = wp + t * kQ8TileFeatures * K;
      const float* d = dp + t * blocks * kQ8TileFeatures;
      const int64_t f0 = t * kQ8TileFeatures, features = std::min<int64_t>(kQ8TileFeatures, n - f0);
      for (int64_t r0 = 0; r0 < M; r0 += kQ8TileRows) {
        const int64_t rows = std::min<int64_t>(kQ8TileRows, M - r0);
        if (features == kQ8TileFeatures) {
          kQ8TilesI16[rows - 1](w, d, xq.data() + r0 * K, xd.data() + r0 * blocks, blocks, K, op + r0 * n + f0, n);
          continue;
        }
        for (int64_t r = r0; r < r0 + rows; ++r) {  // the last tile's features that exist
          for (int64_t f = 0; f < features; ++f) {
            op[r * n + f0 + f] = q8_dot_i16_generic(w, d, f, xq.data() + r * K, xd.data() + r * blocks, blocks);
          }
        }
      }
    }
  });
  return out;
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
    if (avx2 && !bf16) {  // eight features a call while eight are left; four rows at a time (registers)
      for (int64_t n = begin; n < end;) {
        const int64_t features = n + 8 <= end ? 8 : 1;
        for (int64_t r = 0; r < M; r += 4) {
          const int64_t four = std::min<int64_t>(4, M - r);
          kQ8RowsAvx2[features == 8][four - 1](cp + n * K, dp + n * blocks, xp + r * K, blocks, K, op + r * N + n, N);
        }
        n += features;
      }
      return;
    }
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
        for (int64_t r = r0; r < r0 + rows; ++r) {
          op[r * N + n] = q8_dot_generic(cp + n * K, dp + n * blocks, xp + r * K, blocks);
        }
      }
    }
  });
  return out;  // float32 logits
}

}  // namespace cpu_ops
