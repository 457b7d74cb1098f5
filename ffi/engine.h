// jaxcomm's asynchronous communication engine on CPU.
//
// A collective handler does not run its algorithm on the XLA thread that called it. It copies
// what the algorithm needs out of the call frame, queues the algorithm on the engine thread of
// its device and returns an ffi::Future that the engine completes. XLA's thread goes back to
// the pool at once, so a collective that waits for its peers never holds one of XLA's threads.
//
// That alone does not let backward run beside the collective: XLA:CPU reuses a call's operand
// and result buffers for the ops after it and makes those ops wait for the call's future
// (docs/DESIGN.md, "Overlap"). A *split* call therefore returns a ready future at once and
// hands out a ticket; a separate jaxcomm_collective_done call, scheduled after the gradients
// it must not delay, keeps the buffers alive and waits for the ticket (Tickets, below).
//
// One engine thread per device, first-in first-out:
//   - program order holds: a device's collectives start in the order its handlers were called
//     (the ordering token chain), so their sequence numbers and tags are what they were when
//     the handlers ran them inline;
//   - each device's UCX worker is touched by its engine thread only (the transport's workers
//     are single-threaded, see ffi/transport/transport.h);
//   - the deadline of a collective starts when the engine starts it, not when it was queued.
//
// Failure: the first transport failure (a deadline, a dead peer) stops the engine of the whole
// process for good (the links it touched are broken: ffi/transport/transport.h; restart the
// process, as after any lost peer). Every collective that was queued behind it, or is called
// later, fails at once with the same short message instead of waiting for its own deadline.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
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

// The end of one queued collective, shared by the engine (which finishes it) and the XLA calls
// that wait for it: the collective's own handler, or, for a split call, its
// jaxcomm_collective_done (see Tickets below).
class Completion {
 public:
  // A future that becomes ready with the collective's status once the engine has finished it
  // (at once if it already has). XLA resumes the waiting call's dependents on jaxcomm's
  // completion thread, never on an engine thread, so they do not delay the next collective.
  ffi::Future Wait();

  // Records the status and completes every waiting future. Called once, by the engine.
  void Finish(ffi::Error error);

  // The recorded status; an Internal error while the engine has not finished it. A task queued
  // on the same device engine after this collective reads it once the collective is done
  // (each engine is first-in first-out).
  ffi::Error Status();

 private:
  std::mutex mu_;
  bool finished_ = false;
  ffi::Error error_;
  std::vector<ffi::Promise> waiters_;
};

// A future that is already complete with `error` (success: available).
ffi::Future CompletedFuture(const ffi::Error& error);

// Queues `body` on the engine thread of `device_id`; the returned completion tells its end.
std::shared_ptr<Completion> SubmitToEngine(int64_t device_id, EngineBody body);

// When the collective the calling engine thread now runs was queued (steady clock, seconds,
// = Python's time.monotonic()): when XLA ran its handler. Metrics report it as "queued", so a
// timeline tells XLA's late issue (queued long after the operands existed) from the engine's
// backlog (started long after queued). 0 outside an engine body (e.g. on the GPU).
double QueuedSecondsOfCurrentCollective();

// Records a transport failure: every later collective of this process fails with `message`.
// The first failure wins; later ones are ignored. Returns the message that now stops the engine.
std::string StopEngine(const std::string& message);

// The message that stopped the engine, or "" while it runs.
std::string EngineStopMessage();

// ---- Tickets: collectives split into start and done -----------------------------------------
// A split call's handler queues the collective and returns at once; XLA then takes its
// results as written. It hands out a ticket (in its token result), and the
// jaxcomm_collective_done call that consumes the ticket, and takes the start's data operands
// and results as operands, waits for the engine. Between the two, XLA runs whatever does not
// depend on the sum (the rest of backward), while the data buffers stay alive because done
// still reads them: docs/DESIGN.md, "Overlap".

// Registers a split collective: its completion, and the buffers its engine body writes (done
// must be handed exactly these, in this order). Returns the ticket.
int32_t IssueTicket(std::shared_ptr<Completion> completion, std::vector<const void*> results);

