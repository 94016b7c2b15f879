// Attention over the slot KV cache (`attention`, specstream/models/attention.py), for every forward of a
// model (prefill, decode, verify); `LayerStack` (layer_stack.cpp) runs its two passes in its own
// parallel region.
//
// For each row b and its T new positions p = start[b] + t: RoPE on the query and key heads, the key
// and value written into the cache at p (in the cache's dtype), then for every query head
// softmax(q · k_j * scale) · v over exactly its keys j in [lo, p] (lo: the sliding window's start)
// — never over masked ones — in index order, in float32, rounded to the activations' dtype once at
// the end. A position's output therefore depends only on its query, its keys and values: not on T,
// the other rows, or how many keys the batch's longest row has (which changed the last bits of a
// float32 softmax over masked keys in the torch path).

#include <atomic>
#include "cpu_ops.h"

namespace cpu_ops {
namespace {

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
    return bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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

// The 8 lanes of the AVX2 path's sums in its order: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float tree8(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

// Dot product over D values (a multiple of 16), as attend_avx2 takes it: 16 lanes of fused
// multiply-adds over the vector, lanes i and i + 8 added, then tree8.
template <typename T>
float dot_generic(const float* q, const T* k, int64_t D) {
  float lanes[16] = {0};
  for (int64_t i = 0; i < D; ++i) lanes[i % 16] = std::fma(q[i], load_value(k + i), lanes[i % 16]);
  float eight[8];
  for (int i = 0; i < 8; ++i) eight[i] = lanes[i] + lanes[i + 8];
  return tree8(eight);
}

// softmax's weights in place: e^(s - top) for each score, and their total (8 lanes, key j in lane
// j % 8, then tree8) as attend_avx2 sums them.
inline float exp_weights_generic(float* w, int64_t n, float top) {
  float lanes[8] = {0};
  for (int64_t j = 0; j < n; ++j) {
    w[j] = exp_generic(w[j] - top);
    lanes[j % 8] += w[j];
  }
  return tree8(lanes);
}

// AVX2: 8 values of a row as float32 (attend_avx2 below).
template <typename T>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
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

// tree8 of 8 vectors at once: lane k of the result is tree8 of vector k's lanes.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 tree8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The lanes of keys j0 .. j0 + 7 that lie before n (all ones), the others zero.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 live_keys8(int64_t n, int64_t j0) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(8, n - j0))), lane));
}

// Where key j of a query's window lies in its slot: lo + j for the first `head` keys (all of a
// chain's; a tree node's prefix), then base + tail[j - head] (a tree node's ancestors, root first,
// as offsets from the row's start). No list is built per query: the prefix stays a range.
struct KeyRows {
  int64_t lo, head = INT64_MAX, base = 0;
  const int64_t* tail = nullptr;
  int64_t at(int64_t j) const { return j < head ? lo + j : base + tail[j - head]; }
};

// Where one kv head's vector of position p lies: in the row's own slot, or, for a position a shared
// prefix holds (KVCache.fork, the prefix cache), in the slot `src[p]` names. The same arithmetic
// reads either, so a position's output has the same bits whichever slot holds its keys.
template <typename T>
struct SlotRows {
  const T* own;         // the row's slot at position 0 (of this head)
  const T* first;       // slot 0 at position 0 (of this head)
  const int64_t* src;   // [kv_len] the slot of each position, or null: all in `own`
  int64_t slot_stride;  // elements from one slot to the next
  int64_t D;
  const T* at(int64_t p) const { return (src == nullptr ? own : first + src[p] * slot_stride) + p * D; }
};

// Query heads at one position over their keys, D = 16 NV: the AVX-512 path of step 2 below, for G
// heads that share a kv head (GQA; G = 1: one head alone). Key j of the n = pos + 1 - lo it reads is
// position `rows.at(j)` (KeyRows: a chain's lo + j; a tree node's prefix, then its ancestors, so a
// node at depth d reads its keys in the order a chain's position d does), found where SlotRows
// says. The queries in registers; each key's and each value's vectors loaded once for the G heads,
// whose independent chains of fused multiply-adds keep the FMA units busy where one head's chain
// waits on the latency of its last. Per head: scores one key at a time (16 lanes over D, then the
// lanes summed), four keys through one shuffle-and-add tree; their exponentials 16 at a time
// (exp512); the weighted values into NV accumulators held in registers, key after key. A head's
// operations and their order do not depend on G, so its output has the same bits in a group or alone.
template <typename T, int NV, int G>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void attend_avx512(const float* const* q, const SlotRows<T>& keys, const SlotRows<T>& values, int64_t lo,
                   int64_t pos, float scale, std::vector<float>* weights, T* const* dst, const KeyRows& rows) {
  __m512 qv[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) qv[g][v] = _mm512_loadu_ps(q[g] + 16 * v);
  const int64_t n = pos + 1 - lo;
  for (int g = 0; g < G; ++g) weights[g].resize((n + 15) / 16 * 16);
  __m128 top4[G];
  for (int g = 0; g < G; ++g) top4[g] = _mm_set1_ps(-INFINITY);
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 4) {
    __m512 a[G][4];
    for (int r = 0; r < 4; ++r) {
      if (j + r < n) {
        const T* k = keys.at(rows.at(j + r));
        __m512 kv[NV];
        for (int v = 0; v < NV; ++v) kv[v] = load16(k + 16 * v);
        for (int g = 0; g < G; ++g) {
          a[g][r] = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int v = 1; v < NV; ++v) a[g][r] = _mm512_fmadd_ps(qv[g][v], kv[v], a[g][r]);
        }
      } else {
        for (int g = 0; g < G; ++g) a[g][r] = _mm512_setzero_ps();
      }
    }
    const int live = int(std::min<int64_t>(4, n - j));
    const __mmask8 mask = __mmask8((1u << live) - 1);
    for (int g = 0; g < G; ++g) {
      const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][0], a[g][1]), _mm512_unpackhi_ps(a[g][0], a[g][1]));
      const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a[g][2], a[g][3]), _mm512_unpackhi_ps(a[g][2], a[g][3]));
      const __m512d t01d = _mm512_castps_pd(t01), t23d = _mm512_castps_pd(t23);
      const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t01d, t23d)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(t01d, t23d)));
      const __m512 v2 = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E));
      const __m512 v4 = _mm512_add_ps(v2, _mm512_shuffle_f32x4(v2, v2, 0xB1));
      const __m128 s4 = _mm_mul_ps(_mm512_castps512_ps128(v4), scale4);
      _mm_mask_storeu_ps(weights[g].data() + j, mask, s4);
      top4[g] = _mm_mask_max_ps(top4[g], mask, top4[g], s4);
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    __m128 t = _mm_max_ps(top4[g], _mm_movehl_ps(top4[g], top4[g]));
    t = _mm_max_ps(t, _mm_shuffle_ps(t, t, 0x55));
    const __m512 top_v = _mm512_set1_ps(_mm_cvtss_f32(t));
    __m512 sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, weights[g].data() + j), top_v));
      _mm512_mask_storeu_ps(weights[g].data() + j, live, e);
      sums = _mm512_mask_add_ps(sums, live, sums, e);
    }
    total[g] = _mm512_reduce_add_ps(sums);
  }
  __m512 out[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) out[g][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* val = values.at(rows.at(j));
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load16(val + 16 * v);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g][j]);
      for (int v = 0; v < NV; ++v) out[g][v] = _mm512_fmadd_ps(w, vv[v], out[g][v]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(total[g]);
    for (int v = 0; v < NV; ++v) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_div_ps(out[g][v], inv));
      for (int i = 0; i < 16; ++i) store_value(dst[g] + 16 * v + i, lanes[i]);
    }
  }
}

