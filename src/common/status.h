// Error results that cross module boundaries. No exception crosses the library boundary:
// a call that can fail returns Status (no value) or Result<T> (a value or an error message
// a user can act on).
#pragma once
#include <optional>
#include <string>
#include <utility>

namespace kv {

class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string msg) {
    Status s;
    s.msg_ = std::move(msg);
    s.failed_ = true;
    return s;
  }
  bool is_ok() const { return !failed_; }
  explicit operator bool() const { return !failed_; }
  const std::string& message() const { return msg_; }

 private:
  std::string msg_;
  bool failed_ = false;
};

template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status st) : status_(std::move(st)) {}   // NOLINT: must be an error status
  static Result error(std::string msg) { return Result(Status::error(std::move(msg))); }
  bool is_ok() const { return value_.has_value(); }
  explicit operator bool() const { return value_.has_value(); }
  const std::string& message() const { return status_.message(); }
  const Status& status() const { return status_; }
  T& value() { return *value_; }
  const T& value() const { return *value_; }
  T& operator*() { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace kv
