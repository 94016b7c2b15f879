// The native CPU library's shared declarations: one library built from the .cpp files beside this
// one (kernels/native.py lists them), one file per op, bound to Python in cpu_ops.cpp. Here: the CPU
// feature checks, the block constants, each op's entry point, and the pieces of the 4-bit matmul
// (q4_matmul.cpp) and of attention (attention.cpp) that the decoder-layer stack (layer_stack.cpp) runs
// inside its own parallel region. kernels/int4.py, kernels/int8.py, kernels/verify.py,
// kernels/random.py, specstream/models/attention.py and specstream/models/base.py call the ops, each
// beside its torch reference.
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

#pragma once

// ATen's tensor and the few ops the kernels call, not <torch/extension.h> (pybind11 and torch's whole
// C++ front end): every op's file parses this header, and only cpu_ops.cpp binds to Python.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace cpu_ops {

constexpr int64_t kBlock = 32;
constexpr int kTile = 8;  // rows per pass over a weight row (their accumulators stay in registers)

// The widest vector paths this process may run: SPECSTREAM_CPU_ISA=avx2 keeps an AVX-512 CPU on the
// AVX2 paths (as an AVX2-only CPU runs), =generic on the portable ones; unset or avx512: whatever the
// CPU has. One machine then tests and times every class's paths (kernels/native.py checks the value).
inline int isa_cap() {
  static const int cap = [] {
    const char* value = std::getenv("SPECSTREAM_CPU_ISA");
    if (value != nullptr && std::strcmp(value, "generic") == 0) return 0;
    if (value != nullptr && std::strcmp(value, "avx2") == 0) return 1;
    return 2;
  }();
  return cap;
}

// Which vector paths this CPU runs (each asked once per process).
inline bool has_avx512() {
  static const bool yes = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}

inline bool has_avx512_bf16() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

inline bool has_avx512_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

inline bool has_avx2_fma() {
  static const bool yes = isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

// ---------------------------------------------------------------------------------------------------
// e^x's one recipe, for every width (attention's softmax, the activation of layer_stack.cpp): x = n ln2 + r
// with n = round(x log2 e), r by Cody-Waite (ln 2 in two parts), e^r by its degree-7 Taylor polynomial in
// Horner's form (these coefficients, highest first, after 1/5040), times 2^n.
constexpr float kExpFloor = -87.3f;  // below: e^x underflows to 0 anyway
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpTop = 1.0f / 5040.0f;
constexpr float kExpHorner[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

// e^x for x <= 0 (2^n, n in [-126, 0], is built from its exponent bits) over 8 lanes on AVX2; exp_generic is
// the same operations one value at a time, so the same bits (attention.cpp's exp512: the recipe over 16 lanes).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTop);
  for (float c : kExpHorner) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// e^x over 16 lanes (the recipe above; relative error under 2e-7). A fixed sequence of operations,
// so the same inputs give the same bits wherever they are computed.
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTop);
  for (float c : kExpHorner) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// 16 bfloat16 values (their bits) widened to float32, exactly.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 bf16x16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float exp_generic(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2High, x);
  r = std::fma(-n, kLn2Low, r);
  float p = kExpTop;
  for (float c : kExpHorner) p = std::fma(p, r, c);
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// layer_stack.cpp: silu(gate) * up of float32 rows, element by element (AVX2 where the CPU has it, the same
// bits one value at a time elsewhere): gate_up [M, 2 I] (gate, then up) -> [M, I]; of bfloat16 rows, silu
// rounded to bfloat16 and then its product with up, as torch's two ops round (AVX-512 where the CPU has it).
void silu_mul_f32(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);
at::Tensor silu_mul(const at::Tensor& gate_up);

// ---------------------------------------------------------------------------------------------------
// Each op's entry point (bound to Python in cpu_ops.cpp).

// q8_matmul.cpp: x [M, K] @ Q8_0 codes [N, K] (d [N, K/32]) -> [M, N] float32.
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);

// q8_matmul.cpp: float32 x [M, K] rounded to 16 bits per block of 32, @ the Q8_0 codes of n features in
// the tile layout (kernels/int8.py), multiplied in integers (AVX2) -> [M, n] float32.
at::Tensor q8_matmul_i16(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales, int64_t n);

// q4_matmul.cpp: float32 rows [M, K] rounded to 16 bits per block of 32 (AVX2): codes xq [M, K], scales
// xd [M, K/32], and each block's sum of the rounded inputs xsum [M, K/32]; for the 4-bit and 8-bit kernels.
void quantize_rows_i16(const float* x, int64_t M, int64_t K, float* xsum, float* xd, int16_t* xq);

// q4_matmul.cpp: x [M, K] bfloat16 (float32) @ Q4_1 codes in the native layout -> [M, N] bfloat16 (float32);
// `bits` 8: the inputs rounded to 8 bits per block of 32 (AVX-512 VNNI for bfloat16, AVX2 for float32);
// 16: to 16 bits per block of 32 (float32 on AVX2); 0: the inputs as they are.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                     int64_t bits);

