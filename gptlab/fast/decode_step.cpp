// One batch-1 decode step of a GPT-2-style gptlab model, in C++, two ways:
//
// * step_exact: the same PyTorch operations, in the same order, on the same tensors as
//   gptlab.GPT.decode with a StaticKVCache and the packed layers of gptlab.fast.cpu, called from
//   C++ instead of from Python. The logits are the same numbers to the last bit.
// * step_fused: where some weight is multiplied by the product of our own below (matvec_into,
//   chosen per weight shape where a timing on this machine found it faster than at::linear:
//   gptlab.fast.native.products_plan), the whole step runs on buffers made once, with the layer
//   norms, the one query's attention, GELU and the residual adds as loops of our own. The same
//   computation summed in other orders: the logits equal the model's up to float rounding.
//
// Why: a decode step of a small model is a few hundred small operations; from Python each one
// costs its own trip through the interpreter and PyTorch's argument parsing. Called from here,
// they go straight to PyTorch's dispatcher (step_exact), or are no calls at all (step_fused). The
// model, its weights, the packed copies and the cache are the ones the Python step uses
// (gptlab/fast/native.py hands them over once per decode).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// --------------------------------------------------------------------------- one vector's product
//
// y = W x + b for one vector x (in,), W the plain (out, in) weight, float32 all along: four rows at
// a time, each row's dot product in 16 lanes (GCC/clang vector extensions: one AVX-512 register,
// two AVX2 ones, four SSE or NEON ones, whatever the target has), the lanes summed at the end in a
// fixed tree. The rows are split over PyTorch's threads (at::parallel_for); a row is summed by one
// thread, in the same order whatever the split, so the result does not depend on the thread count.
// On x86 with GCC (ELF), the function is compiled three times (AVX-512, AVX2 + FMA, the baseline)
// and the loader picks the one the CPU runs (target_clones); elsewhere it is compiled once for the
// compiler's baseline target (NEON on ARM). No -march=native: a build may be shared between
// machines. The same sums in another order than at::linear's: equal up to float rounding.

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__) && !defined(__clang__)
#define GPTLAB_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define GPTLAB_CLONES
#endif

#define GPTLAB_LOAD16(dst, src) std::memcpy(&(dst), (src), sizeof(v16))

// the 16 lanes' sum, in a fixed order: halves, then halves again
#define GPTLAB_HSUM(out, a)                                                   \
  do {                                                                        \
    v8 lo_, hi_;                                                              \
    std::memcpy(&lo_, &(a), 32), std::memcpy(&hi_, reinterpret_cast<const char*>(&(a)) + 32, 32); \
    v8 s8_ = lo_ + hi_;                                                       \
    v4 l4_, h4_;                                                              \
    std::memcpy(&l4_, &s8_, 16), std::memcpy(&h4_, reinterpret_cast<const char*>(&s8_) + 16, 16); \
    v4 s4_ = l4_ + h4_;                                                       \
    (out) = (s4_[0] + s4_[2]) + (s4_[1] + s4_[3]);                            \
  } while (0)

