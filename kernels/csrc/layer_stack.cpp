// The Llama decoder-layer stack (`LayerStack`, specstream/models/attention.py and llama.py), the RMS
// norm of rows (`rms_norm`) and the activation (`silu_mul`, both specstream/models/base.py), which
// share its rounding.
//
// Llama decoder layers in one call, for bfloat16 or float32 activations and 4-bit projections on
// the native kernel (specstream/models/llama.py, `_LlamaLayer.native_weights`, decides when): the ~20
// small torch ops a layer dispatches one by one from Python (two RMS norms, the residual adds, the
// split of the fused projections) cost more than its matrix products on a small model. Each step
// keeps the eager layer's rounding (specstream/models/llama.py): in bfloat16, RMS norm normalised in
// float32 and rounded to bfloat16 before the weight's product, the residual adds, the native
// activation and its product with `up` rounded to bfloat16 as torch's ops round; in float32, the
// native RMS norm, the native silu(gate) * up and float32 adds, as the eager layer computes them;
// every row computed on its own, so the layer stays batch-invariant.

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>

#include "cpu_ops.h"

namespace cpu_ops {
namespace {

float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

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
// place of the ~8 ops torch's float32 RMS norm dispatches, and the cheaper for it (docs/benchmarks.md).
void rms_row_f32(const float* x, const float* w, int64_t H, double eps, float* out) {
  float total = 0.0f;
  for (int64_t i = 0; i < H; ++i) total += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(total / float(H) + float(eps));
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}


// silu(g) * u, the sigmoid from e^-|g| (so the exponential never overflows): 1 / (1 + t) for g >= 0,
// t / (1 + t) below; then (g sigmoid) u. On AVX2 8 values at a time, exactly these operations
// (exp256 is exp_generic's arithmetic), so an element's bits do not depend on where it falls: the
// layers split a row's elements between threads. One native op where torch's silu then its product
// with up ran as ATen calls on the calling thread alone while the team waited (on a 2-core AVX2 EPYC
// ~0.6 ms of a 1-token step's ~9 over 30 layers, ~1 ms of a 4-position verify's).
float silu_generic(float g) {
  const float t = exp_generic(-std::fabs(g));
  return g * ((g >= 0.0f ? 1.0f : t) / (1.0f + t));
}

float silu_mul_generic(float g, float u) { return silu_generic(g) * u; }

__attribute__((target("avx2,fma")))
void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 t = exp256(_mm256_or_ps(g, sign));  // e^-|g|
    const __m256 top = _mm256_blendv_ps(t, one, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 sigmoid = _mm256_div_ps(top, _mm256_add_ps(one, t));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = silu_mul_generic(gate[i], up[i]);
}

// bfloat16: silu(g) as above in float32, rounded to bfloat16, times u, rounded again: torch's two ops'
// roundings. On AVX-512 16 values at a time, the last ones masked (exp512), so every element of a
// machine takes the same operations; elsewhere one value at a time (exp_generic). Where torch's silu then
// its product ran as ATen calls on the calling thread alone (on Zen 5, 0.15 ms of a 1-token step's ~5,
// 0.26 ms of a 4-position verify's, most of it the calls' own cost), the team now shares the elements.
uint16_t silu_mul_bf16_generic(uint16_t g, uint16_t u) {
  return to_bf16(bf16_to_float(to_bf16(silu_generic(bf16_to_float(g)))) * bf16_to_float(u));
}

// 16 float32 lanes to bfloat16 bits as to_bf16 rounds them (to nearest even; a NaN stays a NaN).
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m256i to_bf16x16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void silu_mul_bf16_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 g = bf16x16_to_float(_mm256_maskz_loadu_epi16(live, gate + i));
    const __m512 u = bf16x16_to_float(_mm256_maskz_loadu_epi16(live, up + i));
    const __m512 t = exp512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign)));  // e^-|g|
    const __m512 top = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), t, one);
    const __m512 silu = bf16x16_to_float(to_bf16x16(_mm512_mul_ps(g, _mm512_div_ps(top, _mm512_add_ps(one, t)))));
    _mm256_mask_storeu_epi16(out + i, live, to_bf16x16(_mm512_mul_ps(silu, u)));
  }
}

// The share of n items that thread `tid` of a team of `team` takes: contiguous, fixed by (n, team).
std::pair<int64_t, int64_t> share(int64_t n, int tid, int team) {
  const int64_t chunk = (n + team - 1) / team, begin = std::min<int64_t>(n, tid * chunk);
  return {begin, std::min<int64_t>(n, begin + chunk)};
}