// 8 float32 values into a row of T. A vector store for float32: GCC kept a loop's accumulators on the
// stack, stored at every step, when they were later copied out through an array lane by lane.
template <typename T>
__attribute__((target("avx2,fma"), always_inline)) inline void store8(T* p, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; ++i) store_value(p + i, lanes[i]);
  }
}
// The weighted values of attend_avx2 below for S vectors of D from i0 (S a constant, and the results
// stored by store8, so the G * S accumulators stay in registers: before, they lived on the stack, each
// key's multiply-add followed by a store): out += w_j v_j key after key, then out / total.
// `slice` < S: the last pass of a D that S vectors do not divide, taken as the pass of its own width.
template <typename T, int G, int S>
__attribute__((target("avx2,fma"), always_inline)) inline void weighted_values_avx2(
    int slice, const std::vector<float>* weights, const SlotRows<T>& values, const KeyRows& rows, int64_t n,
    int64_t i0, const __m256* inv, T* const* dst) {
  if constexpr (S > 1) {
    if (slice < S) return weighted_values_avx2<T, G, S - 1>(slice, weights, values, rows, n, i0, inv, dst);
  }
  const float* w[G];
  for (int g = 0; g < G; ++g) w[g] = weights[g].data();
  __m256 out[G][S];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < S; ++c) out[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* v = values.at(rows.at(j)) + i0;
    __m256 wj[G];
    for (int g = 0; g < G; ++g) wj[g] = _mm256_broadcast_ss(w[g] + j);
    for (int c = 0; c < S; ++c) {
      const __m256 vv = load8(v + 8 * c);
      for (int g = 0; g < G; ++g) out[g][c] = _mm256_fmadd_ps(wj[g], vv, out[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < S; ++c) store8(dst[g] + i0 + 8 * c, _mm256_div_ps(out[g][c], inv[g]));
  }
}

// The scores of attend_avx2 below at D = 64, with the same operations in the same order (so the
// same bits): a head's query held in 8 registers while it meets 8 keys in turn, whose vectors come
// from the first-level cache again for the next head. Loading the G queries for every key instead
// (they do not fit the 16 registers together) took a load per multiply-add: 7-11% of the op.
template <typename T, int G>
__attribute__((target("avx2,fma"), always_inline)) inline void scores_avx2_d64(
    const float* const* q, const SlotRows<T>& keys, const KeyRows& rows, int64_t n, __m256 scale8,
    std::vector<float>* weights, __m256* top8) {
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int live = int(std::min<int64_t>(8, n - j0));
    const T* k[8];
    for (int r = 0; r < live; ++r) k[r] = keys.at(rows.at(j0 + r));
    const __m256 keep = live_keys8(n, j0);
    for (int g = 0; g < G; ++g) {
      __m256 qv[8];
      for (int v = 0; v < 8; ++v) qv[v] = _mm256_loadu_ps(q[g] + 8 * v);
      __m256 a[8];
      for (int r = 0; r < 8; ++r) {
        __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
        if (r < live) {
          for (int i = 0; i < 4; ++i) {
            low = _mm256_fmadd_ps(qv[2 * i], load8(k[r] + 16 * i), low);
            high = _mm256_fmadd_ps(qv[2 * i + 1], load8(k[r] + 16 * i + 8), high);
          }
        }
        a[r] = _mm256_add_ps(low, high);
      }
      const __m256 s = _mm256_mul_ps(tree8x8(a), scale8);
      _mm256_storeu_ps(weights[g].data() + j0, s);
      top8[g] = _mm256_max_ps(top8[g], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, keep));
    }
  }
}

