// The transport's outcome of an operation (Status) and its clock: shared by the UCX endpoints
// (ucx_world.h) and the shared-memory path (shm.h). No UCX or XLA types.
#pragma once

#include <chrono>
#include <string>
#include <utility>

namespace jaxcomm::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kDeadlineExceeded = 2,
  kPeerFailed = 3,
  kInternal = 4,
};

class Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace jaxcomm::transport
