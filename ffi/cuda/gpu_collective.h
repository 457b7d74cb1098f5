// The GPU side of a collective call (platform "CUDA"): who is in the group, and the NCCL
// communicator of exactly that group.
//
// Control plane = the CPU path's. A GPU world is a UCX world with one rank per JAX GPU
// (jaxcomm/_world.py), used only for setup: Group::Begin discovers the group from the mesh
// coordinates as on CPU (ffi/group.h), and group rank 0 sends the group's ncclUniqueId to the
// other members over it. Data plane = NCCL on XLA's stream: handlers only enqueue, never
// synchronize, so results are ready when XLA's later work on the stream runs. A split call
// (start/done, below) runs on jaxcomm's own stream instead, ordered by CUDA events.
//
// Two one-time costs per device and mesh shape, both at the first call: the mesh coordinates
// operand lives in device memory and is read with one blocking copy (later calls reuse it:
// meshes of one shape must order their devices alike, as on CPU), and ncclCommInitRank, which
// blocks until every member of the group joins.
//
// Bounded failure. A peer that dies leaves NCCL kernels waiting forever, so a watchdog thread
// follows an event recorded after each call's NCCL work; if one has not completed within
// JAXCOMM_TIMEOUT_S, it aborts the communicator (the stuck kernels return) and the next call on
// that group fails with an error naming the collective, its sequence number and the group's
// world ranks.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/cuda/nccl_api.h"
#include "ffi/cuda/nccl_transport.h"
#include "ffi/group.h"
#include "ffi/ring_schedule.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {

using ffi_common::AllocateScratch;  // device scratch, 256-aligned (ffi/common.h)

// Binds, in order: Ctx<PlatformStream>, Ctx<ScratchAllocator>, Ctx<DeviceOrdinal>, Arg
// coordinates, Arg token, Attr collective (CollectiveAttrs): the same operands and attributes
// as BindCollective (the CPU handlers), so one ffi_call lowers to either platform.
inline auto BindGpuCollective() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: all work goes here
      .Ctx<ffi::ScratchAllocator>()              // device working memory
      .Ctx<ffi::DeviceOrdinal>()                 // local CUDA ordinal
      .Arg<ffi::Buffer<ffi::S32, 1>>()           // coordinates (device memory)
      .Arg<ffi::Buffer<ffi::S32, 0>>()           // token: orders collectives
      .Attr<CollectiveAttrs>("collective");      // GPU world and mesh layout
}

// A call's site resolved to host values: `site` is what Group::Begin takes on CPU (device_id =
// the global JAX device id, coordinates in host memory owned by this struct).
struct GpuSite {
  CallSite site;
  int device_ordinal = -1;
  cudaStream_t stream = nullptr;
  std::vector<int32_t> coordinates;

  // The same site with another reduce mask (a sub-group of a hierarchical allreduce). `mask`
  // must outlive the returned site.
  CallSite WithReduceAxes(const std::vector<int64_t>& mask) const {
    CallSite sub = site;
    sub.reduce_axes = ffi::Span<const int64_t>(mask.data(), mask.size());
    return sub;
  }
};

// Resolves the handler's context and common operands into a GpuSite (see the file comment
// for the one blocking read of the coordinates).
ffi::Error ResolveGpuSite(const char* name, cudaStream_t stream, const Caller& caller,
                          GpuSite* out);

// One group of a GPU call: membership, sequence number and metrics as on CPU, plus its NCCL
// communicator (NCCL rank == group rank) and the transport over it on the call's stream
// (ffi/cuda/nccl_transport.h), which carries the group's messages: group().Send, Recv,
// PostSend, PostRecv and Wait enqueue NCCL operations, as they move host buffers over UCX on
// CPU.
class GpuGroup {
 public:
  // Group::Begin for `site`, then the group's communicator (created on first use).
  static ffi::Error Begin(const GpuSite& gpu, const CallSite& site, std::unique_ptr<GpuGroup>* out);

  Group& group() { return *group_; }
  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  ncclComm_t comm() const { return comm_; }
  const nccl::NcclApi& nccl() const { return *nccl_; }