// Takes back the collective of `ticket` (each ticket is redeemed once). `results` are the
// buffers done received to return; they must be the ones the start registered: XLA copying a
// result between start and done would hand back a buffer the engine never wrote.
ffi::Error RedeemTicket(int32_t ticket, const std::vector<const void*>& results,
                        std::shared_ptr<Completion>* completion);

// ---- Handles: collectives detached from their jitted call ---------------------------------
// A ticket lives within one jitted call: its done aliases the start's result buffers, which
// XLA frees or reuses once the call returns. A *detached* start (CollectiveAttrs::detach, CPU)
// instead copies its operands into staging memory that the collective owns and points the
// engine at staging results, so nothing it reads or writes belongs to XLA. Its token result is
// a handle, an int32 the program may carry out of the call (e.g. in a training state) and hand
// to jaxcomm_handle_wait in a later jitted call, which copies the staged results into its own
// once the engine has finished (ffi/handle_wait.cc). The handle is valid in this process only.
//
// Misuse fails with an error instead of a hang or a leak: a handle waited twice, or waited on
// another device, or issued by another process (the program keeps ProcessEpoch() beside each
// handle, so one restored from a checkpoint saved in flight is recognized); and a handle
// dropped without a wait is found when the next detached start on the same stream (an id the
// caller picks, e.g. one per parameter fragment) comes, and at exit (jaxcomm_open_handles,
// read by jaxcomm/collectives/handles.py).

// One staging buffer, 64-byte aligned like XLA's own (the kernels vectorize over it).
class StagedBuffer {
 public:
  explicit StagedBuffer(size_t bytes)
      : bytes_(bytes),
        data_(static_cast<char*>(std::aligned_alloc(kAlignment, RoundUp(bytes))), &std::free) {}
  char* data() const { return data_.get(); }
  size_t size() const { return bytes_; }

 private:
  static constexpr size_t kAlignment = 64;
  static size_t RoundUp(size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment + kAlignment * (bytes == 0);
  }
  size_t bytes_;
  std::unique_ptr<char, decltype(&std::free)> data_;
};

// The memory a detached collective reads and writes instead of XLA's buffers.
struct Staging {
  std::vector<StagedBuffer> inputs;   // copies of the data operands
  std::vector<StagedBuffer> outputs;  // the results, in the start's result order
};

// The error a detached start on `stream` of `device_id` gets before it queues anything: the
// stream's previous handle is still open (dropped without a wait). Success otherwise.
ffi::Error CheckStreamFree(int64_t device_id, int64_t stream);

// Registers a detached collective started on `device_id`'s engine on stream `stream` (> 0).
// Fails (and registers nothing) when the stream still has an open handle on this device: that
// handle was dropped without a wait. On success sets *handle (>= 1).
ffi::Error IssueHandle(int64_t device_id, int64_t stream, std::shared_ptr<Completion> completion,
                       std::shared_ptr<Staging> staging, int32_t* handle);

// Takes back the detached collective of `handle` for a wait on `device_id` (once).
ffi::Error RedeemHandle(int32_t handle, int64_t device_id, std::shared_ptr<Completion>* completion,
                        std::shared_ptr<Staging>* staging);

// A random nonzero number drawn once per process. A program keeps it beside each handle, so a
// handle restored from a checkpoint of another process is told apart from a live handle
// that happens to have the same number.
int32_t ProcessEpoch();

// One line per handle issued and not yet waited ("handle 3 (device 0, stream 1)").
std::vector<std::string> OpenHandles();

// ---- Keeping a call's arguments alive past the handler ------------------------------------
// XLA's call frame (buffer descriptors, attribute storage) is only valid while the handler
// runs. Kept<T> copies an argument into storage the queued body owns and gives the same typed
// view back. The data behind a buffer stays valid until the collective's future completes, or,
// for a split call, until its done has waited for it; except for the small integer operands
// (below), which a split call's done does not keep.
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