// rows r0 .. r1 - 1 of y = W x (+ b) (+ y where accumulate)
GPTLAB_CLONES
void rows_product(const float* __restrict w, const float* __restrict x, const float* __restrict b,
                  float* __restrict y, int64_t r0, int64_t r1, int64_t in, bool accumulate) {
  const int64_t vec = in - in % 16;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float* w0 = w + r * in;
    const float* w1 = w0 + in;
    const float* w2 = w1 + in;
    const float* w3 = w2 + in;
    v16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, xv, t;
    for (int64_t i = 0; i < vec; i += 16) {
      GPTLAB_LOAD16(xv, x + i);
      GPTLAB_LOAD16(t, w0 + i), a0 += t * xv;
      GPTLAB_LOAD16(t, w1 + i), a1 += t * xv;
      GPTLAB_LOAD16(t, w2 + i), a2 += t * xv;
      GPTLAB_LOAD16(t, w3 + i), a3 += t * xv;
    }
    float s[4];
    GPTLAB_HSUM(s[0], a0);
    GPTLAB_HSUM(s[1], a1);
    GPTLAB_HSUM(s[2], a2);
    GPTLAB_HSUM(s[3], a3);
    for (int64_t i = vec; i < in; ++i) {
      s[0] += w0[i] * x[i], s[1] += w1[i] * x[i], s[2] += w2[i] * x[i], s[3] += w3[i] * x[i];
    }
    for (int k = 0; k < 4; ++k) {
      float v = b ? b[r + k] + s[k] : s[k];
      y[r + k] = accumulate ? y[r + k] + v : v;
    }
  }
  for (; r < r1; ++r) {  // the last out % 4 rows, one at a time
    const float* w0 = w + r * in;
    v16 a0 = {}, xv, t;
    for (int64_t i = 0; i < vec; i += 16) {
      GPTLAB_LOAD16(xv, x + i);
      GPTLAB_LOAD16(t, w0 + i), a0 += t * xv;
    }
    float s0;
    GPTLAB_HSUM(s0, a0);
    for (int64_t i = vec; i < in; ++i) s0 += w0[i] * x[i];
    float v = b ? b[r] + s0 : s0;
    y[r] = accumulate ? y[r] + v : v;
  }
}

// y (out,) = W x + b (accumulate: y += W x + b), the rows split over the threads in blocks of 4
// rows, at least about 16K weights (64 KB) per task.
void matvec_into(const float* w, const float* x, const float* b, float* y, int64_t out, int64_t in,
                 bool accumulate) {
  const int64_t blocks = (out + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, 4 * in));
  at::parallel_for(0, blocks, grain, [&](int64_t s, int64_t e) {
    rows_product(w, x, b, y, s * 4, std::min(out, e * 4), in, accumulate);
  });
}

// Y (n, out) = X W^T + b for n vectors X (n, in): each vector's product as matvec_into computes it
// (the same sums, the same bits), a task's block of rows multiplied by every vector while the
// block is in the core's cache (a short chunk of tokens: speculative decoding's verification).
void matmat_into(const float* w, const float* x, const float* b, float* y, int64_t n, int64_t out, int64_t in) {
  const int64_t blocks = (out + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, 4 * in));
  at::parallel_for(0, blocks, grain, [&](int64_t s, int64_t e) {
    for (int64_t r0 = s * 4; r0 < std::min(out, e * 4); r0 += 16) {  // 16 rows (24 KB at in = 384) at a time
      const int64_t r1 = std::min({out, e * 4, r0 + 16});
      for (int64_t j = 0; j < n; ++j) rows_product(w, x + j * in, b, y + j * out, r0, r1, in, false);
    }
  });
}

// --------------------------------------------------------------------------- the rest of a fused step

