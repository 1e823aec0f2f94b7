#include "engine/request.h"

namespace kv {

const char* cancel_reason_name(CancelReason r) {
  switch (r) {
    case CancelReason::kClient: return "client";
    case CancelReason::kTimeout: return "timeout";
    case CancelReason::kShutdown: return "shutdown";
    case CancelReason::kError: return "error";
    default: return "none";
  }
}

void StreamWaiter::wait(std::vector<uint64_t>* ready, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, timeout, [&] { return !ready_.empty(); });
  ready->insert(ready->end(), ready_.begin(), ready_.end());
  ready_.clear();
}

void StreamWaiter::notify(uint64_t key) {
  {
    std::lock_guard<std::mutex> l(mu_);
    ready_.push_back(key);
  }
  cv_.notify_all();
}

void RequestStream::push(StreamEvent ev) {
  {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_all();
  if (waiter_) waiter_->notify(waiter_key_);
}

void RequestStream::finish_all(const Usage& usage) {
  {
    std::lock_guard<std::mutex> l(mu_);
    usage_ = usage;
    done_ = true;
  }
  cv_.notify_all();
  if (waiter_) waiter_->notify(waiter_key_);
}

bool RequestStream::pop(std::vector<StreamEvent>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, timeout, [&] { return !events_.empty() || done_; });
  while (!events_.empty()) {
    out->push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return !done_;
}

bool RequestStream::done() const {
  std::lock_guard<std::mutex> l(mu_);
  return done_ && events_.empty();
}

Usage RequestStream::usage() const {
  std::lock_guard<std::mutex> l(mu_);
  return usage_;
}

}  // namespace kv
