// The 4-bit matmul (`q4_matmul`, kernels/int4.py): x [M, K] @ Q4_1 codes in kernels/int4.py's native
// layout, by three kernels: bfloat16 activations (AVX-512 BF16), 8-bit activations from bfloat16 ones
// (opt-in, AVX-512 VNNI) and float32 activations (AVX2). `LayerStack` (layer_stack.cpp) runs its calls'
// pieces, declared in cpu_ops.h, inside its own parallel region.

#include "cpu_ops.h"

namespace cpu_ops {
namespace {

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

// Software prefetch for the 4-bit kernels: a pass streams TT tiles' codes, scales and minima at once,
// and on AMD EPYC (Zen 3) the hardware prefetchers alone kept one row's pass at about half of a
// thread's read bandwidth. On Zen 5 (AVX-512 BF16) the bfloat16 kernel's one stream gained too: a
// 1-token step 6% faster, a 4-position verify 8% (alternating forwards, one-off). Each block asks
// for the lines kQ4Ahead bytes further on in every stream (past a tile's end that is the next
// tile's start, which the next pass reads); the scales and minima, 1/8 the bytes, every other
// block. Prefetches change no arithmetic.
constexpr int64_t kQ4Ahead = 1024;
// The AVX2 kernel of 16-bit inputs (the default there) asks 4 KB ahead: on AMD EPYC (Zen 3) a step
// 3-5% faster than at 1 KB in three runs of forwards in turns (one-off), a 4-position verify within
// ±3%.
constexpr int64_t kQ4AheadI16 = 4096;

template <int TT>
__attribute__((always_inline)) inline
void q4_prefetch(const uint16_t* d, const uint16_t* m, const uint8_t* w, int64_t tile_codes, int64_t tile_scales,
                 int64_t b, int64_t ahead = kQ4Ahead) {
  for (int t = 0; t < TT; ++t) {
    const char* codes = reinterpret_cast<const char*>(w + t * tile_codes + kQ4TileBytes * b) + ahead;
    for (int line = 0; line < kQ4TileBytes / 64; ++line) _mm_prefetch(codes + 64 * line, _MM_HINT_T0);
    if (b % 2 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(d + t * tile_scales + kQ4Tile * b) + ahead / 8, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + t * tile_scales + kQ4Tile * b) + ahead / 8, _MM_HINT_T0);
    }
  }
}

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
    q4_prefetch<1>(d, m, w, 0, 0, b);
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
// int32) against its four codes in that order. A block ends with y += (d dx) s, then y += m dx Σ qx
// (the rounded inputs' sum: q4_tile_i8_f32 says why). The weights' arithmetic is exact; the
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

// ---------------------------------------------------------------------------------------------------
// Q4_1 with float32 activations, on any x86-64 CPU with AVX2, FMA and F16C: the same native layout,
// 8 lanes a vector, so a tile's 16 features are two vectors per row.
//
// A chunk's 32 bytes hold features 0..7 in their first 16 (bytes 2 i + j) and 8..15 in the others.
// Each 16-byte half widens to 8 lanes of 32 bits, lane i holding feature i's two bytes (j = 0 in bits
// 0..7, j = 1 in bits 8..15), so one shift and one mask give input k0 + j's 8 codes: k0 and k0 + 1
// from the low nibbles (shifts 0 and 8), k0 + 2 and k0 + 3 from the high ones (shifts 4 and 12).
// They convert to 8 floats (exact: integers 0..15), once per call for every row of it; each row
// then takes them by fused multiply-adds against its inputs broadcast to every lane: s = Σ q x per
// block, in the order c = 0..7, j = 0..3. A block ends with y += d s, then y += m Σx (Σx: the row's
// sum over the block, by a fixed sequence of vector additions), as the bfloat16 kernel. Everything a
// row's output sees is fixed by its own inputs: the same bits whatever the number of rows, and
// whatever the tiles a pass takes beside its own. Up to four rows share a pass (their 8 accumulators
// and a chunk's codes fit the 16 vector registers).
//
// (An earlier version shuffled each half's even and odd bytes apart and widened every 8 codes on
// their own: the same bits, 20-25% slower, a third of its vector operations spent forming codes.)

constexpr int kTileF32 = 4;  // rows per pass of the float32 kernel

