// The stored responses of the Responses API (responses_api.h): GET /v1/responses/{id},
// DELETE /v1/responses/{id}, and previous_response_id. In memory, per instance, bounded: at most
// `capacity` responses and `max_bytes` of their JSON (each keeps its whole conversation, so a
// long previous_response_id chain grows as the square of its turns), the least recently used
// (created, read or continued) evicted first; capacity 0 keeps none. A response larger than
// max_bytes alone is not kept (a later GET is a 404, as for an evicted one). A response is seen only by its tenant (the API key that made it:
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
  ResponseStore(size_t capacity, size_t max_bytes) : capacity_(capacity), max_bytes_(max_bytes) {}

  bool enabled() const { return capacity_ > 0; }
  // Keeps r under id (replacing one there); the least recently used goes when over capacity.
  // False when it is not kept (the store keeps none, or r alone is over max_bytes).
  bool put(const std::string& id, std::shared_ptr<const StoredResponse> r);
  // The response if it is there and tenant's; marks it used.
  std::shared_ptr<const StoredResponse> get(const std::string& id, const std::string& tenant);
  // Removes it if it is there and tenant's; false otherwise.
  bool erase(const std::string& id, const std::string& tenant);
  size_t size() const;
  size_t bytes() const;  // the JSON sizes of what is kept

 private:
  struct Entry {
    std::string id;
    std::shared_ptr<const StoredResponse> r;
    size_t bytes;
  };
  using Lru = std::list<Entry>;  // most recent first
  void drop(Lru::iterator it);   // with mu_ held
  const size_t capacity_;
  const size_t max_bytes_;
  mutable std::mutex mu_;
  Lru lru_;
  size_t bytes_ = 0;
  std::unordered_map<std::string, Lru::iterator> index_;
};

}  // namespace kv
