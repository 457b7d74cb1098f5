// C API over the world's transport (ffi/transport/registry.h) for Python's ctypes bootstrap
// (jaxcomm/_world.py): create a world, publish local worker addresses, connect, read counters,
// destroy. Worlds live in the process-global registry (ffi/transport/world_registry.h) where FFI
// handlers find them by handle. Every function returns a status code (0 = OK, < 0 = error) and
// never aborts; the message of the last error on the calling thread is read with
// jaxcomm_world_last_error().
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/transport/registry.h"
#include "ffi/transport/settings.h"
#include "ffi/transport/world_registry.h"

namespace {

using jaxcomm::transport::GetWorld;

// Error codes of the C API (mirrored in jaxcomm/_world.py).
constexpr int kOk = 0;
constexpr int kErrInvalid = -1;    // bad argument or unknown handle
constexpr int kErrTransport = -2;  // the transport failed
constexpr int kErrTimeout = -3;
constexpr int kErrPeerFailed = -4;

thread_local std::string last_error;

int Fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

int FromStatus(const jaxcomm::transport::Status& s) {
  using jaxcomm::transport::StatusCode;
  switch (s.code()) {
    case StatusCode::kOk:
      return kOk;
    case StatusCode::kInvalidArgument:
      return Fail(kErrInvalid, s.message());
    case StatusCode::kDeadlineExceeded:
      return Fail(kErrTimeout, s.message());
    case StatusCode::kPeerFailed:
      return Fail(kErrPeerFailed, s.message());
    default:
      return Fail(kErrTransport, s.message());
  }
}

}  // namespace

// Message of the last failed call on this thread ("" if none).
JAXCOMM_C_API const char* jaxcomm_world_last_error() { return last_error.c_str(); }

// The transport's default wait timeout in seconds (env JAXCOMM_TIMEOUT_S, default 120), so
// Python's bootstrap uses the same value as the C++ waits.
JAXCOMM_C_API double jaxcomm_world_default_timeout_s() {
  return std::chrono::duration<double>(jaxcomm::transport::DefaultTimeout()).count();
}

// Creates a world of `world_size` ranks hosting `local_ranks[0..num_local)` in this process;
// stores its handle (> 0) in *handle.
JAXCOMM_C_API int jaxcomm_world_create(int world_size, const int* local_ranks, int num_local,
                                       int64_t* handle) {
  if (handle == nullptr || local_ranks == nullptr || num_local <= 0) {
    return Fail(kErrInvalid, "jaxcomm_world_create: null pointer or no local ranks");
  }
  std::string error;
  auto world = jaxcomm::transport::CreateWorld(
      world_size, std::vector<int>(local_ranks, local_ranks + num_local), &error);
  if (!world) return Fail(kErrTransport, error);
  *handle = jaxcomm::transport::RegisterWorld(std::move(world));
  return kOk;
}

// Copies local rank `rank`'s packed worker address into buffer[0..capacity) and returns its
// length (> 0). If capacity is too small nothing is copied and the needed length is returned,
// so callers may ask with capacity 0 first. < 0 on error.
JAXCOMM_C_API int64_t jaxcomm_world_address(int64_t handle, int rank, char* buffer,
                                            int64_t capacity) {
  auto world = GetWorld(handle);
  if (!world) return Fail(kErrInvalid, "jaxcomm_world_address: unknown world handle");
  std::string address = world->Address(rank);
  if (address.empty()) {
    return Fail(kErrInvalid,
                "jaxcomm_world_address: rank " + std::to_string(rank) + " is not local");
  }
  auto length = static_cast<int64_t>(address.size());
  if (buffer != nullptr && capacity >= length) std::memcpy(buffer, address.data(), address.size());
  return length;
}

// Connects with all ranks: `blob` is the concatenation of the addresses of ranks
// 0..world_size-1, `lengths[r]` the length of rank r's.
JAXCOMM_C_API int jaxcomm_world_connect(int64_t handle, const char* blob, const int64_t* lengths,
                                        int world_size) {
  auto world = GetWorld(handle);
  if (!world) return Fail(kErrInvalid, "jaxcomm_world_connect: unknown world handle");
  if (blob == nullptr || lengths == nullptr || world_size != world->world_size()) {
    return Fail(kErrInvalid, "jaxcomm_world_connect: expected " +
                                 std::to_string(world->world_size()) + " addresses, got " +
                                 std::to_string(world_size));
  }
  std::vector<std::string> addresses(world_size);
  int64_t offset = 0;
  for (int r = 0; r < world_size; ++r) {
    if (lengths[r] <= 0) return Fail(kErrInvalid, "jaxcomm_world_connect: empty address");
    addresses[r].assign(blob + offset, static_cast<size_t>(lengths[r]));
    offset += lengths[r];
  }
  std::string error;
  if (!world->Connect(addresses, &error)) return Fail(kErrTransport, error);
  return kOk;
}

// Unregisters the world; it is torn down once no FFI handler holds it any more.
JAXCOMM_C_API int jaxcomm_world_destroy(int64_t handle) {
  if (!jaxcomm::transport::UnregisterWorld(handle)) {
    return Fail(kErrInvalid, "jaxcomm_world_destroy: unknown world handle");
  }
  return kOk;
}

// out[0..4) = bytes sent, bytes received, messages sent, messages received of local `rank`.
JAXCOMM_C_API int jaxcomm_world_counters(int64_t handle, int rank, uint64_t* out) {
  auto world = GetWorld(handle);
  if (!world || out == nullptr) return Fail(kErrInvalid, "jaxcomm_world_counters: bad handle");
  if (!world->IsLocal(rank)) {
    return Fail(kErrInvalid,
                "jaxcomm_world_counters: rank " + std::to_string(rank) + " is not local");
  }
  auto c = world->GetCounters(rank);
  out[0] = c.bytes_sent;
  out[1] = c.bytes_received;
  out[2] = c.messages_sent;
  out[3] = c.messages_received;
  return kOk;
}

// Test/diagnostic entry point (control tag channel, never mixes with collectives): local rank
// `self` sends send_bytes to `send_peer` while receiving up to recv_capacity bytes from
// `recv_peer` (either peer may be -1 to skip that half); *received gets the length.
JAXCOMM_C_API int jaxcomm_world_sendrecv(int64_t handle, int self, int send_peer,
                                         const void* send_data, int64_t send_bytes, int recv_peer,
                                         void* recv_data, int64_t recv_capacity, int64_t* received,
                                         uint32_t seq, double timeout_s) {
  using namespace jaxcomm::transport;
  auto world = GetWorld(handle);
  if (!world) return Fail(kErrInvalid, "jaxcomm_world_sendrecv: unknown world handle");
  if (send_bytes < 0 || recv_capacity < 0) return Fail(kErrInvalid, "negative size");
  Deadline deadline =
      timeout_s > 0 ? Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9))
                    : DefaultDeadline();
  std::vector<Request> requests;
  if (recv_peer >= 0) {
    requests.push_back(world->PostRecv(self, recv_peer, MakeControlTag(seq, 0, recv_peer),
                                       recv_data, static_cast<size_t>(recv_capacity)));
  }
  if (send_peer >= 0) {
    requests.push_back(world->PostSend(self, send_peer, MakeControlTag(seq, 0, self), send_data,
                                       static_cast<size_t>(send_bytes)));
  }
  Status s = world->Wait(self, requests, deadline, "jaxcomm_world_sendrecv");
  if (received != nullptr) {
    *received = s.ok() && recv_peer >= 0 ? static_cast<int64_t>(requests[0].received_bytes()) : 0;
  }
  return FromStatus(s);
}
