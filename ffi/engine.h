// jaxcomm's asynchronous communication engine on CPU.
//
// A collective handler does not run its algorithm on the XLA thread that called it. It copies
// what the algorithm needs out of the call frame, queues the algorithm on the engine thread of
// its device and returns an ffi::Future that the engine completes. XLA's thread goes back to
// the pool at once, so a collective that waits for its peers never holds one of XLA's threads,
// and XLA may run work that neither depends on the result nor reuses the call's buffers (inside
// a training step, XLA's buffer reuse still makes backward wait: docs/DESIGN.md §2). The
// future is completed on the engine thread, where XLA then resumes the call's dependents.
//
// One engine thread per device, first-in first-out:
//   - program order holds: a device's collectives start in the order its handlers were called
//     (the ordering token chain), so their sequence numbers and tags are what they were when
//     the handlers ran them inline;
//   - each device's UCX worker is touched by its engine thread only (the transport's workers
//     are single-threaded, see ffi/transport/ucx_world.h);
//   - the deadline of a collective starts when the engine starts it, not when it was queued.
//
// Failure: the first transport failure (a deadline, a dead peer) stops the engine of the whole
// process for good (the links it touched are broken: ffi/transport/ucx_world.h; restart the
// process, as after any lost peer). Every collective that was queued behind it, or is called
// later, fails at once with the same short message instead of waiting for its own deadline.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

namespace ffi = xla::ffi;

// The algorithm of one collective call, run on the engine thread. `run` executes the local
// kernels' tasks (serially when several devices share the process: they already keep the
// cores busy; on threads when the process drives a single device).
using EngineBody = std::function<ffi::Error(const kernels::TaskRunner& run)>;

// Queues `body` on the engine thread of `device_id` and returns the future it completes.
ffi::Future SubmitToEngine(int64_t device_id, EngineBody body);

// Records a transport failure: every later collective of this process fails with `message`.
// The first failure wins; later ones are ignored. Returns the message that now stops the engine.
std::string StopEngine(const std::string& message);

// The message that stopped the engine, or "" while it runs.
std::string EngineStopMessage();

// ---- Keeping a call's arguments alive past the handler ------------------------------------
// XLA's call frame (buffer descriptors, attribute storage) is only valid while the handler
// runs. Kept<T> copies an argument into storage the queued body owns and gives the same typed
// view back (the data behind a buffer stays valid until the returned future completes).
template <typename T>
struct Kept {
  explicit Kept(T value) : value(std::move(value)) {}
  const T& view() const { return value; }
  T value;
};

template <typename E>
struct Kept<ffi::Span<const E>> {
  explicit Kept(ffi::Span<const E> span) : values(span.begin(), span.end()) {}
  ffi::Span<const E> view() const { return ffi::Span<const E>(values.data(), values.size()); }
  std::vector<E> values;
};

template <ffi::DataType dtype, size_t rank>
struct Kept<ffi::Buffer<dtype, rank>> {
  explicit Kept(const ffi::Buffer<dtype, rank>& buffer) {
    const auto dims = buffer.dimensions();
    dims_.assign(dims.begin(), dims.end());
    descriptor_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    descriptor_.extension_start = nullptr;
    descriptor_.dtype = static_cast<XLA_FFI_DataType>(dtype);
    descriptor_.data = buffer.untyped_data();
    descriptor_.rank = static_cast<int64_t>(dims_.size());
    descriptor_.dims = dims_.data();
  }
  // Copies would leave descriptor_.dims pointing into the source.
  Kept(const Kept&) = delete;
  Kept& operator=(const Kept&) = delete;
  ffi::Buffer<dtype, rank> view() const { return ffi::Buffer<dtype, rank>(&descriptor_); }

 private:
  std::vector<int64_t> dims_;
  XLA_FFI_Buffer descriptor_;
};

template <ffi::DataType dtype, size_t rank>
struct Kept<ffi::Result<ffi::Buffer<dtype, rank>>> {
  explicit Kept(ffi::Result<ffi::Buffer<dtype, rank>> result) : buffer(*result) {}
  ffi::Result<ffi::Buffer<dtype, rank>> view() const { return buffer.view(); }
  Kept<ffi::Buffer<dtype, rank>> buffer;
};

// Turns a synchronous collective implementation
//   ffi::Error Impl(const kernels::TaskRunner&, int32_t device_id, Args...)
// into the asynchronous XLA handler
//   ffi::Future Handler(ffi::ThreadPool, int32_t device_id, Args...)
// that runs Impl on the device's engine thread. Impl is written as a plain blocking algorithm;
// only the engine ever runs it.
template <auto Impl, typename Signature = decltype(Impl)>
struct AsyncCollective;

template <auto Impl, typename... Args>
struct AsyncCollective<Impl, ffi::Error (*)(const kernels::TaskRunner&, int32_t, Args...)> {
  static ffi::Future Handler(ffi::ThreadPool /*pool*/, int32_t device_id, Args... args) {
    auto kept = std::make_shared<std::tuple<Kept<std::decay_t<Args>>...>>(args...);
    return SubmitToEngine(device_id, [device_id, kept](const kernels::TaskRunner& run) {
      return std::apply([&](const auto&... k) { return Impl(run, device_id, k.view()...); }, *kept);
    });
  }
};

}  // namespace jaxcomm::collectives
