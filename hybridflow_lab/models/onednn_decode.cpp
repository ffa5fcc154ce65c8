// One decoding step of a Qwen2/Llama/Qwen3/Mistral DecoderLM on the CPU, float32, over oneDNN's pre-packed weights
// (hybridflow_lab/models/onednn_decode.py builds it and packs the weights). The same computation as
// DecoderLM.forward with a KV cache and one new token per row.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <vector>

using at::Tensor;

namespace {

constexpr int64_t kPerLayer = 12;  // weights per layer, in the order onednn_decode.py packs them

Tensor linear(const Tensor& x, const Tensor& packed, const Tensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  const std::optional<Tensor> b = bias.numel() ? std::optional<Tensor>(bias) : std::nullopt;  // empty: no bias
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x * rsqrt(mean(x^2) + eps) * weight over each row of a contiguous [rows, hidden] x.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t row = 0; row < rows; ++row) {
    const float* in = xp + row * hidden;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += in[i] * in[i];
    const float scale = 1.f / std::sqrt(squares / hidden + static_cast<float>(eps));
    float* o = op + row * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = in[i] * scale * wp[i];
  }
  return out;
}

// Qwen3's RMS norm over each query head (weight q) and each key head (weight k) of qkv [rows, (heads + 2 kv_heads) *
// dim], in place, before the rotary embedding.
void head_norms(const Tensor& qkv, const Tensor& q, const Tensor& k, int64_t heads, int64_t kv_heads, int64_t dim,
                double eps) {
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  float* xp = qkv.data_ptr<float>();
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      float* x = xp + row * width + head * dim;
      const float* w = (head < heads ? q : k).data_ptr<float>();
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += x[i] * x[i];
      const float scale = 1.f / std::sqrt(squares / dim + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) x[i] = x[i] * scale * w[i];
    }
  }
}

// Rotates the query and key heads of each row of qkv [rows, (heads + 2 kv_heads) * dim] in place (rotary position
// embedding: the two halves of a head turned by each row's angles, cos and sin [rows, dim / 2]), and writes the keys
// and values at `slot` of this layer's cache [rows, kv_heads, slots, dim].
void rotate_and_cache(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t heads, int64_t kv_heads,
                      const Tensor& keys, const Tensor& values, int64_t slot) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = keys.size(3), half = dim / 2, slots = keys.size(2);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (int64_t row = 0; row < rows; ++row) {
    const float* c = cp + row * half;
    const float* s = sp + row * half;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      float* x = qp + row * width + head * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float first = x[i], second = x[i + half];
        x[i] = first * c[i] - second * s[i];
        x[i + half] = second * c[i] + first * s[i];
      }
    }
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const int64_t at = ((row * kv_heads + kv) * slots + slot) * dim;
      const float* k = qp + row * width + (heads + kv) * dim;
      std::copy(k, k + dim, kp + at);
      std::copy(k + kv_heads * dim, k + (kv_heads + 1) * dim, vp + at);
    }
  }
}

// Attention of each row's query heads (the first `heads` of qkv's row) over the first `length` slots of one layer's
// cache [rows, kv_heads, slots, dim], the slots `valid` [rows, slots] marks: plain loops, as the per-call cost of
// batched matmuls over such small matrices is most of their time.
Tensor attend(const Tensor& qkv, int64_t heads, const Tensor& keys, const Tensor& values, const Tensor& valid,
              int64_t length) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = keys.size(3);
  const int64_t kv_heads = keys.size(1), slots = keys.size(2), group = heads / kv_heads;
  Tensor out = at::empty({rows, heads * dim}, qkv.options());
  const float* qp = qkv.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const bool* mp = valid.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  std::vector<float> weight(length);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t kv = head / group;
      const float* query = qp + row * width + head * dim;
      const float* key = kp + (row * kv_heads + kv) * slots * dim;
      const float* value = vp + (row * kv_heads + kv) * slots * dim;
      const bool* real = mp + row * slots;
      float top = -INFINITY;
      for (int64_t j = 0; j < length; ++j) {
        if (!real[j]) continue;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[j * dim + d];
        weight[j] = dot * scale;
        top = std::max(top, weight[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < length; ++j) {
        weight[j] = real[j] ? std::exp(weight[j] - top) : 0.f;
        total += weight[j];
      }
      float* o = op + (row * heads + head) * dim;
      std::fill(o, o + dim, 0.f);
      for (int64_t j = 0; j < length; ++j) {
        if (weight[j] == 0.f) continue;
        const float w = weight[j] / total;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] += w * value[j * dim + d];
      }
    }
  }
  return out;
}

}  // namespace

// Next-token logits [rows, vocab] for `tokens` [rows] at `positions` [rows, 1], writing their keys and values at
// `slot` of each layer's cache. weights: per layer (input norm, q|k|v, its bias, o, its bias, post-attention norm,
// gate|up, its bias, down, its bias, query-head norm, key-head norm), then (final norm, head); an empty bias or
// head norm is none.
Tensor decode_step(const Tensor& tokens, const Tensor& positions, const Tensor& embed, const Tensor& inv_freq,
                   double rope_scaling, const std::vector<Tensor>& weights, const std::vector<Tensor>& keys,
                   const std::vector<Tensor>& values, int64_t slot, const Tensor& valid, int64_t heads,
                   int64_t kv_heads, int64_t intermediate, double eps) {
  const int64_t rows = tokens.size(0);
  TORCH_CHECK(weights.size() == keys.size() * kPerLayer + 2, "expected ", kPerLayer, " weights per layer and 2 more");
  TORCH_CHECK(valid.is_contiguous() && valid.dim() == 2, "valid must be a contiguous [rows, slots] mask");
  const Tensor angles = positions.to(at::kFloat).view({rows, 1}) * inv_freq;
  const Tensor cos = (angles.cos() * rope_scaling).contiguous(), sin = (angles.sin() * rope_scaling).contiguous();
  Tensor x = at::embedding(embed, tokens);
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    TORCH_CHECK(keys[layer].is_contiguous() && values[layer].is_contiguous(), "the cache must be contiguous");
    const Tensor* w = &weights[layer * kPerLayer];
    const Tensor qkv = linear(rms_norm(x, w[0], eps), w[1], w[2]);
    if (w[10].numel()) head_norms(qkv, w[10], w[11], heads, kv_heads, keys[layer].size(3), eps);
    rotate_and_cache(qkv, cos, sin, heads, kv_heads, keys[layer], values[layer], slot);
    x = x + linear(attend(qkv, heads, keys[layer], values[layer], valid, slot + 1), w[3], w[4]);
    const Tensor gate_up = linear(rms_norm(x, w[5], eps), w[6], w[7]);
    x = x + linear(at::silu(gate_up.narrow(1, 0, intermediate)) * gate_up.narrow(1, intermediate, intermediate),
                   w[8], w[9]);
  }
  const Tensor* last = &weights[keys.size() * kPerLayer];
  return linear(rms_norm(x, last[0], eps), last[1], Tensor());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_step", &decode_step); }