// Tiles of 16 features per pass for R rows: a block's sum s is a chain of 32 dependent fused
// multiply-adds per row and 8 features, and two FMA units at a latency of 4 cycles need 8 chains to
// stay busy, so a pass of 1 row takes 4 tiles, of 2 rows 2. 3 rows take 1: two tiles' 12 sums left
// too few registers, and the spills cost more than the 6 chains lose (one thread, 36,864 x 576, AMD
// EPYC with AVX2: 1.96 against 2.89 ms). Every feature's arithmetic is the same whatever the tiles
// beside it.
constexpr int f32_tiles_per_pass(int R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// A block's end in the float32 and 16-bit kernels, for one tile's R rows: y += (d dx) s, then
// y += m Σx, per half of the tile's 16 features; without kScaled the inputs were not rounded (no dx).
template <int R, bool kScaled>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline
void q4_block_end_f32(const uint16_t* dt, const uint16_t* mt, const float* xd, const float* xsum, int64_t blocks,
                      int64_t b, const __m256 (&s)[R][2], __m256 (&y)[R][2]) {
  const __m256 dv[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dt))),
                        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dt + 8)))};
  const __m256 mv[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mt))),
                        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mt + 8)))};
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_set1_ps(xsum[r * blocks + b]);
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = kScaled ? _mm256_mul_ps(dv[h], _mm256_set1_ps(xd[r * blocks + b])) : dv[h];
      y[r][h] = _mm256_fmadd_ps(mv[h], sum, _mm256_fmadd_ps(scale, s[r][h], y[r][h]));
    }
  }
}

// A pass's outputs: TT tiles of 16 features for R rows.
template <int TT, int R>
__attribute__((target("avx2"), always_inline)) inline
void q4_store_f32(const __m256 (&y)[TT][R][2], float* out, int64_t N) {
  for (int t = 0; t < TT; ++t) {
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * N + t * kQ4Tile, y[t][r][0]);
      _mm256_storeu_ps(out + r * N + t * kQ4Tile + 8, y[t][r][1]);
    }
  }
}

template <int R, int TT>
__attribute__((target("avx2,fma,f16c")))
void q4_tile_f32(const uint16_t* d, const uint16_t* m, const uint8_t* w, const float* x, const float* xsum,
                 int64_t blocks, int64_t K, float* out, int64_t N) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const int64_t tile_codes = blocks * kQ4TileBytes, tile_scales = blocks * kQ4Tile;
  __m256 y[TT][R][2];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) y[t][r][0] = y[t][r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 s[TT][R][2];
    for (int t = 0; t < TT; ++t)
      for (int r = 0; r < R; ++r) s[t][r][0] = s[t][r][1] = _mm256_setzero_ps();
    q4_prefetch<TT>(d, m, w, tile_codes, tile_scales, b);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        const uint8_t* wc = w + t * tile_codes + kQ4TileBytes * b + 32 * c;
        // Lane i: feature i's two bytes (j = 0 in bits 0..7, j = 1 in 8..15); features 0..7, then 8..15.
        const __m256i p[2] = {_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc))),
                              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 16)))};
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          // Input k0 + j's code: the low nibble of byte j (j < 2), the high nibble of byte j - 2 (j >= 2).
          const int shift = (j & 1) * 8 + (j >> 1) * 4;
          __m256 wv[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i code = j == 3 ? _mm256_srli_epi32(p[h], 12) : _mm256_and_si256(_mm256_srli_epi32(p[h], shift), low4);
            wv[h] = _mm256_cvtepi32_ps(code);
          }
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256 xj = _mm256_broadcast_ss(x + r * K + kBlock * b + 4 * c + j);
            s[t][r][0] = _mm256_fmadd_ps(wv[0], xj, s[t][r][0]);
            s[t][r][1] = _mm256_fmadd_ps(wv[1], xj, s[t][r][1]);
          }
        }
      }
    }
    for (int t = 0; t < TT; ++t) {
      q4_block_end_f32<R, false>(d + t * tile_scales + kQ4Tile * b, m + t * tile_scales + kQ4Tile * b, nullptr, xsum,
                                   blocks, b, s[t], y[t]);
    }
  }
  q4_store_f32(y, out, N);
}

using Q4TileF32 = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const float*, const float*, int64_t,
                           int64_t, float*, int64_t);
