#include "engine/sequence_runner.h"

#include <algorithm>
#include <cstring>

namespace kv {

Status SequenceRunner::reserve(int64_t n_new) {
  const int32_t bs = pool_.layout().block_size;
  const int32_t need = BlockTable::pages_for(table_.n_tokens + n_new, bs) - static_cast<int32_t>(table_.pages.size());
  if (need <= 0) return Status::ok();
  if (!pool_.allocate(need, &table_.pages))
    return Status::error("KV cache full: need " + std::to_string(need) + " more pages, " + std::to_string(pool_.n_free()) +
                         " free (raise --kv-cache-memory or shorten the prompt)");
  return Status::ok();
}

int32_t SequenceRunner::chunk() const {
  // A quantized layer holds one staging slot per page a forward fills, until its attention ran.
  if (pool_.layout().n_staged_layers() == 0) return chunk_;
  return std::max<int32_t>(1, std::min<int32_t>(chunk_, (pool_.n_staging() - 2) * pool_.layout().block_size));
}

Status SequenceRunner::feed(const int32_t* tokens, int64_t n, bool want_logits) {
  if (n <= 0) return Status::ok();
  const int32_t chunk_ = chunk();
  if (Status st = reserve(n); !st) return st;
  logits_.resize(model_.config().n_vocab);
  for (int64_t i = 0; i < n; i += chunk_) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(chunk_, n - i));
    const bool last = i + len == n;
    batch_.clear();
    batch_.add(table_.pages.data(), table_.n_tokens, tokens + i, len, last && want_logits);
    if (Status st = model_.forward(batch_, pool_, tp_, logits_.data()); !st) return st;
    table_.n_tokens += len;
  }
  return Status::ok();
}

Status SequenceRunner::feed_all_logits(const int32_t* tokens, int64_t n, std::vector<float>* out) {
  const int64_t nv = model_.config().n_vocab;
  out->assign(n * nv, 0.f);
  if (Status st = reserve(n); !st) return st;
  const int32_t chunk_ = chunk();
  // One run per token so every position gets logits; runs of the same chunk share a forward.
  for (int64_t i = 0; i < n; i += chunk_) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(chunk_, n - i));
    batch_.clear();
    for (int32_t k = 0; k < len; ++k) batch_.add(table_.pages.data(), table_.n_tokens + k, tokens + i + k, 1, true);
    if (Status st = model_.forward(batch_, pool_, tp_, out->data() + i * nv); !st) return st;
    table_.n_tokens += len;
  }
  return Status::ok();
}

}  // namespace kv
