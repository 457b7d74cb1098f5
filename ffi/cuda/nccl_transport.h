// The NCCL implementation of the transport interface (ffi/transport/transport.h), the "nccl"
// row of ffi/transport/registry.h: messages between device buffers of one group, through the
// group's communicator, on the call's CUDA stream.
//
// Made per group and per call by GpuGroup (ffi/cuda/gpu_collective.h), not with the world:
// NCCL bootstraps each communicator over the world's transport (the unique id), and its
// ranks are group ranks. Posting enqueues: the first post after a wait opens an NCCL group
// (ncclGroupStart), so that a ring step's send and receive run together, and Wait closes it
// (ncclGroupEnd), which puts the operations on the stream in posting order. Wait does not
// block the host: completion is stream-ordered, so kernels the caller enqueues after Wait
// see the received data, and a peer that never answers is caught by GpuGroup's watchdog
// (JAXCOMM_TIMEOUT_S), not by Wait's deadline. Tags are not matched (NCCL pairs a send with
// the receive its peer posts in the same order); every message is received whole, so a
// receive's length is its capacity.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <string_view>
#include <vector>

#include "ffi/cuda/nccl_api.h"
#include "ffi/transport/transport.h"

namespace jaxcomm::nccl {

class NcclTransport final : public transport::Transport {
 public:
  // Messages of local world rank `self` to the group `members` (world ranks, by NCCL rank) of
  // a world of `world_size` ranks, through `comm` on `stream`.
  NcclTransport(const NcclApi& api, ncclComm_t comm, std::vector<int> members, int world_size,
                int self, cudaStream_t stream);
  // Closes a group left open by posts nobody waited for.
  ~NcclTransport() override;

  const char* name() const override { return "nccl"; }
  bool Accepts(transport::MemoryKind kind) const override {
    return kind == transport::MemoryKind::kDevice;
  }
  const char* wait_mode_name() const override { return "stream"; }
  // Not a world transport: no address of its own, nothing to connect (see the file comment).
  std::string Address(int /*rank*/) const override { return {}; }
  bool Connect(const std::vector<std::string>& addresses, std::string* error) override;

  transport::Request PostSend(int self, int peer, uint64_t tag, const void* data,
                              size_t bytes) override;
  transport::Request PostRecv(int self, int peer, uint64_t tag, void* data,
                              size_t capacity) override;
  transport::Status Wait(int self, transport::Request* requests, size_t count,
                         transport::Deadline deadline, std::string_view context) override;
  using Transport::Wait;
  transport::Counters GetCounters(int self) const override;

 protected:
  // Nothing is ever pending on the host: posted operations belong to the stream.
  void Release(transport::Request::State& state) override { state.pending = nullptr; }

 private:
  // Fills `r` and enqueues ncclSend or ncclRecv of `bytes` at `data` with `peer`'s NCCL rank.
  transport::Request Post(transport::Request::Kind kind, int self, int peer, uint64_t tag,
                          void* data, size_t bytes);

  const NcclApi& api_;
  ncclComm_t comm_;
  std::vector<int> members_;  // NCCL rank -> world rank
  cudaStream_t stream_;
  bool grouped_ = false;  // between the first post and Wait: an NCCL group is open
  transport::Counters counters_;
};

}  // namespace jaxcomm::nccl