// attention.cpp: RoPE, the cache write and attention over each row's own keys, for one layer.
at::Tensor attention(const at::Tensor& qkv, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos_table,
                     const at::Tensor& sin_table, const at::Tensor& slots, const at::Tensor& starts,
                     const c10::optional<at::Tensor>& sources, const c10::optional<at::Tensor>& parents,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     double scale, int64_t window);

// layer_stack.cpp: RMS norm of bfloat16 or float32 rows [M, H], each row on its own.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);

// layer_stack.cpp: Llama decoder layers in one parallel region per forward.
template <typename E>
class LayerStackOf;

// The stack as Python builds it: its activations' dtype is its norms' (bfloat16 or float32).
class LayerStack {
 public:
  LayerStack(std::vector<std::vector<at::Tensor>> layers, double eps, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double scale, std::vector<int64_t> windows, int64_t bits);
  ~LayerStack();  // where LayerStackOf is complete (layer_stack.cpp)

  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                     const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& slots,
                     const at::Tensor& starts, const c10::optional<at::Tensor>& sources,
                     const c10::optional<at::Tensor>& parents) const;

 private:
  std::unique_ptr<LayerStackOf<float>> f32_;
  std::unique_ptr<LayerStackOf<uint16_t>> bf16_;
};

// greedy_verify.cpp: each row's argmax of CPU float32 logits and the accepted prefix of the proposals.
std::vector<at::Tensor> greedy_verify(const at::Tensor& logits, const at::Tensor& draft, const at::Tensor& num_draft);

// race_candidates.cpp: per row, the one column that can win its exponential race, or the candidates
// where several can.
std::vector<at::Tensor> race_candidates(const at::Tensor& probs, const at::Tensor& keys,
                                        const c10::optional<at::Tensor>& ids);

// ---------------------------------------------------------------------------------------------------
// The 4-bit matmul's calls in pieces (q4_matmul.cpp), for `q4_matmul` and `LayerStack`: the checked
// operands, the rows' preparation (serial), then the output tiles (a thread's share each).

// A call's per-row scratch: each row's sum per block, and for rounded activations its codes and scales.
struct Q4Scratch {
  std::vector<float> xsum, xd;  // [M, K/32]
  std::vector<int8_t> xq;       // [M, K] 8-bit codes, each group of 4 in the order k0, k0 + 2, k0 + 1, k0 + 3
  std::vector<int16_t> xq16;    // [M, K] 16-bit codes, in order
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

// `bits`: 0 or 8 (bfloat16 inputs have no more than 8 bits to round to 16).
Q4Call q4_call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t bits,
               Q4Scratch& scratch, at::Tensor& out);

// One float32 call's operands (`q4_matmul` and `LayerStack`): x [M, K] rows, each row's block sums
// (and for rounded activations their codes and scales), the weight in the native layout, out [M, N].
struct Q4CallF32 {
  const float* x;
  float* xsum;    // [M, K/32]
  float* xd;      // [M, K/32] (rounded activations only)
  int8_t* xq;     // [M, K] (bits 8 only)
  int16_t* xq16;  // [M, K] (bits 16 only)
  int bits;       // 0: the inputs as they are; 8 or 16: rounded to that many bits per block of 32
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
  int64_t M, K, blocks, tiles, N;
  float* out;
};

Q4CallF32 q4_call_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                      int64_t bits, Q4Scratch& scratch, at::Tensor& out);

// Before any tile, rows [r0, r1): each row's sum over each block of 32 inputs (the minimum's term), and for
// rounded activations each block's scale and codes (q4_matmul.cpp says how). Each row on its own.
__attribute__((target("avx512f,avx512bw")))
void q4_prepare(const Q4Call& c, int64_t r0, int64_t r1);
void q4_prepare(const Q4CallF32& c, int64_t r0, int64_t r1);

// Output tiles [begin, end) of 16 features for every row: a thread's share.
void q4_tiles(const Q4Call& c, int64_t begin, int64_t end);
void q4_tiles(const Q4CallF32& c, int64_t begin, int64_t end);

// ---------------------------------------------------------------------------------------------------
// One layer's attention over the cache (attention.cpp, for `attention` and `LayerStack`), in two
// passes a thread team can share: `write` the new keys and values (items: the B T new positions), then
// `attend` (items: every query head at every new position). The second reads what the first wrote:
// all of `write` must finish before `attend` starts.
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

  void write(int64_t begin, int64_t end) const;   // 1. This forward's keys (with RoPE) and values into the cache.
  void attend(int64_t begin, int64_t end) const;  // 2. Every query head over its keys.
};

// Whether the query heads that share a kv head run together (attention.cpp, attend_avx512 and
// attend_avx2: the same bits either way); off only to time the difference (`bench step`).
void set_attention_groups(bool on);
bool attention_groups();

// Instantiated in attention.cpp, for the two activation dtypes.
extern template struct Attention<float>;
extern template struct Attention<at::BFloat16>;

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
                             int64_t head_dim);

}  // namespace cpu_ops