// A buffer descriptor that outlives the call frame (the data pointer is not copied from).
class KeptDescriptor {
 public:
  // Points the descriptor at `data` (a detached start's staging copy).
  void Rebind(void* data) { descriptor_.data = data; }

 public:
  template <typename Dims>
  KeptDescriptor(ffi::DataType dtype, void* data, const Dims& dims)
      : dims_(dims.begin(), dims.end()) {
    descriptor_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    descriptor_.extension_start = nullptr;
    descriptor_.dtype = static_cast<XLA_FFI_DataType>(dtype);
    descriptor_.data = data;
    descriptor_.rank = static_cast<int64_t>(dims_.size());
    descriptor_.dims = dims_.data();
  }
  // Copies would leave descriptor_.dims pointing into the source.
  KeptDescriptor(const KeptDescriptor&) = delete;
  KeptDescriptor& operator=(const KeptDescriptor&) = delete;
  XLA_FFI_Buffer* get() const { return &descriptor_; }

 private:
  std::vector<int64_t> dims_;
  mutable XLA_FFI_Buffer descriptor_;
};

template <ffi::DataType dtype, size_t rank>
struct Kept<ffi::Buffer<dtype, rank>> {
  explicit Kept(const ffi::Buffer<dtype, rank>& buffer)
      : descriptor(dtype, buffer.untyped_data(), buffer.dimensions()) {}
  ffi::Buffer<dtype, rank> view() const { return ffi::Buffer<dtype, rank>(descriptor.get()); }
  // Detached start: copies the operand into staging and reads it from there.
  void Stage(Staging& staging) {
    const size_t bytes = view().size_bytes();
    StagedBuffer& copy = staging.inputs.emplace_back(bytes);
    std::memcpy(copy.data(), descriptor.get()->data, bytes);
    descriptor.Rebind(copy.data());
  }
  KeptDescriptor descriptor;
};

// The small integer operands (the mesh coordinates) are copied: a split call
// returns before the engine reads them, and XLA may reuse their buffers from then on.
template <size_t rank>
struct Kept<ffi::Buffer<ffi::S32, rank>> {
  explicit Kept(const ffi::Buffer<ffi::S32, rank>& buffer)
      : values(buffer.typed_data(), buffer.typed_data() + buffer.element_count()),
        descriptor(ffi::S32, values.data(), buffer.dimensions()) {}
  ffi::Buffer<ffi::S32, rank> view() const { return ffi::Buffer<ffi::S32, rank>(descriptor.get()); }
  std::vector<int32_t> values;
  KeptDescriptor descriptor;
};

// A result the engine writes. written() is what a split call registers with its ticket.
template <ffi::DataType dtype, size_t rank>
struct Kept<ffi::Result<ffi::Buffer<dtype, rank>>> {
  explicit Kept(ffi::Result<ffi::Buffer<dtype, rank>> result) : buffer(*result) {}
  ffi::Result<ffi::Buffer<dtype, rank>> view() const { return buffer.view(); }
  const void* written() const { return buffer.descriptor.get()->data; }
  // Detached start: the engine writes a staging result instead (XLA's is left unwritten).
  void Stage(Staging& staging) {
    StagedBuffer& out = staging.outputs.emplace_back(buffer.view().size_bytes());
    buffer.descriptor.Rebind(out.data());
  }
  Kept<ffi::Buffer<dtype, rank>> buffer;
};

// Whether Kept<T> points at XLA memory a detached start must stage (has Stage()).
template <typename K, typename = void>
struct StagedWhenDetached : std::false_type {};
template <typename K>
struct StagedWhenDetached<K,
                          std::void_t<decltype(std::declval<K&>().Stage(std::declval<Staging&>()))>>
    : std::true_type {};

// Whether Kept<T> is a result the engine writes (has written()).
template <typename K, typename = void>
struct WrittenByEngine : std::false_type {};
template <typename K>
struct WrittenByEngine<K, std::void_t<decltype(std::declval<const K&>().written())>>
    : std::true_type {};

}  // namespace jaxcomm::collectives
