// One batch-1 decode step of a GPT-2-style gptlab model, in C++: the same PyTorch operations, in
// the same order, on the same tensors as gptlab.GPT.decode with a StaticKVCache and the packed
// layers of gptlab.fast.cpu, called from C++ instead of from Python.
//
// Why: a decode step of a small model is a few hundred small operations; from Python each one
// costs its own trip through the interpreter and PyTorch's argument parsing. Called from here,
// they go straight to PyTorch's dispatcher. Nothing is computed differently: the model, its
// weights, the packed copies and the cache are the ones the Python step uses (gptlab/fast/native.py
// hands them over once per decode), so the logits are the same numbers.

#include <torch/extension.h>

#include <vector>

namespace {

// One linear layer: y = x W^T + b for x (1, in) -> (1, out), as gptlab.fast.cpu computes it.
struct Product {
  int64_t kernel;   // 0: the plain weight (F.linear); packed row blocks (gptlab.fast.cpu.row_blocks)
                    // multiplied by 1: an embedding bag (bag_product), 2: a batched product (batched_product)
  at::Tensor a;     // 0: W (out, in); 1: the blocks as an embedding table (P * in, part); 2: the blocks (P, in, part)
  at::Tensor bias;  // 0: (out,); 1: (P, part); 2: (P, 1, part); undefined: no bias
  at::Tensor indices, offsets;  // 1: one bag per block (gptlab.fast.cpu.RowBlocks)
  int64_t parts, in, out;

  at::Tensor operator()(const at::Tensor& x) const {
    if (kernel == 0) return at::linear(x, a, bias);
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
  }

  // idx (1, 1) int64, the token at position pos (the cache holds positions 0 .. pos - 1)
  // -> next-token logits (1, V); writes the token's keys and values at slot pos.
  at::Tensor step(const at::Tensor& idx, int64_t pos) const {
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

 private:
  int64_t n_layer_, n_head_, head_dim_;
  double eps_;
  at::Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Layer> layers_;
  Product lm_head_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<int64_t>&, double>())
      .def("step", &Decoder::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