// [rows - 1]: a pass over f32_tiles_per_pass(rows) tiles, then [4 + rows - 1]: one tile (a share's last).
constexpr Q4TileF32 kQ4TilesF32[] = {q4_tile_f32<1, f32_tiles_per_pass(1)>, q4_tile_f32<2, f32_tiles_per_pass(2)>,
                                     q4_tile_f32<3, f32_tiles_per_pass(3)>, q4_tile_f32<4, f32_tiles_per_pass(4)>,
                                     q4_tile_f32<1, 1>, q4_tile_f32<2, 1>, q4_tile_f32<3, 1>, q4_tile_f32<4, 1>};

// ---------------------------------------------------------------------------------------------------
// Q4_1 with 8-bit activations from float32 ones, on AVX2: integer dot products as llama.cpp takes its
// Q4_1 blocks against Q8_1 activations, in the same native layout.
//
// Each row's block of 32 inputs is rounded once per call, from its own values only, as the VNNI
// kernel's: dx = max|x| / 127, qx = nearest integer of x / dx (ties to even), stored in the order k0,
// k0 + 2, k0 + 1, k0 + 3 of each group of four. A chunk's two 16-byte halves (features 0..7, 8..15)
// widen to words and (v | v << 4) & 0x0F0F puts feature i's four codes in its own 32-bit lane, in
// that order; one unsigned-by-signed multiply-add of byte pairs per half and row gives 16 words
// (q0 x0 + q2 x2, q1 x1 + q3 x3: at most 2 * 15 * 127 in magnitude). The block's 8 chunks are added as
// words (at most 8 * 3,810 = 30,480: no overflow), then the word pairs as int32: Σ q qx exactly. A block
// ends with y += (d dx) s, then y += m dx Σ qx: the product of the dequantized weight with the
// rounded inputs, as llama.cpp's Q4_1 x Q8_1 takes it. (With the exact Σx in the minimum's term,
// each input's rounding error met the uncentered d q in place of the weight d q + m, and the logits
// were twice as far from the file's: `bench step`, mean |Δ| 0.37 against 0.17.) The integer sums are
// exact and everything else is fixed by the row's own inputs: the same bits whatever the number of rows.

constexpr int kTileI8F32 = 8;  // rows per pass: their sums spill, but a verify window of 2..8 forms each weight once

template <int R>
__attribute__((target("avx2,fma,f16c")))
void q4_tile_i8_f32(const uint16_t* d, const uint16_t* m, const uint8_t* w, const int8_t* xq, const float* xd,
                    const float* xsum, int64_t blocks, int64_t K, float* out, int64_t N) {
  const __m256i nibbles = _mm256_set1_epi16(0x0F0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
    const uint8_t* wb = w + kQ4TileBytes * b;
    q4_prefetch<1>(d, m, w, 0, 0, b);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * c));
      const __m256i v0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));       // features 0..7
      const __m256i v1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));  // features 8..15
      const __m256i q0 = _mm256_and_si256(_mm256_or_si256(v0, _mm256_slli_epi16(v0, 4)), nibbles);
      const __m256i q1 = _mm256_and_si256(_mm256_or_si256(v1, _mm256_slli_epi16(v1, 4)), nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + kBlock * b + 4 * c, 4);
        const __m256i xr = _mm256_set1_epi32(four);
        s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(q0, xr));
        s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(q1, xr));
      }
      if constexpr (R <= 4) {  // pinned, as the 16-bit kernel's sums (below); 5+ rows' sums do not fit the registers
        for (int r = 0; r < R; ++r) __asm__("" : "+x"(s[r][0]), "+x"(s[r][1]));
      }
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kQ4Tile * b)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kQ4Tile * b + 8)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + kQ4Tile * b)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + kQ4Tile * b + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * blocks + b]), sum = _mm256_set1_ps(xsum[r * blocks + b]);
      const __m256 s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][0], ones));
      const __m256 s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][1], ones));
      y[r][0] = _mm256_fmadd_ps(m0, sum, _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), s0, y[r][0]));
      y[r][1] = _mm256_fmadd_ps(m1, sum, _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), s1, y[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * N, y[r][0]);
    _mm256_storeu_ps(out + r * N + 8, y[r][1]);
  }
}

using Q4TileI8F32 = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const int8_t*, const float*,
                             const float*, int64_t, int64_t, float*, int64_t);
