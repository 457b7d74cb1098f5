// jaxcomm.timeline.mark: records when a value exists on a device, on the clock of the
// collectives' own timestamps (see Group::Finish), so a test or a benchmark can place compute
// and communication on one timeline. The value passes through unchanged (its buffer is aliased
// to the result): the call costs one clock read and a lock.
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::timeline {
namespace {

namespace ffi = xla::ffi;

struct Mark {
  std::string label;
  int64_t device_id;
  double time;  // steady clock, seconds (= Python's time.monotonic())
};

constexpr size_t kMaxMarks = 16384;

std::mutex g_marks_mu;
std::deque<Mark> g_marks;

ffi::Error MarkImpl(int32_t device_id, std::string_view label, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out) {
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (out->untyped_data() != x.untyped_data()) {
    return ffi::Error::InvalidArgument(
        "jaxcomm.timeline.mark: the result must alias its input (input_output_aliases={0: 0})");
  }
  std::lock_guard<std::mutex> lock(g_marks_mu);
  g_marks.push_back({std::string(label), device_id, now});
  if (g_marks.size() > kMaxMarks) g_marks.pop_front();
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm::timeline

JAXCOMM_DEFINE_HANDLER("jaxcomm_mark", jaxcomm::timeline::MarkImpl,
                       xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::DeviceOrdinal>()   // device the value is on
                           .Attr<std::string_view>("label")  // name of the mark
                           .Arg<xla::ffi::AnyBuffer>()       // x: the marked value
                           .Ret<xla::ffi::AnyBuffer>());     // x again (aliased)

// ctypes entry point for jaxcomm.timeline.marks(): the marks as JSON, like jaxcomm_metrics_json
// (returns the full length; call again with a larger buffer when it is >= capacity).
JAXCOMM_C_API int64_t jaxcomm_marks_json(char* buffer, int64_t capacity) {
  jaxcomm::ffi_common::TextBuilder out;
  out << "[";
  {
    std::lock_guard<std::mutex> lock(jaxcomm::timeline::g_marks_mu);
    bool first = true;
    for (const auto& m : jaxcomm::timeline::g_marks) {
      out << (first ? "" : ", ") << "{\"label\": \"" << m.label
          << "\", \"device_id\": " << m.device_id << ", \"time\": " << m.time << "}";
      first = false;
    }
  }
  out << "]";
  return jaxcomm::ffi_common::CopyJson(out.str(), buffer, capacity);
}

JAXCOMM_C_API void jaxcomm_marks_reset() {
  std::lock_guard<std::mutex> lock(jaxcomm::timeline::g_marks_mu);
  jaxcomm::timeline::g_marks.clear();
}
