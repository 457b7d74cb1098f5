// UCX point-to-point transport for jaxcomm collectives. No XLA (and no UCX) types in this
// header: the FFI handlers include it and stay independent of UCX's headers.
//
// A UcxWorld is this process's slice of a world of `world_size` ranks. It hosts the global
// ranks in `local_ranks` (one per local JAX device). Each local rank owns one UCX worker with an
// endpoint to every world rank (including ranks in the same process and itself), so a
// collective running on the device thread of rank r only ever touches worker r.
//
// Threading: calls that name a local rank `self` (Isend/Irecv/WaitAll/SendRecv/Send/Recv) may
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

namespace jaxcomm::transport {

// ---- Tags -------------------------------------------------------------------------------
// 64-bit UCX tag layout (receives match all 64 bits, so two collectives or two steps can
// never take each other's messages):
//   bit  63     : channel (0 = collectives via MakeTag, 1 = control/test traffic)
//   bits 62..32 : collective sequence number, 31 bits (per-rank counter; wraps mod 2^31)
//   bits 31..16 : step within the collective, 16 bits (ring step, tree level, ...)
//   bits 15..0  : source (sending) world rank, 16 bits -> worlds of up to 65536 ranks
// The destination is implicit: each local rank has its own UCX worker.
inline constexpr int kTagSrcBits = 16;
inline constexpr int kTagStepBits = 16;
inline constexpr int kTagSeqBits = 31;
inline constexpr int kMaxWorldSize = 1 << kTagSrcBits;

constexpr uint64_t MakeTag(uint32_t seq, uint32_t step, uint32_t src) {
  return ((static_cast<uint64_t>(seq) & ((1ull << kTagSeqBits) - 1)) << 32) |
         ((static_cast<uint64_t>(step) & ((1ull << kTagStepBits) - 1)) << kTagSrcBits) |
         (static_cast<uint64_t>(src) & ((1ull << kTagSrcBits) - 1));
}
// Same layout on the control channel (bootstrap checks, tests, tools): never matches MakeTag.
constexpr uint64_t MakeControlTag(uint32_t seq, uint32_t step, uint32_t src) {
  return MakeTag(seq, step, src) | (1ull << 63);
}
constexpr uint32_t TagSeq(uint64_t tag) {
  return static_cast<uint32_t>((tag >> 32) & ((1ull << kTagSeqBits) - 1));
}
constexpr uint32_t TagStep(uint64_t tag) {
  return static_cast<uint32_t>((tag >> kTagSrcBits) & ((1ull << kTagStepBits) - 1));
}
constexpr uint32_t TagSource(uint64_t tag) {
  return static_cast<uint32_t>(tag & ((1ull << kTagSrcBits) - 1));
}
constexpr bool TagIsControl(uint64_t tag) { return (tag >> 63) != 0; }
// "seq 5 step 2 src 1" (with "control " in front on the control channel), for messages.
std::string DescribeTag(uint64_t tag);

// Per-local-rank traffic counters (completed operations only).
struct Counters {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
};

// A nonblocking send or receive. Move-only; complete it with UcxWorld::WaitAll. Destroying a
// request that is still pending cancels it (a receive) or lets UCX release it on completion
// (a send); the caller's buffer must then stay valid until the world is destroyed, so do not
// rely on that: always WaitAll.
class Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept { *this = std::move(other); }
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { Abandon(); }

  bool is_send() const { return kind_ == Kind::kSend; }
  bool is_recv() const { return kind_ == Kind::kRecv; }
  int peer() const { return peer_; }
  uint64_t tag() const { return tag_; }
  // Bytes actually received (<= capacity); valid after a successful WaitAll.
  size_t received_bytes() const { return received_; }

 private:
  friend class UcxWorld;
  enum class Kind : uint8_t { kNone, kSend, kRecv };
  void Abandon();
  // Files what UCX's `call` (ucp_tag_send_nbx or ucp_tag_recv_nbx) returned: done in place
  // (returns true: the caller counts the traffic), failed, or pending on a UCX request.
  bool Posted(void* ucp_result, const char* call);

  Kind kind_ = Kind::kNone;
  int self_ = -1;
  int peer_ = -1;
  uint64_t tag_ = 0;
  size_t bytes_ = 0;     // send size or receive capacity
  size_t received_ = 0;  // receive length once done
  bool done_ = true;
  int ucs_status_ = 0;  // ucs_status_t of the completed operation
  void* ucp_request_ = nullptr;
  void* worker_ = nullptr;  // ucp_worker_h, for Abandon()
  std::string error_;       // set when posting failed (reported by WaitAll)
};

class UcxWorld {
 public:
  // Creates the UCX context and one worker per local rank. `local_ranks` must be distinct and
  // in [0, world_size). Returns nullptr and sets *error on failure.
  static std::unique_ptr<UcxWorld> Create(int world_size, std::vector<int> local_ranks,
                                          std::string* error);
  // Cancels nothing (requests belong to their owners), closes endpoints (gracefully for a short
  // grace period, then forcibly: never hangs on dead peers), destroys workers and the context.
  ~UcxWorld();
  UcxWorld(const UcxWorld&) = delete;
  UcxWorld& operator=(const UcxWorld&) = delete;

