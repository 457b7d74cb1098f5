#include "ffi/transport/transport.h"

namespace jaxcomm::transport {

std::string DescribeTag(uint64_t tag) {
  std::string s = TagIsControl(tag) ? "control " : "";
  return s + "seq " + std::to_string(TagSeq(tag)) + " step " + std::to_string(TagStep(tag)) +
         " src " + std::to_string(TagSource(tag));
}

// ---- Request -----------------------------------------------------------------------------

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    Abandon();
    state_ = std::move(other.state_);
    other.state_.pending = nullptr;
    other.state_.done = true;
    other.state_.kind = Kind::kNone;
  }
  return *this;
}

void Request::Abandon() {
  if (state_.pending == nullptr) return;
  state_.owner->Release(state_);
}

// ---- Transport ---------------------------------------------------------------------------

std::string Transport::SetRanks(int world_size, std::vector<int> local_ranks) {
  if (world_size <= 0 || world_size > kMaxWorldSize) {
    return "world_size " + std::to_string(world_size) + " not in [1, " +
           std::to_string(kMaxWorldSize) + "] (the tag holds 16 bits of source rank)";
  }
  if (local_ranks.empty()) return "no local ranks";
  std::vector<int> index_of(world_size, -1);
  for (size_t i = 0; i < local_ranks.size(); ++i) {
    const int r = local_ranks[i];
    if (r < 0 || r >= world_size) {
      return "local rank " + std::to_string(r) + " outside [0, " + std::to_string(world_size) + ")";
    }
    if (index_of[r] != -1) return "local rank " + std::to_string(r) + " listed twice";
    index_of[r] = static_cast<int>(i);
  }
  world_size_ = world_size;
  local_ranks_ = std::move(local_ranks);
  local_index_of_rank_ = std::move(index_of);
  return "";
}

Status Transport::SendRecv(int self, int send_peer, uint64_t send_tag, const void* send_data,
                           size_t send_bytes, int recv_peer, uint64_t recv_tag, void* recv_data,
                           size_t recv_capacity, size_t* received, Deadline deadline,
                           std::string_view context) {
  // Post the receive first so an eager message from recv_peer lands directly in place.
  Request requests[2];
  requests[0] = PostRecv(self, recv_peer, recv_tag, recv_data, recv_capacity);
  requests[1] = PostSend(self, send_peer, send_tag, send_data, send_bytes);
  Status status = Wait(self, requests, 2, deadline, context);
  if (received != nullptr) *received = status.ok() ? requests[0].received_bytes() : 0;
  return status;
}

Status Transport::Send(int self, int peer, uint64_t tag, const void* data, size_t bytes,
                       Deadline deadline, std::string_view context) {
  Request request = PostSend(self, peer, tag, data, bytes);
  return Wait(self, &request, 1, deadline, context);
}

Status Transport::Recv(int self, int peer, uint64_t tag, void* data, size_t capacity,
                       size_t* received, Deadline deadline, std::string_view context) {
  Request request = PostRecv(self, peer, tag, data, capacity);
  Status status = Wait(self, &request, 1, deadline, context);
  if (received != nullptr) *received = status.ok() ? request.received_bytes() : 0;
  return status;
}

}  // namespace jaxcomm::transport