  // ffi::Error for a failed NCCL call ("<collective> seq S: <what> failed: ..."), or Success.
  ffi::Error Check(ncclResult_t result, const char* what) const;
  // Counts traffic for metrics: the algorithm knows its message sizes on the host.
  void CountTraffic(uint64_t sent, uint64_t received) { group_->CountTraffic(sent, received); }
  // Hands the call's NCCL work enqueued so far on `stream` to the watchdog (see the file
  // comment); call once after the last NCCL operation.
  ffi::Error Watch(cudaStream_t stream);
  // Records the call's metrics (as Group::Finish; the time is the time to enqueue).
  void Finish(const char* algorithm, int64_t elements) { group_->Finish(algorithm, elements); }

 private:
  std::unique_ptr<Group> group_;
  int device_ordinal_ = -1;
  ncclComm_t comm_ = nullptr;
  const nccl::NcclApi* nccl_ = nullptr;
  std::shared_ptr<struct CommState> state_;
  std::unique_ptr<nccl::NcclTransport> wire_;  // the group's messages (group().UseTransport)
};

// Counts the traffic of a dense float32 allreduce of n elements over `group` as the CPU ring's
// (ring::DenseRingBytes): NCCL does not report what its ring or tree moves.
inline void CountDenseRing(GpuGroup& group, int64_t n) {
  const int parts = group.size();
  const int rank = group.rank();
  group.CountTraffic(ring::DenseRingBytes(n, parts, rank),
                     ring::DenseRingBytes(n, parts, ring::LeftOf(rank, parts)));
}

// The end of a sparse GPU collective (TopKAllgather, gTop-k): NaN-poisons the sum out[n] if a
// received index was out of range (*bad, set on the device: the GPU form of the CPU's error),
// then counts the traffic and records the call's metrics under `label`.
ffi::Error FinishSparse(GpuGroup& group, const char* op, const char* label, int64_t n,
                        const uint32_t* bad, float* out, uint64_t sent, uint64_t received,
                        cudaStream_t stream);

// ResolveGpuSite, then GpuGroup::Begin on the site as it is: the opening of a one-group call.
ffi::Error BeginGpuCall(const char* name, cudaStream_t stream, const Caller& caller, GpuSite* site,
                        std::unique_ptr<GpuGroup>* group);

// token_out = token (an enqueued device copy: the token orders calls through data flow only).
ffi::Error ForwardToken(cudaStream_t stream, const ffi::Buffer<ffi::S32, 0>& token,
                        ffi::ResultBuffer<ffi::S32, 0>& token_out);

// ---- Split calls (start/done) on the GPU ---------------------------------------------------
// A split start (CollectiveAttrs::split, set by jaxcomm/collectives/_call.py for the targets of
// jaxcomm._ffi.GPU_SPLIT_TARGETS) enqueues its NCCL work on jaxcomm's own stream of the device,
// behind an event recorded on XLA's stream (the operands are ready there), and returns. XLA's
// stream goes on with whatever does not need the sum (the rest of backward) while NCCL runs.
// The start files an event recorded after its work under its result buffers;
// jaxcomm_collective_done (CUDA) finds it by those buffers, which it receives aliased, and
// makes XLA's stream wait on it. No host thread ever waits. The operands stay alive until then
// because done reads them (as on CPU). Only collectives that take no XLA scratch memory may
// split: XLA frees scratch in its own stream's order as soon as the handler returns.

// The comm stream of `device_ordinal`, made to wait for the work enqueued so far on
// `xla_stream`.
ffi::Error BeginSplit(const char* name, int device_ordinal, cudaStream_t xla_stream,
                      cudaStream_t* comm_stream);
// Records the end of the start's work on `comm_stream` and files it under `results` (the
// buffers done will hand back, in order).
ffi::Error EndSplit(const char* name, cudaStream_t comm_stream, std::vector<const void*> results);
// Makes `xla_stream` wait for the split start whose results are `results` (done's side).
ffi::Error AwaitSplit(const char* name, cudaStream_t xla_stream,
                      const std::vector<const void*>& results);

