#include "server/response_store.h"

#include "server/api_error.h"

namespace kv {

namespace {

// What a stored response holds, as the JSON it is made of.
size_t json_bytes(const StoredResponse& r) {
  size_t n = dump_json(r.response).size() + r.tenant.size() + r.cache_salt.size();
  for (const auto& item : r.conversation) n += dump_json(item).size();  // dump_json: a token's half character does not throw
  return n;
}

}  // namespace

void ResponseStore::drop(Lru::iterator it) {
  bytes_ -= it->bytes;
  index_.erase(it->id);
  lru_.erase(it);
}

bool ResponseStore::put(const std::string& id, std::shared_ptr<const StoredResponse> r) {
  if (capacity_ == 0) return false;
  const size_t n = json_bytes(*r);  // outside the lock: a long conversation takes a while
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = index_.find(id); it != index_.end()) drop(it->second);
  if (n > max_bytes_) return false;
  lru_.push_front({id, std::move(r), n});
  index_[id] = lru_.begin();
  bytes_ += n;
  while (lru_.size() > capacity_ || bytes_ > max_bytes_) drop(std::prev(lru_.end()));
  return true;
}

std::shared_ptr<const StoredResponse> ResponseStore::get(const std::string& id, const std::string& tenant) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second->r->tenant != tenant) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->r;
}

bool ResponseStore::erase(const std::string& id, const std::string& tenant) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second->r->tenant != tenant) return false;
  drop(it->second);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> l(mu_);
  return lru_.size();
}

size_t ResponseStore::bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_;
}

}  // namespace kv