constexpr Q4TileI8F32 kQ4TilesI8F32[] = {q4_tile_i8_f32<1>, q4_tile_i8_f32<2>, q4_tile_i8_f32<3>, q4_tile_i8_f32<4>,
                                        q4_tile_i8_f32<5>, q4_tile_i8_f32<6>, q4_tile_i8_f32<7>, q4_tile_i8_f32<8>};

// Each row's block of 32 float32 inputs as 8-bit codes and a scale (the kernel above): |x| by
// clearing the sign, its maximum by a fixed tree of vector maxima, x / dx rounded to the nearest
// integer (ties to even), packed to bytes and put in the order k0, k0 + 2, k0 + 1, k0 + 3; and the
// block's sum as the rounded inputs' (xsum = dx Σ qx, below).
__attribute__((target("avx2,fma")))
void q4_quantize_rows_f32(const float* x, int64_t M, int64_t K, float* xsum, float* xd, int8_t* xq) {
  const int64_t blocks = K / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs leave each 128-bit lane's dwords as x0..3, x8..11, x16..19, x24..27 | x4..7, ...: back in order
  const __m256i unpack = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                         0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + kBlock * b;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 top8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
      const __m128 four = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
      const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
      const float top = _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
      const float dx = top / 127.0f;
      xd[r * blocks + b] = dx;
      __m256i codes = _mm256_setzero_si256();
      int32_t total = 0;
      if (dx != 0.0f) {
        const __m256 div = _mm256_set1_ps(dx);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
          q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        codes = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(packed, unpack), order);
        const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        const __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        const __m128i sum2 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
        total = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 1)));
      }
      xsum[r * blocks + b] = dx * float(total);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + kBlock * b), codes);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Q4_1 with 16-bit activations from float32 ones, on AVX2 (`bits` 16): integer dot products of the
// 4-bit codes with each row's inputs rounded to 16 bits per block of 32, in the same native layout.
//
// Each row's block of 32 inputs is rounded once per call, from its own values only: dx = max|x| /
// 32767, qx = nearest integer of x / dx (ties to even), stored in order. A chunk's two 16-byte halves
// (features 0..7, 8..15) widen to words; word 2 i + j holds feature i's codes for inputs k0 + j (low
// nibble) and k0 + 2 + j (high), so v & 0x0F puts the codes for (k0, k0 + 1) in lane i's two words
// and v >> 4 those for (k0 + 2, k0 + 3). One signed multiply-add of word pairs per lane against the
// row's (qx[k0], qx[k0 + 1]), another against (qx[k0 + 2], qx[k0 + 3]), gives 8 lanes of int32 per
// half: the block's Σ q qx exactly (at most 32 * 15 * 32,767 in magnitude, far inside int32). A block
// ends with y += (d dx) s, then y += m dx Σ qx, as the 8-bit kernel. The integer sums are exact and
// everything else is fixed by the row's own inputs: the same bits whatever the number of rows.
//
// Against float32 inputs (q4_tile_f32), one row forms a chunk's codes with 6 instructions instead of
// 18 and multiplies them with 4 instead of 8. On Zen 3 the word multiply-adds issue two a cycle, as
// the FMAs do, at 16 products each against the FMA's 8: a 4-row pass runs 1.6x the float32 kernel's
// (one thread, 36,864 x 576, AMD EPYC with AVX2: 57 against 35 GMAC/s). Each input keeps 15 bits of
// its block's largest magnitude (bfloat16 keeps 8 of its own): the logits' distance from the file's
// is what `bench step` reports beside llama.cpp's.
//
// The chunk's sums are pinned to registers after each chunk (an empty asm): integer additions
// reassociate, and without the pin GCC hoisted every multiply-add of a block ahead of its additions,
// spilling their results to the stack (168 stores and reloads in a 2-row pass, which then ran at a
// third of the multiply-adds' rate). The sums, and so the bits, are the same either way.

constexpr int kTileI16 = 4;  // rows per pass: 4 rows' sums, a chunk's codes and a row's inputs fill the 16 registers

// Tiles of 16 features per pass for R rows (every feature's arithmetic is the same whatever the tiles
// beside it): two for 1 row, one for more.
constexpr int i16_tiles_per_pass(int R) { return R == 1 ? 2 : 1; }