namespace internal {
// The device buffer of a result argument of a collective (what a split start files); other
// arguments add nothing.
template <typename T>
void AddResult(std::vector<const void*>&, const T&) {}
template <typename B>
void AddResult(std::vector<const void*>& results, ffi::Result<B> result) {
  results.push_back(result->untyped_data());
}
}  // namespace internal

// Turns a GPU collective implementation
//   ffi::Error Impl(cudaStream_t, ffi::ScratchAllocator&, const Caller&, Data...)
// into the handler that BindGpuCollective and the op's own bindings describe
//   ffi::Error Handler(stream, scratch, device_ordinal, coordinates, token,
//                      const CollectiveAttrs&, Data..., token_out)
// (Caller::device_id is the local CUDA ordinal): Impl enqueues its work on the stream, then
// the handler forwards the token (ForwardToken). kSplittable: the collective takes no scratch
// memory and may run as a split start (above) on jaxcomm's stream; others refuse `split`.
template <auto Impl, bool kSplittable, typename Signature = decltype(Impl)>
struct GpuCollective;

template <auto Impl, bool kSplittable, typename... Data>
struct GpuCollective<Impl, kSplittable,
                     ffi::Error (*)(cudaStream_t, ffi::ScratchAllocator&, const Caller&, Data...)> {
  static ffi::Error Handler(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            int32_t device_ordinal, ffi::Buffer<ffi::S32, 1> coordinates,
                            ffi::Buffer<ffi::S32, 0> token, const CollectiveAttrs& attrs,
                            Data... data, ffi::ResultBuffer<ffi::S32, 0> token_out) {
    const Caller caller{device_ordinal, coordinates, attrs};
    if (attrs.detach != 0) {
      return ffi::Error::InvalidArgument(
          "detached jaxcomm collectives (jaxcomm.start) run on CPU only (ffi/engine.h, Handles)");
    }
    if (!attrs.split) {
      JAXCOMM_RETURN_IF_ERROR(Impl(stream, scratch, caller, data...));
      return ForwardToken(stream, token, token_out);
    }
    if constexpr (!kSplittable) {
      return ffi::Error::InvalidArgument(
          "this jaxcomm collective cannot be split (start/done) on the GPU: it takes XLA "
          "scratch memory (jaxcomm._ffi.GPU_SPLIT_TARGETS lists the ones that can)");
    } else {
      cudaStream_t comm = nullptr;
      JAXCOMM_RETURN_IF_ERROR(BeginSplit("jaxcomm collective", device_ordinal, stream, &comm));
      JAXCOMM_RETURN_IF_ERROR(Impl(comm, scratch, caller, data...));
      std::vector<const void*> results;
      (internal::AddResult(results, data), ...);
      JAXCOMM_RETURN_IF_ERROR(EndSplit("jaxcomm collective", comm, std::move(results)));
      return ForwardToken(stream, token, token_out);
    }
  }
};

// Defines and registers (ffi/registrations.h, platform "CUDA") the GPU handler of target
// `target`: the collective `impl` (GpuCollective), bound by BindGpuCollective() and then
// `bind_data`, the same as the CPU handler's (JAXCOMM_DEFINE_COLLECTIVE). Use it inside
// namespace jaxcomm::collectives::gpu. The _SPLITTABLE form also lets the call run as a split
// start, and its row says so (kGpuSplit: Python's _ffi.GPU_SPLIT_TARGETS).
#define JAXCOMM_DEFINE_GPU_COLLECTIVE(target, impl, bind_data)                              \
  JAXCOMM_REGISTER_FFI(target, kCuda, 0,                                                    \
                       (::jaxcomm::collectives::gpu::GpuCollective<&impl, false>::Handler), \
                       bind_data(::jaxcomm::collectives::gpu::BindGpuCollective()))
#define JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE(target, impl, bind_data)                  \
  JAXCOMM_REGISTER_FFI(target, kCuda, ::jaxcomm::registrations::kGpuSplit,                 \
                       (::jaxcomm::collectives::gpu::GpuCollective<&impl, true>::Handler), \
                       bind_data(::jaxcomm::collectives::gpu::BindGpuCollective()))

// ffi::Error for a failed CUDA call, or Success.
ffi::Error CheckCuda(const char* name, cudaError_t error, const char* what);

}  // namespace jaxcomm::collectives::gpu
