// The exponential race's candidates (`race_candidates`; kernels/random.py, ``race``): a sample from a
// probability table is the token with the largest p / E, E = -log(u) for the token's counter-based
// uniform u. Computing the two logs of every token of a 49,152-token row costs more than the rest of a
// sampled pass, and all but a few tokens cannot win: since 1 - u <= -log(u) <= (1 - u) / u for u in
// (0, 1),
//     p u / (1 - u) <= p / E <= p / (1 - u),
// bounds with no logarithm. A token whose upper bound is below the best lower bound of its row cannot
// win. Where several remain (a handful), their scores in double precision settle the row unless the
// best two are within kRaceResolve (below), and only then are they returned, for ``race`` to score them
// with the torch ops the dense race uses (the same bits). The bounds hold for the exact values; torch's
// float32 noise is within ~1e-5 of them (two logs of 1-ulp accuracy), so keeping every token within a
// factor kRaceSlack of the best lower bound (1e-3 in log space) keeps every token torch could rank
// first. The uniforms are kernels/random.py's bits: two rounds of murmur3's fmix32 over (key, id).

#include "cpu_ops.h"

namespace cpu_ops {
namespace {

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

}  // namespace

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

}  // namespace cpu_ops
