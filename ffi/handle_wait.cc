// jaxcomm_handle_wait: the end of a detached collective (ffi/engine.h, Handles), in the same or
// a later jitted call than its start.
//
// Operand: the handle, two int32: this process's epoch (ProcessEpoch) and the start's token
// result, both carried by the program. Results: the start's
// data results (same sizes, in order), filled from the collective's staging memory once the
// engine has finished it. The copy runs as a task on the device's engine, queued behind the
// collective (each engine is first-in first-out), so the XLA thread never blocks; a stopped
// engine fails it with the stop message instead of leaving it waiting.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi/common.h"
#include "ffi/engine.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

constexpr char kWaitOp[] = "jaxcomm.wait";

// A result buffer of the wait: where the staged bytes go, and how many it takes.
struct WaitResult {
  void* data;
  size_t bytes;
};

ffi::Future HandleWaitImpl(int32_t device_id, ffi::Buffer<ffi::S32> handle,
                           ffi::RemainingRets rets) {
  if (handle.element_count() != 2) {
    return CompletedFuture(ffi::Error::InvalidArgument(
        std::string(kWaitOp) + ": a handle is two int32 per rank (process epoch, number), got " +
        std::to_string(handle.element_count())));
  }
  if (handle.typed_data()[0] != ProcessEpoch()) {
    return CompletedFuture(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(kWaitOp) + ": handle " + std::to_string(handle.typed_data()[1]) +
            " was started by another process (restored from a checkpoint saved while its "
            "collective was in flight?): start it again in this process (DiLoCo.restart)"));
  }
  std::vector<WaitResult> results;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return CompletedFuture(ret.error());
    results.push_back({(*ret)->untyped_data(), (*ret)->size_bytes()});
  }
  std::shared_ptr<Completion> completion;
  std::shared_ptr<Staging> staging;
  const ffi::Error redeemed =
      RedeemHandle(handle.typed_data()[1], device_id, &completion, &staging);
  if (!redeemed.success()) return CompletedFuture(redeemed);
  if (staging->outputs.size() != results.size()) {
    return CompletedFuture(ffi::Error::InvalidArgument(
        std::string(kWaitOp) + ": the collective has " + std::to_string(staging->outputs.size()) +
        " results, the wait asked for " + std::to_string(results.size())));
  }
  for (size_t i = 0; i < results.size(); ++i) {
    if (staging->outputs[i].size() != results[i].bytes) {
      return CompletedFuture(ffi::Error::InvalidArgument(
          std::string(kWaitOp) + ": result " + std::to_string(i) + " of the collective has " +
          std::to_string(staging->outputs[i].size()) + " bytes, the wait asked for " +
          std::to_string(results[i].bytes)));
    }
  }
  // The result buffers stay valid until the returned future completes.
  std::shared_ptr<Completion> copied =
      SubmitToEngine(device_id, [completion, staging, results](const kernels::TaskRunner& /*run*/) {
        JAXCOMM_RETURN_IF_ERROR(completion->Status());  // ended: queued before this task
        for (size_t i = 0; i < results.size(); ++i) {
          std::memcpy(results[i].data, staging->outputs[i].data(), results[i].bytes);
        }
        return ffi::Error::Success();
      });
  return copied->Wait();
}

}  // namespace
}  // namespace jaxcomm::collectives

// One line per open handle, "\n"-separated (jaxcomm/collectives/handles.py reads it at exit).
// Returns the text's length; writes at most `capacity` bytes, NUL-terminated, when `buffer`
// is not null.
JAXCOMM_C_API int64_t jaxcomm_open_handles(char* buffer, int64_t capacity) {
  std::string text;
  for (const std::string& line : jaxcomm::collectives::OpenHandles()) {
    text += (text.empty() ? "" : "\n") + line;
  }
  if (buffer != nullptr && capacity > 0) {
    const size_t n = std::min(text.size(), static_cast<size_t>(capacity - 1));
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
  return static_cast<int64_t>(text.size());
}

// This process's epoch (the first int32 of every handle it issues).
JAXCOMM_C_API int32_t jaxcomm_process_epoch() { return jaxcomm::collectives::ProcessEpoch(); }

JAXCOMM_DEFINE_HANDLER("jaxcomm_handle_wait", jaxcomm::collectives::HandleWaitImpl,
                       xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::DeviceOrdinal>()  // the device the handle must be on
                           .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // handle: epoch, number
                           .RemainingRets());  // the start's data results, in order