// The team's meeting point between phases: spin up to kSpin (a phase's threads finish within
// microseconds of each other when each has a core), then sleep on a futex until the last one in
// wakes it. OpenMP's own barrier (libgomp) went to sleep after a far shorter spin: on a 2-vCPU virtual
// machine (an AVX2-only EPYC) every one of a forward's ~300 barriers then paid a futex sleep and wake,
// and a forward on 2 threads took longer than on one (docs/benchmarks.md, "A CPU without AVX-512").
class TeamBarrier {
 public:
  explicit TeamBarrier(int team) : team_(team) {}

  void wait() {
    if (team_ == 1) return;
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == team_) {  // the last one in opens it
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
      }
      return;
    }
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int64_t spin = 1;; ++spin) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
      if (spin % 256 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == generation) {  // a changed value returns at once
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr, nullptr, 0);
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static constexpr std::chrono::microseconds kSpin{100};
  const int team_;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> arrived_{0}, sleepers_{0};
};

// A stack of Llama decoder layers run in ONE OpenMP parallel region per forward: the team splits each
// projection's output tiles, attention's positions and heads, the activation's elements and the rows
// of the small parts (norms, residual adds, block sums), and meets at a barrier between phases. A
// parallel region per phase cost a fork and a join each (~5 per layer, 150 per step on a 30-layer
// model) and a Python call per layer its own overhead: together a sizeable share of a step on a
// small model (docs/benchmarks.md). Every element is computed exactly as the
// phase-by-phase ops compute it (specstream/models/llama.py's layer), so the result is the same bits.
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
  static Call call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                   Scratch& scratch, at::Tensor& out) {
    return q4_call(x, codes, d, m, bits, scratch, out);
  }
  static void rms(const uint16_t* x, const uint16_t* w, int64_t H, double eps, uint16_t* out) {
    rms_row(x, w, H, eps, out);
  }
};

template <>
struct Act<float> {  // float32
  using Call = Q4CallF32;
  using Scratch = Q4Scratch;
  using Cache = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static float load(float v) { return v; }
  static float store(float f) { return f; }
  static float* data(const at::Tensor& t) { return t.data_ptr<float>(); }
  static Call call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
                   Scratch& scratch, at::Tensor& out) {
    return q4_call_f32(x, codes, d, m, bits, scratch, out);
  }
  static void rms(const float* x, const float* w, int64_t H, double eps, float* out) { rms_row_f32(x, w, H, eps, out); }
};

// Elements [e0, e1) of the rows' activation: gate_up [M, 2 I] -> act [M, I].
template <typename E>
void silu_mul_rows(const E* gate_up, int64_t I, int64_t e0, int64_t e1, E* act) {
  for (int64_t e = e0; e < e1;) {
    const int64_t r = e / I, c = e % I, n = std::min(e1 - e, I - c);
    if constexpr (std::is_same_v<E, float>) {
      silu_mul_f32(gate_up + r * 2 * I + c, gate_up + r * 2 * I + I + c, act + r * I + c, n);
    } else {
      silu_mul_bf16(gate_up + r * 2 * I + c, gate_up + r * 2 * I + I + c, act + r * I + c, n);
    }
    e += n;
  }
}

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

}  // namespace