// out = (x - mean) / sqrt(var + eps) * w (+ b) over C numbers, the mean and variance summed in 16 lanes
GPTLAB_CLONES
void layer_norm_into(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                     float* __restrict out, int64_t C, float eps) {
  const int64_t vec = C - C % 16;
  v16 acc = {}, t;
  for (int64_t i = 0; i < vec; i += 16) GPTLAB_LOAD16(t, x + i), acc += t;
  float sum;
  GPTLAB_HSUM(sum, acc);
  for (int64_t i = vec; i < C; ++i) sum += x[i];
  const float mean = sum / C;
  v16 sq = {};
  for (int64_t i = 0; i < vec; i += 16) GPTLAB_LOAD16(t, x + i), t -= mean, sq += t * t;
  float ss;
  GPTLAB_HSUM(ss, sq);
  for (int64_t i = vec; i < C; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(ss / C + eps);
  for (int64_t i = 0; i < C; ++i) out[i] = (x[i] - mean) * rstd * w[i] + (b ? b[i] : 0.0f);
}

typedef int32_t i16v __attribute__((vector_size(64)));

// e^x in 16 lanes (x <= 0 here: scores minus their maximum), Cephes' expf polynomial: within a few
// ulp of std::exp
#define GPTLAB_EXP16(y, x_)                                                                       \
  do {                                                                                            \
    v16 x_e = (x_);                                                                                 \
    const v16 lowest_ = (v16{}) - 87.0f;                                                          \
    x_e = x_e < lowest_ ? lowest_ : x_e;                                                                \
    v16 fx_ = x_e * 1.44269504088896341f + 0.5f;                                                     \
    v16 n_ = __builtin_convertvector(__builtin_convertvector(fx_, i16v), v16);                       \
    n_ = n_ > fx_ ? n_ - 1.0f : n_;                                                                    \
    v16 r_ = x_e - n_ * 0.693359375f + n_ * 2.12194440e-4f;                                            \
    v16 p_ = 1.9875691500E-4f * r_ + 1.3981999507E-3f;                                              \
    p_ = p_ * r_ + 8.3334519073E-3f, p_ = p_ * r_ + 4.1665795894E-2f, p_ = p_ * r_ + 1.6666665459E-1f;      \
    p_ = p_ * r_ + 5.0000001201E-1f, p_ = p_ * r_ * r_ + r_ + 1.0f;                                       \
    i16v e_ = (__builtin_convertvector(n_, i16v) + 127) << 23;                                      \
    v16 two_n_;                                                                                    \
    std::memcpy(&two_n_, &e_, sizeof(v16));                                                         \
    (y) = p_ * two_n_;                                                                              \
  } while (0)

// One head's attention of one query over n cached positions: out (hd) = softmax(q.K^T * scale) V.
// p: n rounded up to 16 floats of scratch. Four keys at a time for the scores, and the weighted sum
// of the values 64 dimensions at a time (four independent sums in flight).
GPTLAB_CLONES
void head_attention(const float* __restrict q, const float* __restrict K, const float* __restrict V, int64_t n,
                    int64_t hd, float scale, float* __restrict p, float* __restrict out) {
  const int64_t vec = hd - hd % 16;
  float mx = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* k0 = K + j * hd;
    v16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, qv, t;
    for (int64_t i = 0; i < vec; i += 16) {
      GPTLAB_LOAD16(qv, q + i);
      GPTLAB_LOAD16(t, k0 + i), a0 += qv * t;
      GPTLAB_LOAD16(t, k0 + hd + i), a1 += qv * t;
      GPTLAB_LOAD16(t, k0 + 2 * hd + i), a2 += qv * t;
      GPTLAB_LOAD16(t, k0 + 3 * hd + i), a3 += qv * t;
    }
    float d[4];
    GPTLAB_HSUM(d[0], a0);
    GPTLAB_HSUM(d[1], a1);
    GPTLAB_HSUM(d[2], a2);
    GPTLAB_HSUM(d[3], a3);
    for (int k = 0; k < 4; ++k) {
      for (int64_t i = vec; i < hd; ++i) d[k] += q[i] * k0[k * hd + i];
      p[j + k] = d[k] * scale;
      mx = p[j + k] > mx ? p[j + k] : mx;
    }
  }
  for (; j < n; ++j) {
    const float* k0 = K + j * hd;
    v16 a0 = {}, qv, t;
    for (int64_t i = 0; i < vec; i += 16) GPTLAB_LOAD16(qv, q + i), GPTLAB_LOAD16(t, k0 + i), a0 += qv * t;
    float d;
    GPTLAB_HSUM(d, a0);
    for (int64_t i = vec; i < hd; ++i) d += q[i] * k0[i];
    p[j] = d * scale;
    mx = p[j] > mx ? p[j] : mx;
  }
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t jj = n; jj < padded; ++jj) p[jj] = -INFINITY;
  const v16 zero = {};
  v16 total = {};
  for (int64_t jj = 0; jj < padded; jj += 16) {
    v16 t, e;
    GPTLAB_LOAD16(t, p + jj);
    GPTLAB_EXP16(e, t - mx);
    e = t == -INFINITY ? zero : e;
    std::memcpy(p + jj, &e, sizeof(v16)), total += e;
  }
  float sum;
  GPTLAB_HSUM(sum, total);
  const float inv = 1.0f / sum;
  int64_t i = 0;
  for (; i + 64 <= vec; i += 64) {
    v16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, t;
    for (int64_t jj = 0; jj < n; ++jj) {
      const float* v = V + jj * hd + i;
      const float w = p[jj];
      GPTLAB_LOAD16(t, v), a0 += w * t;
      GPTLAB_LOAD16(t, v + 16), a1 += w * t;
      GPTLAB_LOAD16(t, v + 32), a2 += w * t;
      GPTLAB_LOAD16(t, v + 48), a3 += w * t;
    }
    a0 *= inv, a1 *= inv, a2 *= inv, a3 *= inv;
    std::memcpy(out + i, &a0, sizeof(v16)), std::memcpy(out + i + 16, &a1, sizeof(v16));
    std::memcpy(out + i + 32, &a2, sizeof(v16)), std::memcpy(out + i + 48, &a3, sizeof(v16));
  }
  for (; i < vec; i += 16) {
    v16 acc = {}, t;
    for (int64_t jj = 0; jj < n; ++jj) GPTLAB_LOAD16(t, V + jj * hd + i), acc += p[jj] * t;
    acc *= inv;
    std::memcpy(out + i, &acc, sizeof(v16));
  }
  for (; i < hd; ++i) {
    float acc = 0;
    for (int64_t jj = 0; jj < n; ++jj) acc += p[jj] * V[jj * hd + i];
    out[i] = acc * inv;
  }
}

