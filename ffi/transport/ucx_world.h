// The UCX implementation of the transport interface (transport.h), registered as "ucx"
// (registry.h). No XLA (and no UCX) types in this header; only ffi/transport/ names it.
//
// A UcxWorld is this process's slice of a world of `world_size` ranks. It hosts the global
// ranks in `local_ranks` (one per local JAX device). Each local rank owns one UCX worker with an
// endpoint to every world rank (including ranks in the same process and itself), so a
// collective running on the device thread of rank r only ever touches worker r.
//
// Threading: calls that name a local rank `self` (PostSend/PostRecv/Wait/SendRecv/Send/Recv) may
// run concurrently for *different* `self` values, from any OS thread, but never concurrently for
// the same `self` (the workers are UCS_THREAD_MODE_SERIALIZED). Create/Connect/destruction must
// not overlap with anything else. GetCounters() may be called from any thread at any time.
//
// Failure model: every wait has a deadline; on expiry, or when a peer's endpoint reports an
// error (peer process died), the wait returns an error naming the caller's context string, the
// tag's seq/step and the peer rank. A failed wait cancels its outstanding requests; a send that
// could not be cancelled force-closes the endpoint to that peer, so after a failure the link to
// that peer must be considered broken (collectives should fail the whole program).
//
// Shared memory between the ranks of one host (direct reads, notices, staging areas) is
// shm.h's SharedMemory, which a UcxWorld owns and offers next to its endpoints; the settings
// (JAXCOMM_TIMEOUT_S and the others) are read by settings.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ffi/transport/settings.h"
#include "ffi/transport/shm.h"
#include "ffi/transport/status.h"
#include "ffi/transport/transport.h"

namespace jaxcomm::transport {

struct LocalRank;  // one local rank's UCX worker and links (ucx_world.cc)

// Messages between host buffers over UCX's tag matching; same-host memory through an owned
// SharedMemory (shm.h).
class UcxWorld final : public Transport {
 public:
  // Creates the UCX context and one worker per local rank. `local_ranks` must be distinct and
  // in [0, world_size). Returns nullptr and sets *error on failure.
  static std::unique_ptr<UcxWorld> Create(int world_size, std::vector<int> local_ranks,
                                          std::string* error);
  // Cancels nothing (requests belong to their owners), closes endpoints (gracefully for a short
  // grace period, then forcibly: never hangs on dead peers), destroys workers and the context.
  ~UcxWorld() override;

  const char* name() const override { return "ucx"; }
  bool Accepts(MemoryKind kind) const override { return kind == MemoryKind::kHost; }
  // Which wait strategy the world uses ("wakeup" or "backoff"; env JAXCOMM_UCX_WAIT).
  const char* wait_mode_name() const override;

  // Packed UCX worker address of local rank `rank` (with shm.h's trailer); empty if `rank` is
  // not local.
  std::string Address(int rank) const override;
  // Creates endpoints from every local worker to every world rank. Nonblocking (wire-up
  // completes lazily during the first waits). Call once.
  bool Connect(const std::vector<std::string>& addresses_by_world_rank,
               std::string* error) override;

  Request PostSend(int self, int peer, uint64_t tag, const void* data, size_t bytes) override;
  Request PostRecv(int self, int peer, uint64_t tag, void* data, size_t capacity) override;
  // Progresses local rank `self`'s worker until all `requests` completed, the deadline passed
  // or a peer failed. Sleeps (does not spin a core) while idle.
  Status Wait(int self, Request* requests, size_t count, Deadline deadline,
              std::string_view context) override;
  using Transport::Wait;

  Counters GetCounters(int self) const override;

  struct Impl;  // UCX state; public only so the .cc's callbacks can name it

 protected:
  void Release(Request::State& state) override;

 private:
  UcxWorld() = default;
  // Fills `r` as this world's request of `kind` and checks self, peer, connection and the
  // tag's source. Returns self's local rank, or null with r completed as an invalid-argument
  // failure.
  LocalRank* StartRequest(Request::State& r, Request::Kind kind, int self, int peer, uint64_t tag,
                          size_t bytes);

  bool connected_ = false;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<SharedMemory> shm_;
};

}  // namespace jaxcomm::transport
