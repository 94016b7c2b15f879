// Greedy verification (`greedy_verify`) on CPU logits in one call (kernels/verify.py): each row's
// argmax (the first largest value, NaN above everything, as torch.argmax), then the accepted prefix of
// the proposals. A row's result depends on its own logits only. logits [B, G+1, V] float32
// contiguous, draft [B, G] int64, num_draft [B] int64 -> (accepted [B], tokens [B, G+1]).

#include "cpu_ops.h"

namespace cpu_ops {
namespace {

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

}  // namespace

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

}  // namespace cpu_ops