// GELU with the tanh approximation, in place: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// tanh(u) = 1 - 2 / (1 + e^(2u)) (e^(2u) clamped below overflow), 16 lanes at a time
GPTLAB_CLONES
void gelu_tanh_inplace(float* __restrict x, int64_t n) {
  const int64_t vec = n - n % 16;
  const v16 highest = (v16{}) + 88.0f;
  for (int64_t i = 0; i < vec; i += 16) {
    v16 t, e;
    GPTLAB_LOAD16(t, x + i);
    v16 u2 = 1.5957691216057308f * (t + 0.044715f * t * t * t);  // 2u
    u2 = u2 > highest ? highest : u2;
    GPTLAB_EXP16(e, u2);
    v16 g = 0.5f * t * (2.0f - 2.0f / (1.0f + e));
    std::memcpy(x + i, &g, sizeof(v16));
  }
  for (int64_t i = vec; i < n; ++i) {
    const float t = x[i];
    x[i] = 0.5f * t * (1.0f + std::tanh(0.7978845608028654f * (t + 0.044715f * t * t * t)));
  }
}

// The product as a PyTorch function (the chunks of LlamaPythonDecoder, tests, calibration): W (out, in)
// float32 contiguous, x (..., in) float32 holding n >= 1 vectors (made contiguous), b (out,) or empty
// -> y (..., out); each vector's product is the one matvec_into computes for it alone.
at::Tensor matvec(const at::Tensor& W, const at::Tensor& x, const at::Tensor& b) {
  TORCH_CHECK(W.dim() == 2 && W.scalar_type() == at::kFloat && W.is_contiguous() && W.device().is_cpu(),
              "matvec: W must be a contiguous float32 (out, in) CPU tensor");
  const int64_t out = W.size(0), in = W.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == in && x.numel() >= in,
              "matvec: x must hold float32 vectors of in = ", in, " features (..., ", in, ")");
  TORCH_CHECK(!b.numel() || (b.dim() == 1 && b.size(0) == out && b.scalar_type() == at::kFloat && b.is_contiguous()),
              "matvec: b must be empty or a contiguous float32 (out,) tensor");
  at::Tensor xc = x.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = out;
  at::Tensor y = at::empty(shape, W.options());
  const int64_t n = x.numel() / in;
  const float* bias = b.numel() ? b.data_ptr<float>() : nullptr;
  if (n == 1) {
    matvec_into(W.data_ptr<float>(), xc.data_ptr<float>(), bias, y.data_ptr<float>(), out, in, false);
  } else {
    matmat_into(W.data_ptr<float>(), xc.data_ptr<float>(), bias, y.data_ptr<float>(), n, out, in);
  }
  return y;
}