  int world_size() const { return world_size_; }
  const std::vector<int>& local_ranks() const { return local_ranks_; }
  bool IsLocal(int rank) const { return LocalIndex(rank) >= 0; }
  // Which wait strategy the world uses ("wakeup" or "backoff"; env JAXCOMM_UCX_WAIT).
  const char* wait_mode_name() const;

  // Packed UCX worker address of local rank `rank` (opaque bytes to publish to the peers);
  // empty if `rank` is not local.
  std::string Address(int rank) const;

  // Creates endpoints from every local worker to every world rank. `addresses_by_world_rank`
  // holds Address(r) of every rank r, gathered from all processes. Nonblocking (wire-up
  // completes lazily during the first waits). Call once.
  bool Connect(const std::vector<std::string>& addresses_by_world_rank, std::string* error);

  // Posts a tagged send of `bytes` from `data` (kept alive and unchanged by the caller until
  // the request completes) from local rank `self` to world rank `peer`. TagSource(tag) must be
  // `self`. Posting errors are reported by WaitAll.
  Request Isend(int self, int peer, uint64_t tag, const void* data, size_t bytes);
  // Posts a receive of at most `capacity` bytes with exactly `tag` (TagSource(tag) == peer).
  // The message may be shorter than `capacity`; longer is an error (truncation).
  Request Irecv(int self, int peer, uint64_t tag, void* data, size_t capacity);

  // Progresses local rank `self`'s worker until all `requests` completed, the deadline passed
  // or a peer failed. Sleeps (does not spin a core) while idle. On failure the message names
  // `context`, the operation, the tag's seq/step and the peer; remaining requests are cancelled.
  Status WaitAll(int self, Request* requests, size_t count, Deadline deadline,
                 std::string_view context);
  Status WaitAll(int self, std::vector<Request>& requests, Deadline deadline,
                 std::string_view context) {
    return WaitAll(self, requests.data(), requests.size(), deadline, context);
  }

  // One ring step: send to `send_peer` while receiving from `recv_peer`.
  Status SendRecv(int self, int send_peer, uint64_t send_tag, const void* send_data,
                  size_t send_bytes, int recv_peer, uint64_t recv_tag, void* recv_data,
                  size_t recv_capacity, size_t* received, Deadline deadline,
                  std::string_view context);
  Status Send(int self, int peer, uint64_t tag, const void* data, size_t bytes, Deadline deadline,
              std::string_view context);
  Status Recv(int self, int peer, uint64_t tag, void* data, size_t capacity, size_t* received,
              Deadline deadline, std::string_view context);

  // Traffic of local rank `self` (zeros if not local).
  Counters GetCounters(int self) const;

  // ---- Shared memory (shm.h) -------------------------------------------------------------
  // True when this process can read world rank `peer`'s memory with ReadPeer (for local
  // ranks unless JAXCOMM_SHARED_MEMORY=0; for a rank of another process on this host after a
  // successful probe).
  bool SharesMemory(int peer) const { return shm_ && shm_->Shares(peer); }
  // The address of `pointer` as peers see it (pass it to them; they give it to ReadPeer).
  static uint64_t AddressOf(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); }
  // `address` of world rank `peer` as a pointer when the peer is in this process, else null
  // (then read it with ReadPeer).
  const void* LocalPointer(int peer, uint64_t address) const {
    return IsLocal(peer) ? reinterpret_cast<const void*>(static_cast<uintptr_t>(address)) : nullptr;
  }
  // SharedMemory::Read: `bytes` at `address` in world rank `peer`'s memory into `dst`.
  Status ReadPeer(int peer, uint64_t address, void* dst, size_t bytes,
                  std::string_view context) const {
    return shm_->Read(peer, address, dst, bytes, context);
  }
  // Notices (SharedMemory::Post and Wait): what a rank tells its group in a shared-memory
  // collective, kept apart for kNoticeSeqs collectives in a row.
  using Notice = SharedMemory::Notice;
  static constexpr uint32_t kNoticeSeqs = SharedMemory::kNoticeSeqs;
  void PostNotice(int self, uint32_t seq, uint32_t step, const Notice* notice) {
    shm_->Post(self, seq, step, notice);
  }
  Status WaitNotices(int self, const int* peers, size_t count, uint32_t seq, uint32_t step,
                     Notice* notices, Deadline deadline, std::string_view context) {
    return shm_->Wait(self, peers, count, seq, step, notices, deadline, context);
  }
  // Staging areas (SharedMemory::StagingArea): world rank `rank`'s area for collective `seq`,
  // or null.
  static constexpr uint32_t kStagingAreas = SharedMemory::kStagingAreas;
  static constexpr size_t kStagingBytes = SharedMemory::kStagingBytes;
  void* StagingArea(int rank, uint32_t seq) const { return shm_->StagingArea(rank, seq); }

  struct Impl;  // UCX state; public only so the .cc's callbacks can name it

 private:
  UcxWorld() = default;
  int LocalIndex(int rank) const;
  // Fills `r` (whose kind is set) and checks self, peer, connection and the tag's source.
  // Returns self's local index, or -1 with r completed as an invalid-argument failure.
  int StartRequest(Request& r, int self, int peer, uint64_t tag, size_t bytes) const;

  int world_size_ = 0;
  std::vector<int> local_ranks_;
  std::vector<int> local_index_of_rank_;  // world rank -> index into local_ranks_, or -1
  bool connected_ = false;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<SharedMemory> shm_;
};

}  // namespace jaxcomm::transport
