#include "server/response_store.h"

namespace kv {

void ResponseStore::put(const std::string& id, std::shared_ptr<const StoredResponse> r) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = index_.find(id); it != index_.end()) {
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.emplace_front(id, std::move(r));
  index_[id] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

std::shared_ptr<const StoredResponse> ResponseStore::get(const std::string& id, const std::string& tenant) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second->second->tenant != tenant) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

bool ResponseStore::erase(const std::string& id, const std::string& tenant) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second->second->tenant != tenant) return false;
  lru_.erase(it->second);
  index_.erase(it);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> l(mu_);
  return lru_.size();
}

}  // namespace kv