// Nanoseconds of each layer's product of one vector, in the given order (the weights stream as in a
// decode step): own = true the kernel above, false at::linear. The calibration (gptlab.fast.native)
// alternates the two, round after round.
std::vector<int64_t> time_products(const std::vector<at::Tensor>& Ws, const std::vector<at::Tensor>& bs,
                                   const std::vector<at::Tensor>& xs, bool own) {
  std::vector<int64_t> ns(Ws.size());
  std::vector<at::Tensor> ys;
  for (const auto& W : Ws) ys.push_back(at::empty({W.size(0)}, W.options()));
  for (size_t j = 0; j < Ws.size(); ++j) {
    auto t0 = std::chrono::steady_clock::now();
    if (own) {
      matvec_into(Ws[j].data_ptr<float>(), xs[j].data_ptr<float>(), bs[j].numel() ? bs[j].data_ptr<float>() : nullptr,
                  ys[j].data_ptr<float>(), Ws[j].size(0), Ws[j].size(1), false);
    } else {
      at::linear(xs[j].view({1, -1}), Ws[j], bs[j].numel() ? bs[j] : at::Tensor());
    }
    ns[j] = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  return ns;
}

// One linear layer: y = x W^T + b for x (1, in) -> (1, out), as gptlab.fast.cpu computes it.
struct Product {
  int64_t kernel;   // 0: the plain weight (F.linear); packed row blocks (gptlab.fast.cpu.row_blocks)
                    // multiplied by 1: an embedding bag (bag_product), 2: a batched product (batched_product);
                    // 3: the plain weight by the own product above (matvec_into)
  at::Tensor a;     // 0, 3: W (out, in); 1: the blocks as an embedding table (P * in, part); 2: the blocks (P, in, part)
  at::Tensor bias;  // 0: (out,); 1: (P, part); 2: (P, 1, part); undefined: no bias
  at::Tensor indices, offsets;  // 1: one bag per block (gptlab.fast.cpu.RowBlocks)
  int64_t parts, in, out;

  // The product of x (1, in) written into y (1, out) (accumulate: added to y), y contiguous.
  void into(const at::Tensor& x, const at::Tensor& y, bool accumulate) const {
    if (kernel == 3) {
      matvec_into(a.data_ptr<float>(), x.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), out, in, accumulate);
    } else if (accumulate) {
      y.add_((*this)(x));
    } else {
      y.copy_((*this)(x));
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (kernel == 0) return at::linear(x, a, bias);
    if (kernel == 3) {
      at::Tensor y = at::empty({1, out}, a.options());
      into(x.contiguous(), y, false);
      return y;
    }
    at::Tensor y;
    if (kernel == 1) {  // x once per block as the bag's weights: (P, part)
      std::vector<at::Tensor> copies(parts, x.reshape({in}));
      y = std::get<0>(at::embedding_bag(a, indices, offsets, false, 0, false, at::cat(copies)));
      if (bias.defined()) y = y.view({1, parts, y.size(1)}).add_(bias);
      y = y.view({1, -1});
    } else {  // x against every block at once: (P, 1, part)
      at::Tensor x2 = x.reshape({1, 1, in}).expand({parts, 1, in});
      y = bias.defined() ? at::baddbmm(bias, x2, a) : at::bmm(x2, a);
      y = y.transpose(0, 1).reshape({1, -1});
    }
    return y.size(1) == out ? y : y.narrow(-1, 0, out);
  }
};

struct Layer {
  at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // ln biases undefined where the model has none
  Product attn, attn_proj, fc, mlp_proj;
  at::Tensor k, v;  // this layer's cache (1, n_head, max_len, head_dim), written in place
};

at::Tensor optional(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }

class Decoder {
 public:
  // tensors: wte, wpe, ln_f weight, ln_f bias, the cache's k and v (n_layer, 1, nh, max_len, hd),
  // then per layer ln_1 weight, ln_1 bias, ln_2 weight, ln_2 bias, and per linear layer (the
  // layers' four, then lm_head) four tensors: a, bias, indices, offsets; an empty tensor stands for
  // none. n: n_layer, n_head, head_dim, then per linear layer its kernel (see Product), parts, in, out.
  // eps: the layer norms' epsilon.
  Decoder(const std::vector<at::Tensor>& t, const std::vector<int64_t>& n, double eps)
      : n_layer_(n[0]), n_head_(n[1]), head_dim_(n[2]), eps_(eps) {
    wte_ = t[0], wpe_ = t[1], lnf_w_ = t[2], lnf_b_ = optional(t[3]);
    at::Tensor k = t[4], v = t[5];
    size_t ti = 6, ni = 3;
    auto product = [&]() {
      Product p{n[ni], t[ti], optional(t[ti + 1]), t[ti + 2], t[ti + 3], n[ni + 1], n[ni + 2], n[ni + 3]};
      ti += 4, ni += 4;
      return p;
    };
    for (int64_t l = 0; l < n_layer_; ++l) {
      Layer L;
      L.ln1_w = t[ti], L.ln1_b = optional(t[ti + 1]), L.ln2_w = t[ti + 2], L.ln2_b = optional(t[ti + 3]);
      ti += 4;
      L.attn = product(), L.attn_proj = product(), L.fc = product(), L.mlp_proj = product();
      L.k = k.select(0, l), L.v = v.select(0, l);
      layers_.push_back(L);
    }
    lm_head_ = product();
    // the fused step (step_fused) runs where some product is the own one (the logits then differ from
    // the Python step's in the last bits anyway) and the cache is laid out as StaticKVCache makes it
    bool own = lm_head_.kernel == 3;
    for (const Layer& L : layers_) own = own || L.attn.kernel == 3 || L.attn_proj.kernel == 3 || L.fc.kernel == 3 || L.mlp_proj.kernel == 3;
    fused_ = own && k.is_contiguous() && v.is_contiguous() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
             wte_.is_contiguous() && wpe_.is_contiguous();
    if (fused_) {
      const int64_t C = n_head_ * head_dim_;
      max_len_ = k.size(3);
      auto o = wte_.options();
      x_ = at::zeros({1, C}, o), h_ = at::zeros({1, C}, o), y_ = at::zeros({1, C}, o);
      qkv_ = at::zeros({1, 3 * C}, o), f_ = at::zeros({1, layers_.empty() ? C : layers_[0].fc.out}, o);
      scores_ = at::zeros({n_head_, (max_len_ + 15) / 16 * 16}, o);
      for (const Layer& L : layers_) {
        for (const at::Tensor* w : {&L.ln1_w, &L.ln1_b, &L.ln2_w, &L.ln2_b})
          if (w->defined() && !w->is_contiguous()) fused_ = false;
        if (L.fc.out != f_.size(1) || L.attn.out != 3 * C) fused_ = false;
      }
    }
  }

  bool fused() const { return fused_; }

  // idx (1, 1) int64, the token at position pos (the cache holds positions 0 .. pos - 1)
  // -> next-token logits (1, V); writes the token's keys and values at slot pos.
  at::Tensor step(const at::Tensor& idx, int64_t pos) const {
    return fused_ ? step_fused(idx, pos) : step_exact(idx, pos);
  }

  // The step as PyTorch's operations, the Python step's twin: the same logits to the last bit.
  at::Tensor step_exact(const at::Tensor& idx, int64_t pos) const {
    const int64_t C = n_head_ * head_dim_;
    at::Tensor x = at::embedding(wte_, idx).view({1, C}) + wpe_.narrow(0, pos, 1);
    for (const Layer& L : layers_) {
      at::Tensor h = at::layer_norm(x, {C}, L.ln1_w, L.ln1_b, eps_);
      auto qkv = L.attn(h).view({1, 3, n_head_, 1, head_dim_}).unbind(1);  // q, k, v (1, nh, 1, hd)
      L.k.narrow(2, pos, 1).copy_(qkv[1]);
      L.v.narrow(2, pos, 1).copy_(qkv[2]);
      at::Tensor y = at::scaled_dot_product_attention(qkv[0], L.k.narrow(2, 0, pos + 1), L.v.narrow(2, 0, pos + 1));
      x = x + L.attn_proj(y.reshape({1, C}));
      h = at::layer_norm(x, {C}, L.ln2_w, L.ln2_b, eps_);
      x = x + L.mlp_proj(at::gelu(L.fc(h), "tanh"));
    }
    return lm_head_(at::layer_norm(x, {C}, lnf_w_, lnf_b_, eps_));
  }

  // The same step on buffers made once: the layer norms, the one query's attention (one head per
  // thread), GELU in place and the residual adds (folded into the products) as loops of our own, the
  // products by the own kernel where chosen (else PyTorch's, written into the buffers). The same computation summed in other orders: the
  // logits equal the Python step's up to float rounding.
  at::Tensor step_fused(const at::Tensor& idx, int64_t pos) const {
    const int64_t C = n_head_ * head_dim_, hd = head_dim_;
    const int64_t token = idx.item<int64_t>();
    TORCH_CHECK(pos >= 0 && pos < max_len_, "position ", pos, " outside the cache");
    TORCH_CHECK(token >= 0 && token < wte_.size(0), "token ", token, " outside the vocabulary");
    float* x = x_.data_ptr<float>();
    float* h = h_.data_ptr<float>();
    float* qkv = qkv_.data_ptr<float>();
    float* y = y_.data_ptr<float>();
    const float* te = wte_.data_ptr<float>() + token * C;
    const float* pe = wpe_.data_ptr<float>() + pos * C;
    for (int64_t i = 0; i < C; ++i) x[i] = te[i] + pe[i];
    const float eps = static_cast<float>(eps_), scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t n = pos + 1, stride = scores_.size(1);
    for (const Layer& L : layers_) {
      layer_norm_into(x, L.ln1_w.data_ptr<float>(), L.ln1_b.defined() ? L.ln1_b.data_ptr<float>() : nullptr, h, C, eps);
      L.attn.into(h_, qkv_, false);
      float* K = L.k.data_ptr<float>();
      float* V = L.v.data_ptr<float>();
      for (int64_t hh = 0; hh < n_head_; ++hh) {  // the token's keys and values into slot pos
        std::memcpy(K + (hh * max_len_ + pos) * hd, qkv + C + hh * hd, hd * sizeof(float));
        std::memcpy(V + (hh * max_len_ + pos) * hd, qkv + 2 * C + hh * hd, hd * sizeof(float));
      }
      float* scores = scores_.data_ptr<float>();
      // one head per task; a short cache's heads on one thread (waking the others costs more)
      at::parallel_for(0, n_head_, n < 32 ? n_head_ : 1, [&](int64_t s, int64_t e) {
        for (int64_t hh = s; hh < e; ++hh)
          head_attention(qkv + hh * hd, K + hh * max_len_ * hd, V + hh * max_len_ * hd, n, hd, scale,
                         scores + hh * stride, y + hh * hd);
      });
      L.attn_proj.into(y_, x_, true);
      layer_norm_into(x, L.ln2_w.data_ptr<float>(), L.ln2_b.defined() ? L.ln2_b.data_ptr<float>() : nullptr, h, C, eps);
      L.fc.into(h_, f_, false);
      gelu_tanh_inplace(f_.data_ptr<float>(), f_.size(1));
      L.mlp_proj.into(f_, x_, true);
    }
    layer_norm_into(x, lnf_w_.data_ptr<float>(), lnf_b_.defined() ? lnf_b_.data_ptr<float>() : nullptr, h, C, eps);
    at::Tensor logits = at::empty({1, lm_head_.out}, wte_.options());
    lm_head_.into(h_, logits, false);
    return logits;
  }

 private:
  int64_t n_layer_, n_head_, head_dim_;
  double eps_;
  at::Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Layer> layers_;
  Product lm_head_;
  bool fused_ = false;
  int64_t max_len_ = 0;
  mutable at::Tensor x_, h_, y_, qkv_, f_, scores_;  // the fused step's buffers, written by every step
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matvec", &matvec, "x W^T + b for float32 vectors x (..., in), the decode step's own product");
  m.def("time_products", &time_products, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, double>())
      .def("step", &Decoder::step, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("fused", &Decoder::fused);
}