// The AVX2 path of step 2 below, for G query heads that share a kv head (G = 1: one head alone), D a
// multiple of 16. Eight keys at a time: each key's score, per head, as 16 lanes of fused
// multiply-adds over D (two 8-lane registers), the two registers added, then the 8 keys' lanes summed
// together (tree8x8); the exponentials 8 at a time (exp256) and their total over 8 lanes, then tree8;
// the weighted values by fused multiply-adds key after key into accumulators held in registers, a
// slice of D at a time; the division. The generic path does the same operations one value at a time
// (dot_generic, exp_weights_generic, axpy_generic), so the same bits, whatever G. Each value's vectors
// are loaded (and widened from bfloat16) once for the G heads, and so are each key's but at D = 64
// (scores_avx2_d64): at a long context the cache is most of what a step reads.
template <typename T, int G>
__attribute__((target("avx2,fma")))
void attend_avx2(const float* const* q, const SlotRows<T>& keys, const SlotRows<T>& values, int64_t lo,
                 int64_t pos, float scale, std::vector<float>* weights, T* const* dst, const KeyRows& rows,
                 int64_t D) {
  const int64_t n = pos + 1 - lo;
  const __m256 scale8 = _mm256_set1_ps(scale);
  __m256 top8[G];
  for (int g = 0; g < G; ++g) {
    weights[g].resize((n + 7) / 8 * 8);
    top8[g] = _mm256_set1_ps(-INFINITY);
  }
  if (D == 64) {
    scores_avx2_d64<T, G>(q, keys, rows, n, scale8, weights, top8);
  } else {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      __m256 a[G][8];
      for (int r = 0; r < 8; ++r) {
        if (j0 + r >= n) {
          for (int g = 0; g < G; ++g) a[g][r] = _mm256_setzero_ps();
          continue;
        }
        const T* k = keys.at(rows.at(j0 + r));
        __m256 low[G], high[G];
        for (int g = 0; g < G; ++g) low[g] = high[g] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
          const __m256 kl = load8(k + i), kh = load8(k + i + 8);
          for (int g = 0; g < G; ++g) {
            low[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + i), kl, low[g]);
            high[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + i + 8), kh, high[g]);
          }
        }
        for (int g = 0; g < G; ++g) a[g][r] = _mm256_add_ps(low[g], high[g]);
      }
      const __m256 keep = live_keys8(n, j0);
      for (int g = 0; g < G; ++g) {
        const __m256 s = _mm256_mul_ps(tree8x8(a[g]), scale8);
        _mm256_storeu_ps(weights[g].data() + j0, s);
        top8[g] = _mm256_max_ps(top8[g], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, keep));
      }
    }
  }
  __m256 inv[G];
  for (int g = 0; g < G; ++g) {
    float lanes[8];
    _mm256_storeu_ps(lanes, top8[g]);
    float top = lanes[0];
    for (int i = 1; i < 8; ++i) top = std::max(top, lanes[i]);
    const __m256 top_v = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(weights[g].data() + j0), top_v)),
                                     live_keys8(n, j0));
      _mm256_storeu_ps(weights[g].data() + j0, e);
      sums = _mm256_add_ps(sums, e);
    }
    _mm256_storeu_ps(lanes, sums);
    inv[g] = _mm256_set1_ps(tree8(lanes));
  }
  // Vectors of D per pass: G * kSlice accumulators, 12 at most (G = 3: 4 vectors, 2 passes over the
  // keys at D = 64; 2-3% of a verify against 6 accumulators and 4 passes, AVX2 EPYC, one-off).
  constexpr int kSlice = G == 1 ? 8 : G == 2 ? 6 : G == 3 ? 4 : 3;
  for (int64_t i0 = 0; i0 < D; i0 += 8 * kSlice) {
    weighted_values_avx2<T, G, kSlice>(int(std::min<int64_t>(kSlice, (D - i0) / 8)), weights, values, rows, n, i0,
                                       inv, dst);
  }
}

}  // namespace

