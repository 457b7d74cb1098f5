#include "ffi/cuda/nccl_transport.h"

#include <algorithm>
#include <utility>

namespace jaxcomm::nccl {

using transport::Request;
using transport::Status;
using transport::StatusCode;

NcclTransport::NcclTransport(const NcclApi& api, ncclComm_t comm, std::vector<int> members,
                             int world_size, int self, cudaStream_t stream)
    : api_(api), comm_(comm), members_(std::move(members)), stream_(stream) {
  // `self` is one of `members`, both checked by Group::Begin; SetRanks cannot fail then.
  SetRanks(world_size, {self});
}

NcclTransport::~NcclTransport() {
  if (grouped_) api_.group_end();
}

bool NcclTransport::Connect(const std::vector<std::string>& /*addresses*/, std::string* error) {
  if (error) {
    *error = "the nccl transport connects per group, over the world's transport (GpuGroup)";
  }
  return false;
}

Request NcclTransport::Post(Request::Kind kind, int self, int peer, uint64_t tag, void* data,
                            size_t bytes) {
  Request request;
  Request::State& r = StateOf(request);
  Describe(r, kind, self, peer, tag, bytes);
  const auto found = std::find(members_.begin(), members_.end(), peer);
  if (!IsLocal(self) || found == members_.end()) {
    r.code = ncclInvalidArgument;
    r.error = "world rank " + std::to_string(peer) + " is not in this communicator's group";
    return request;
  }
  const int nccl_rank = static_cast<int>(found - members_.begin());
  if (!grouped_) {
    if (const ncclResult_t opened = api_.group_start(); opened != ncclSuccess) {
      r.code = opened;
      r.error = NcclErrorString(api_, "ncclGroupStart", opened);
      return request;
    }
    grouped_ = true;
  }
  const bool send = kind == Request::Kind::kSend;
  r.code = send ? api_.send(data, bytes, ncclUint8, nccl_rank, comm_, stream_)
                : api_.recv(data, bytes, ncclUint8, nccl_rank, comm_, stream_);
  if (r.code != ncclSuccess) {
    r.error =
        NcclErrorString(api_, send ? "ncclSend" : "ncclRecv", static_cast<ncclResult_t>(r.code));
    return request;
  }
  // The whole message, once the stream runs it (file comment).
  if (send) {
    counters_.bytes_sent += bytes;
    ++counters_.messages_sent;
  } else {
    r.received = bytes;
    counters_.bytes_received += bytes;
    ++counters_.messages_received;
  }
  return request;
}

Request NcclTransport::PostSend(int self, int peer, uint64_t tag, const void* data, size_t bytes) {
  // NCCL takes a non-const pointer for both directions; a send only reads it.
  return Post(Request::Kind::kSend, self, peer, tag, const_cast<void*>(data), bytes);
}

Request NcclTransport::PostRecv(int self, int peer, uint64_t tag, void* data, size_t capacity) {
  return Post(Request::Kind::kRecv, self, peer, tag, data, capacity);
}

Status NcclTransport::Wait(int self, Request* requests, size_t count,
                           transport::Deadline /*deadline*/, std::string_view context) {
  Status status;
  for (size_t i = 0; i < count && status.ok(); ++i) {
    const Request::State& r = StateOf(requests[i]);
    if (r.code == ncclSuccess) continue;
    status = Status(StatusCode::kInternal,
                    std::string(context) + ": " +
                        (r.kind == Request::Kind::kSend ? "send to" : "receive from") + " rank " +
                        std::to_string(r.peer) + " (" + transport::DescribeTag(r.tag) +
                        ") on rank " + std::to_string(self) + " failed: " + r.error);
  }
  if (grouped_) {
    grouped_ = false;
    const ncclResult_t closed = api_.group_end();
    if (closed != ncclSuccess && status.ok()) {
      status = Status(StatusCode::kInternal,
                      std::string(context) + ": " + NcclErrorString(api_, "ncclGroupEnd", closed));
    }
  }
  return status;
}

transport::Counters NcclTransport::GetCounters(int self) const {
  return IsLocal(self) ? counters_ : transport::Counters{};
}

}  // namespace jaxcomm::nccl