template <int R, int TT>
__attribute__((target("avx2,fma,f16c")))
void q4_tile_i16_f32(const uint16_t* d, const uint16_t* m, const uint8_t* w, const int16_t* xq, const float* xd,
                     const float* xsum, int64_t blocks, int64_t K, float* out, int64_t N) {
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  const int64_t tile_codes = blocks * kQ4TileBytes, tile_scales = blocks * kQ4Tile;
  __m256 y[TT][R][2];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) y[t][r][0] = y[t][r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i s[TT][R][2];
    for (int t = 0; t < TT; ++t)
      for (int r = 0; r < R; ++r) s[t][r][0] = s[t][r][1] = _mm256_setzero_si256();
    q4_prefetch<TT>(d, m, w, tile_codes, tile_scales, b, kQ4AheadI16);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 2
      for (int t = 0; t < TT; ++t) {
        const uint8_t* wc = w + t * tile_codes + kQ4TileBytes * b + 32 * c;
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 16 * h)));
          lo[h] = _mm256_and_si256(v, low4);  // lane i: feature i's codes for k0, k0 + 1
          hi[h] = _mm256_srli_epi16(v, 4);    // and for k0 + 2, k0 + 3
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t pair0, pair1;
          std::memcpy(&pair0, xq + r * K + kBlock * b + 4 * c, 4);
          std::memcpy(&pair1, xq + r * K + kBlock * b + 4 * c + 2, 4);
          const __m256i x0 = _mm256_set1_epi32(pair0), x1 = _mm256_set1_epi32(pair1);
          for (int h = 0; h < 2; ++h) {
            s[t][r][h] = _mm256_add_epi32(
                s[t][r][h], _mm256_add_epi32(_mm256_madd_epi16(lo[h], x0), _mm256_madd_epi16(hi[h], x1)));
          }
        }
      }
      for (int t = 0; t < TT; ++t)
        for (int r = 0; r < R; ++r) __asm__("" : "+x"(s[t][r][0]), "+x"(s[t][r][1]));  // the pin (above)
    }
    for (int t = 0; t < TT; ++t) {
      __m256 sums[R][2];  // exact: integers below 2^24
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) sums[r][h] = _mm256_cvtepi32_ps(s[t][r][h]);
      q4_block_end_f32<R, true>(d + t * tile_scales + kQ4Tile * b, m + t * tile_scales + kQ4Tile * b, xd, xsum,
                                blocks, b, sums, y[t]);
    }
  }
  q4_store_f32(y, out, N);
}

using Q4TileI16F32 = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, const int16_t*, const float*,
                              const float*, int64_t, int64_t, float*, int64_t);
// [rows - 1]: a pass over i16_tiles_per_pass(rows) tiles, then [kTileI16 + rows - 1]: one tile (a share's last).
constexpr Q4TileI16F32 kQ4TilesI16[] = {
    q4_tile_i16_f32<1, i16_tiles_per_pass(1)>, q4_tile_i16_f32<2, i16_tiles_per_pass(2)>,
    q4_tile_i16_f32<3, i16_tiles_per_pass(3)>, q4_tile_i16_f32<4, i16_tiles_per_pass(4)>,
    q4_tile_i16_f32<1, 1>, q4_tile_i16_f32<2, 1>, q4_tile_i16_f32<3, 1>, q4_tile_i16_f32<4, 1>};

}  // namespace

// Each row's block of 32 float32 inputs as 16-bit codes and a scale (the kernel above, and the 8-bit
// output layer's, q8_matmul.cpp): |x| by clearing the sign, its maximum by a fixed tree of vector
// maxima, x / dx rounded to the nearest integer (ties to even), packed to words in order; the
// block's sum as the rounded inputs' (dx Σ qx).
__attribute__((target("avx2,fma")))
void quantize_rows_i16(const float* x, int64_t M, int64_t K, float* xsum, float* xd, int16_t* xq) {
  const int64_t blocks = K / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + kBlock * b;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 top8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
      const __m128 four = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
      const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
      const float top = _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
      const float dx = top / 32767.0f;
      xd[r * blocks + b] = dx;
      __m256i codes[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      int32_t total = 0;
      if (dx != 0.0f) {
        // Clamped to ±32,767: only where dx is subnormal can a quotient pass it, and then the words
        // and the block's sum still hold the same integers.
        const __m256 div = _mm256_set1_ps(dx), top_code = _mm256_set1_ps(32767.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
          const __m256 code = _mm256_round_ps(_mm256_div_ps(v[i], div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          q[i] = _mm256_cvtps_epi32(
              _mm256_min_ps(_mm256_max_ps(code, _mm256_sub_ps(_mm256_setzero_ps(), top_code)), top_code));
        }
        // packs leave each 128-bit lane's words as x0..3, x8..11 | x4..7, x12..15: back in order
        for (int h = 0; h < 2; ++h) {
          codes[h] = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
        }
        const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        const __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        const __m128i sum2 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
        total = _mm_cvtsi128_si32(_mm_add_epi32(sum2, _mm_shuffle_epi32(sum2, 1)));
      }
      xsum[r * blocks + b] = dx * float(total);
      for (int h = 0; h < 2; ++h) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + kBlock * b + 16 * h), codes[h]);
      }
    }
  }
}

