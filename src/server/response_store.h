// The stored responses of the Responses API (responses_api.h): GET /v1/responses/{id},
// DELETE /v1/responses/{id}, and previous_response_id. In memory, per instance, bounded: at most
// `capacity` responses, the least recently used (created, read or continued) evicted first;
// capacity 0 keeps none. A response is seen only by its tenant (the API key that made it:
// tenant_prefix; "" without keys): another key's lookup finds nothing, as an unknown id.
//
// Thread-safe (one mutex; every call is a map lookup and a list splice).
#pragma once
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "server/responses_api.h"

namespace kv {

class ResponseStore {
 public:
  explicit ResponseStore(size_t capacity) : capacity_(capacity) {}

  bool enabled() const { return capacity_ > 0; }
  // Keeps r under id (replacing one there); the least recently used goes when over capacity.
  void put(const std::string& id, std::shared_ptr<const StoredResponse> r);
  // The response if it is there and tenant's; marks it used.
  std::shared_ptr<const StoredResponse> get(const std::string& id, const std::string& tenant);
  // Removes it if it is there and tenant's; false otherwise.
  bool erase(const std::string& id, const std::string& tenant);
  size_t size() const;

 private:
  using Lru = std::list<std::pair<std::string, std::shared_ptr<const StoredResponse>>>;  // most recent first
  const size_t capacity_;
  mutable std::mutex mu_;
  Lru lru_;
  std::unordered_map<std::string, Lru::iterator> index_;
};

}  // namespace kv