template <typename T>
void Attention<T>::write(int64_t begin, int64_t end) const {  // 1. This forward's keys (with RoPE) and values into the cache.
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

namespace {
std::atomic<bool> group_heads{true};
}  // namespace

void set_attention_groups(bool on) { group_heads.store(on); }
bool attention_groups() { return group_heads.load(); }

template <typename T>
void Attention<T>::attend(int64_t begin, int64_t end) const {  // 2. Every query head over its keys.
  const int64_t group = Hq / Hkv;
  // The query heads that share a kv head, as many of them as this share of the items holds, run
  // together on the AVX-512 path for D = 64 and on the AVX2 path (the same bits as one by one:
  // attend_avx512, attend_avx2).
  const bool grouped = (wide ? D == 64 : avx2) && group >= 2 && group <= 4 &&
                       group_heads.load(std::memory_order_relaxed);  // (a head alone is the group of one)
  std::vector<float> q(wide || avx2 ? 4 * D : D), acc(D);
  std::vector<float> weights[4];
  for (int64_t item = begin; item < end; ++item) {
    // Items in the order (row, kv head, position, query head of the kv head): a thread's share
    // reads one kv head's keys and values for every position it has in turn, the later ones
    // from its caches.
    const int64_t hg = item % group, t = item / group % T_, bg = item / group / T_, b = bg / Hkv, g = bg % Hkv;
    const int64_t h = g * group + hg, bt = b * T_ + t;
    const int64_t pos = starts[b] + (depth != nullptr ? depth[bt] : bt % T_);  // the query's position
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    KeyRows rows{lo};
    if (depth != nullptr) {  // the prefix in [lo, start), then the ancestors at depth >= lo - start
      const int64_t first = std::max<int64_t>(0, lo - starts[b]);
      rows.head = std::max<int64_t>(0, starts[b] - lo);
      rows.base = starts[b];
      rows.tail = path + bt * T_ + first;
    }
    T* dst = o + bt * Hq * D + h * D;
    const int64_t heads = grouped ? std::min(group - hg, end - item) : 1;  // this share's heads of the kv head
    const float* qs[4];
    T* dsts[4];
    for (int64_t i = 0; i < heads; ++i) {
      rope(x + bt * width + (h + i) * D, ct + pos * D, st + pos * D, D, q.data() + i * D);
      qs[i] = q.data() + i * D;
      dsts[i] = dst + i * D;
    }
    if (wide && (D == 64 || D == 128)) {
      const int64_t* src = sources != nullptr ? sources + b * kv_len : nullptr;
      const SlotRows<T> keys{cache_at(kc, slots[b], g, 0), cache_at(kc, 0, g, 0), src, Hkv * L * D, D};
      const SlotRows<T> values{cache_at(vc, slots[b], g, 0), cache_at(vc, 0, g, 0), src, Hkv * L * D, D};
      if (D == 128) {
        attend_avx512<T, 8, 1>(qs, keys, values, lo, pos, scale, weights, dsts, rows);
      } else if (heads == 1) {
        attend_avx512<T, 4, 1>(qs, keys, values, lo, pos, scale, weights, dsts, rows);
      } else if (heads == 2) {
        attend_avx512<T, 4, 2>(qs, keys, values, lo, pos, scale, weights, dsts, rows);
      } else if (heads == 3) {
        attend_avx512<T, 4, 3>(qs, keys, values, lo, pos, scale, weights, dsts, rows);
      } else {
        attend_avx512<T, 4, 4>(qs, keys, values, lo, pos, scale, weights, dsts, rows);
      }
      item += heads - 1;
      continue;
    }
    if (avx2) {
      const int64_t* src = sources != nullptr ? sources + b * kv_len : nullptr;
      const SlotRows<T> keys{cache_at(kc, slots[b], g, 0), cache_at(kc, 0, g, 0), src, Hkv * L * D, D};
      const SlotRows<T> values{cache_at(vc, slots[b], g, 0), cache_at(vc, 0, g, 0), src, Hkv * L * D, D};
      if (heads == 1) {
        attend_avx2<T, 1>(qs, keys, values, lo, pos, scale, weights, dsts, rows, D);
      } else if (heads == 2) {
        attend_avx2<T, 2>(qs, keys, values, lo, pos, scale, weights, dsts, rows, D);
      } else if (heads == 3) {
        attend_avx2<T, 3>(qs, keys, values, lo, pos, scale, weights, dsts, rows, D);
      } else {
        attend_avx2<T, 4>(qs, keys, values, lo, pos, scale, weights, dsts, rows, D);
      }
      item += heads - 1;
      continue;
    }
    std::vector<float>& scores = weights[0];
    scores.resize(pos + 1 - lo);
    float top = -INFINITY;
    for (int64_t i = lo; i <= pos; ++i) {
      const int64_t j = rows.at(i - lo);
      const int64_t slot = sources != nullptr ? sources[b * kv_len + j] : slots[b];
      const T* k = cache_at(kc, slot, g, j);
      const float s = (wide ? dot_avx512(q.data(), k, D) : dot_generic(q.data(), k, D)) * scale;
      scores[i - lo] = s;
      top = std::max(top, s);
    }
    const float total = exp_weights_generic(scores.data(), pos + 1 - lo, top);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = lo; i <= pos; ++i) {
      const int64_t j = rows.at(i - lo);
      const int64_t slot = sources != nullptr ? sources[b * kv_len + j] : slots[b];
      const T* v = cache_at(vc, slot, g, j);
      if (wide) {
        axpy_avx512(scores[i - lo], v, acc.data(), D);
      } else {
        axpy_generic(scores[i - lo], v, acc.data(), D);
      }
    }
    for (int64_t i = 0; i < D; ++i) store_value(dst + i, acc[i] / total);
  }
}

template struct Attention<float>;
template struct Attention<at::BFloat16>;

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

namespace {

template <typename T>
void attention_run(const Attention<T>& a) {
  at::parallel_for(0, a.B * a.T_, 1, [&](int64_t begin, int64_t end) { a.write(begin, end); });
  at::parallel_for(0, a.B * a.T_ * a.Hq, 1, [&](int64_t begin, int64_t end) { a.attend(begin, end); });
}

}  // namespace

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

}  // namespace cpu_ops