void silu_mul_f32(const float* gate, const float* up, float* out, int64_t n) {
  if (has_avx2_fma()) {
    silu_mul_avx2(gate, up, out, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = silu_mul_generic(gate[i], up[i]);
}

void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  if (has_avx512()) {
    silu_mul_bf16_avx512(gate, up, out, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = silu_mul_bf16_generic(gate[i], up[i]);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const bool f32 = gate_up.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || gate_up.scalar_type() == at::kBFloat16) && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up [..., 2 I] float32 or bfloat16");
  const at::Tensor x = gate_up.contiguous();
  const int64_t I = x.size(-1) / 2, M = x.numel() / std::max<int64_t>(1, 2 * I);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  at::parallel_for(0, M * I, 4096, [&](int64_t begin, int64_t end) {
    if (f32) {
      silu_mul_rows(x.data_ptr<float>(), I, begin, end, out.data_ptr<float>());
    } else {
      silu_mul_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), I, begin, end,
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    }
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
               int64_t head_dim, double scale, std::vector<int64_t> windows, int64_t bits)
      : layers_(std::move(layers)), eps_(eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), scale_(scale), windows_(std::move(windows)), bits_(bits) {
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
      layer.qkv = A::call(normed, w[2], w[3], w[4], bits_, sums[0], qkv);
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
      layer.o = A::call(attn_call.out.view({M, attn_call.out.size(2)}), w[5], w[6], w[7], bits_, sums[1], hidden);
      TORCH_CHECK(hidden.size(1) == H, "LayerStack: o_proj gives ", hidden.size(1), " features, not ", H);
      layer.gate_up = A::call(normed2, w[8], w[9], w[10], bits_, sums[2], gate_up);
      const int64_t I = gate_up.size(1) / 2;
      if (!act.defined()) act = at::empty({M, I}, opts);
      TORCH_CHECK(act.size(1) == I, "LayerStack: every layer's intermediate size like the first's");
      layer.down = A::call(act, w[11], w[12], w[13], bits_, sums[3], down);
      TORCH_CHECK(down.size(1) == H, "LayerStack: down_proj gives ", down.size(1), " features, not ", H);
      work.push_back(layer);
    }
    Shared shared{M, H, B * T_, B * T_ * num_heads_, eps_, A::data(normed), A::data(normed2), A::data(hidden),
                  A::data(down), gate_up, act};
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    std::unique_ptr<TeamBarrier> barrier;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
      barrier = std::make_unique<TeamBarrier>(omp_get_num_threads());
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      for (const Layer& layer : work) run(layer, shared, tid, team, *barrier);
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

  // One layer's phases; every thread of the team calls it (the barriers need them all). The work of
  // each row alone (the norms, the residual adds, the inputs' block sums) is shared by rows: a thread
  // takes the same rows in every phase, so the rows it adds at a layer's end are the ones it
  // normalises at the next one's start, without a barrier between.
  static void run(const Layer& l, const Shared& s, int tid, int team, TeamBarrier& barrier) {
    const int64_t H = s.H, I = s.act.size(1);
    const auto [r0, r1] = share(s.M, tid, team);
    for (int64_t r = r0; r < r1; ++r) A::rms(l.x + r * H, l.in_w, H, s.eps, s.normed + r * H);
    q4_prepare(l.qkv, r0, r1);
    barrier.wait();
    auto [q0, q1] = share(l.qkv.tiles, tid, team);
    q4_tiles(l.qkv, q0, q1);
    barrier.wait();
    auto [w0, w1] = share(s.positions, tid, team);
    l.attn.write(w0, w1);
    barrier.wait();
    auto [a0, a1] = share(s.heads, tid, team);
    l.attn.attend(a0, a1);
    barrier.wait();
    q4_prepare(l.o, r0, r1);
    barrier.wait();
    auto [o0, o1] = share(l.o.tiles, tid, team);
    q4_tiles(l.o, o0, o1);
    barrier.wait();
    for (int64_t i = r0 * H; i < r1 * H; ++i) s.hidden[i] = A::store(A::load(s.hidden[i]) + A::load(l.x[i]));  // o + x
    for (int64_t r = r0; r < r1; ++r) A::rms(s.hidden + r * H, l.post_w, H, s.eps, s.normed2 + r * H);
    q4_prepare(l.gate_up, r0, r1);
    barrier.wait();
    auto [g0, g1] = share(l.gate_up.tiles, tid, team);
    q4_tiles(l.gate_up, g0, g1);
    barrier.wait();
    auto [e0, e1] = share(s.M * I, tid, team);  // silu(gate) * up: each thread its share of the elements
    silu_mul_rows(A::data(s.gate_up), I, e0, e1, A::data(s.act));
    barrier.wait();
    q4_prepare(l.down, r0, r1);
    barrier.wait();
    auto [d0, d1] = share(l.down.tiles, tid, team);
    q4_tiles(l.down, d0, d1);
    barrier.wait();
    for (int64_t i = r0 * H; i < r1 * H; ++i) {
      l.out[i] = A::store(A::load(s.down[i]) + A::load(s.hidden[i]));  // down + hidden
    }
    // No barrier here: the next layer's first phase reads this thread's rows only, and the others
    // wait for it at its end (after the last layer, the parallel region's own end waits).
  }

  std::vector<std::vector<at::Tensor>> layers_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::vector<int64_t> windows_;
  int64_t bits_;  // the projections' inputs rounded to 8 or 16 bits per block (0: as they are; q4_matmul.cpp)
};

LayerStack::LayerStack(std::vector<std::vector<at::Tensor>> layers, double eps, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double scale, std::vector<int64_t> windows, int64_t bits) {
  TORCH_CHECK(!layers.empty() && !layers[0].empty(), "LayerStack: at least one layer");
  if (layers[0][0].scalar_type() == at::kFloat) {
    f32_ = std::make_unique<LayerStackOf<float>>(std::move(layers), eps, num_heads, num_kv_heads, head_dim, scale,
                                                 std::move(windows), bits);
  } else {
    bf16_ = std::make_unique<LayerStackOf<uint16_t>>(std::move(layers), eps, num_heads, num_kv_heads, head_dim,
                                                     scale, std::move(windows), bits);
  }
}

LayerStack::~LayerStack() = default;

at::Tensor LayerStack::forward(const at::Tensor& x, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                               const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                               const at::Tensor& starts, const c10::optional<at::Tensor>& sources,
                               const c10::optional<at::Tensor>& parents) const {
  return f32_ ? f32_->forward(x, k, v, cos_table, sin_table, slots, starts, sources, parents)
              : bf16_->forward(x, k, v, cos_table, sin_table, slots, starts, sources, parents);
}

}  // namespace cpu_ops