namespace {

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

// One call on its own: the rows' preparation, then the tiles split between threads.
template <typename Call>
void q4_run(const Call& call) {
  q4_prepare(call, 0, call.M);
  at::parallel_for(0, call.tiles, 1, [&](int64_t begin, int64_t end) { q4_tiles(call, begin, end); });
}

}  // namespace

Q4Call q4_call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
               Q4Scratch& scratch, at::Tensor& out) {
  TORCH_CHECK(has_avx512_bf16(), "q4_matmul: needs AVX-512 BF16 (kernels/int4.py checks q4_native first)");
  TORCH_CHECK(bits == 0 || bits == 8, "q4_matmul: bfloat16 inputs are rounded to 8 bits or not at all, got bits ",
              bits);
  const bool int8 = bits == 8;
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
// k0, k0 + 2, k0 + 1, k0 + 3 of each group of four that the weight lanes hold; for 8-bit activations
// the block's sum is then the rounded inputs', dx Σ qx.
__attribute__((target("avx512f,avx512bw")))
void q4_prepare(const Q4Call& c, int64_t r0, int64_t r1) {
  // Bytes of a 16-byte group in the order 0, 2, 1, 3 of every four.
  const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                         0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < c.blocks; ++b) {
      const uint16_t* xb = c.x + r * c.K + kBlock * b;
      const __m512 lo = bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
      const __m512 hi = bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
      c.xsum[r * c.blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      if (!c.int8) continue;
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float dx = top / 127.0f;
      c.xd[r * c.blocks + b] = dx;
      __m256i codes = _mm256_setzero_si256();
      int32_t total = 0;
      if (dx != 0.0f) {
        const __m512 div = _mm512_set1_ps(dx);
        const __m512i q32lo = _mm512_cvt_roundps_epi32(_mm512_div_ps(lo, div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q32hi = _mm512_cvt_roundps_epi32(_mm512_div_ps(hi, div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m128i qlo = _mm512_cvtepi32_epi8(q32lo), qhi = _mm512_cvtepi32_epi8(q32hi);
        codes = _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(qlo), qhi, 1), order);
        total = _mm512_reduce_add_epi32(_mm512_add_epi32(q32lo, q32hi));
      }
      c.xsum[r * c.blocks + b] = dx * float(total);  // the rounded inputs' sum (q4_tile_i8_f32 says why)
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

Q4CallF32 q4_call_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                      int64_t bits, Q4Scratch& scratch, at::Tensor& out) {
  TORCH_CHECK(has_avx2_fma(), "q4_matmul: float32 activations need AVX2, FMA and F16C (kernels/int4.py checks "
              "q4_native first)");
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 16, "q4_matmul: float32 inputs are rounded to 8 or 16 bits or not at "
              "all, got bits ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q4_matmul: x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock, tiles = d.size(0), N = tiles * kQ4Tile;
  TORCH_CHECK(K % kBlock == 0 && codes.scalar_type() == at::kByte && codes.numel() == N * K / 2,
              "q4_matmul: codes of [N, K] in the native layout, K a multiple of 32");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({tiles, blocks, kQ4Tile}) && m.sizes() == d.sizes() &&
              d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf, "q4_matmul: d, m [N/16, K/32, 16] float16");
  scratch.xsum.resize(M * blocks);
  if (bits != 0) scratch.xd.resize(M * blocks);
  if (bits == 8) scratch.xq.resize(M * K);
  if (bits == 16) scratch.xq16.resize(M * K);
  if (!out.defined()) out = at::empty({M, N}, x.options());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({M, N}) && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "q4_matmul: out [M, N] float32");
  return {x.data_ptr<float>(), scratch.xsum.data(), scratch.xd.data(), scratch.xq.data(), scratch.xq16.data(),
          int(bits), codes.data_ptr<uint8_t>(),
          reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()),
          M, K, blocks, tiles, N, out.data_ptr<float>()};
}

void q4_prepare(const Q4CallF32& c, int64_t r0, int64_t r1) {
  const int64_t rows = r1 - r0, x0 = r0 * c.K, b0 = r0 * c.blocks;
  if (rows <= 0) return;
  if (c.bits == 8) {
    q4_quantize_rows_f32(c.x + x0, rows, c.K, c.xsum + b0, c.xd + b0, c.xq + x0);
  } else if (c.bits == 16) {
    quantize_rows_i16(c.x + x0, rows, c.K, c.xsum + b0, c.xd + b0, c.xq16 + x0);
  } else {
    q4_block_sums_f32(c.x + x0, rows, c.K, c.xsum + b0);
  }
}

// Output tiles [begin, end) of 16 features for every row: a thread's share. Tiles outer, passes of
// rows inner: a group of tiles' codes (at most 4 tiles, 18 KB at K = 576) stays in the core's caches
// for every pass of rows, so a window of more rows than a pass takes (a verify over 5+ positions)
// reads the matrix from memory once, not once a pass.
void q4_tiles(const Q4CallF32& c, int64_t begin, int64_t end) {
  if (c.bits == 8) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t *d = c.d + t * c.blocks * kQ4Tile, *m = c.m + t * c.blocks * kQ4Tile;
      const uint8_t* w = c.codes + t * c.blocks * kQ4TileBytes;
      for (int64_t r0 = 0; r0 < c.M; r0 += kTileI8F32) {
        const int64_t rows = std::min<int64_t>(kTileI8F32, c.M - r0);
        kQ4TilesI8F32[rows - 1](d, m, w, c.xq + r0 * c.K, c.xd + r0 * c.blocks, c.xsum + r0 * c.blocks, c.blocks,
                                c.K, c.out + r0 * c.N + t * kQ4Tile, c.N);
      }
    }
    return;
  }
  const bool i16 = c.bits == 16;
  const int64_t pass_rows = i16 ? kTileI16 : kTileF32, group = i16 ? i16_tiles_per_pass(1) : f32_tiles_per_pass(1);
  for (int64_t t0 = begin; t0 < end; t0 += group) {
    const int64_t t1 = std::min(end, t0 + group);
    for (int64_t r0 = 0; r0 < c.M; r0 += pass_rows) {
      const int64_t rows = std::min(pass_rows, c.M - r0);
      const int64_t per_pass = i16 ? i16_tiles_per_pass(int(rows)) : f32_tiles_per_pass(int(rows));
      for (int64_t t = t0; t < t1;) {
        const bool whole = t + per_pass <= t1;
        const uint16_t *d = c.d + t * c.blocks * kQ4Tile, *m = c.m + t * c.blocks * kQ4Tile;
        const uint8_t* w = c.codes + t * c.blocks * kQ4TileBytes;
        float* out = c.out + r0 * c.N + t * kQ4Tile;
        if (i16) {
          kQ4TilesI16[whole ? rows - 1 : kTileI16 + rows - 1](d, m, w, c.xq16 + r0 * c.K, c.xd + r0 * c.blocks,
                                                               c.xsum + r0 * c.blocks, c.blocks, c.K, out, c.N);
        } else {
          kQ4TilesF32[whole ? rows - 1 : kTileF32 + rows - 1](d, m, w, c.x + r0 * c.K, c.xsum + r0 * c.blocks,
                                                               c.blocks, c.K, out, c.N);
        }
        t += whole ? per_pass : 1;
      }
    }
  }
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     int64_t bits) {
  const at::Tensor xin = x.contiguous();
  at::Tensor out;
  Q4Scratch scratch;
  if (x.scalar_type() == at::kFloat) {  // AVX2: x [M, K] float32 -> [M, N] float32
    q4_run(q4_call_f32(xin, codes, d, m, bits, scratch, out));
    return out;
  }
  q4_run(q4_call(xin, codes, d, m, bits, scratch, out));
  return out;
}

}  // namespace cpu_ops
