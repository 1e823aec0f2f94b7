#include "engine/request.h"

namespace kv {

uint64_t StreamWaiter::version() const {
  std::lock_guard<std::mutex> l(mu_);
  return version_;
}

uint64_t StreamWaiter::wait(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, timeout, [&] { return version_ != seen; });
  return version_;
}

void StreamWaiter::notify() {
  {
    std::lock_guard<std::mutex> l(mu_);
    ++version_;
  }
  cv_.notify_all();
}

void RequestStream::push(StreamEvent ev) {
  {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_all();
  if (waiter_) waiter_->notify();
}

void RequestStream::finish_all(const Usage& usage) {
  {
    std::lock_guard<std::mutex> l(mu_);
    usage_ = usage;
    done_ = true;
  }
  cv_.notify_all();
  if (waiter_) waiter_->notify();
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
