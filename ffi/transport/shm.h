// Shared memory between the ranks of one host: direct reads of a peer's buffers, notices and
// staging areas. No UCX (and no XLA) types; the UCX transport (ucx_world.h) owns one
// SharedMemory and offers it to the collectives next to its UCX endpoints (transport.h,
// "Same-host memory").
//
// Why. Bulk data between ranks of one host need not go through UCX: cross-process endpoints
// keep UCP_ERR_HANDLING_MODE_PEER (so a dead peer fails the waits), and in that mode UCX 1.22
// only selects tcp, i.e. two copies through the kernel's loopback. Instead, a rank may read a
// peer's memory directly: a plain load for ranks of this process (same address space), or one
// kernel copy with process_vm_readv (Linux cross-memory attach, as OpenMPI's and UCX's `cma`
// do) for a process on the same host. The collectives then exchange only buffer addresses and
// completion notices (below), which keep the failure detection. "Same host" means the same
// boot, PID, network and IPC namespaces (so the emulated cluster's nodes, each in its own
// namespaces, still talk through their shaped links), that a probe read of the peer succeeded
// at Connect, and that its notice segment could be mapped. Env JAXCOMM_SHARED_MEMORY=0 turns
// all of it off (everything goes through UCX, as before).
//
// Notices. The small messages of the shared-memory collectives (buffer addresses, "done")
// skip UCX too: UCX's tcp loopback costs a kernel round trip and a wakeup per message. Each
// process maps one memfd segment that holds its local ranks' notice slots, and every process
// of the host maps it too (through /proc/<pid>/fd; same permission as process_vm_readv). A
// rank posts (seq, step) into its own slot; peers wait for it with a short spin, then a futex.
// Failure stays bounded: a waiter checks the waited-for peers' processes (pidfd: readable once
// the process exited) at least every kNoticeCheckMs and fails naming the peer, and every wait
// has the deadline of a UCX wait.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ffi/transport/status.h"

namespace jaxcomm::transport {

struct NoticeSlot;  // shm.cc: one cache line of a notice segment

class SharedMemory {
 public:
  // What a rank tells its group in a shared-memory collective (ffi/direct_allreduce.h).
  struct Notice {
    uint64_t input = 0;  // addresses as Transport::AddressOf gives them
    uint64_t output = 0;
    int64_t elements = 0;
  };
  // Notices of up to kNoticeSeqs collectives in a row are kept apart (one slot per seq modulo
  // kNoticeSeqs): a caller must not post for seq s + kNoticeSeqs while a peer may still wait
  // for its seq s, which the collectives' closing "done" round guarantees.
  static constexpr uint32_t kNoticeSeqs = 8;
  // Staging areas: kStagingBytes of the same shared segment per rank and per seq parity,
  // mapped by every same-host process like the notice slots. A rank writes what its peers
  // must read into its own area and they read it with plain loads: process_vm_readv pins every
  // 4 KiB page it reads (several times slower than a memcpy of the same bytes), a mapping
  // does not. Two areas, so that the overlapping collectives of one call (the
  // hierarchical allreduce's node and cross-node groups: consecutive seqs) use different ones.
  static constexpr uint32_t kStagingAreas = 2;
  static constexpr size_t kStagingBytes = size_t{16} << 20;

  // Maps this process's notice segment for its local ranks (`local_index_of_rank`: world rank
  // -> index of the local rank, or -1). Without a memfd nothing is shared: Connect then leaves
  // every shared-memory path off. Waits spin for `spin_ns` before they sleep.
  SharedMemory(std::vector<int> local_index_of_rank, int64_t spin_ns);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  // Appends to the UCX address of the local rank with index `index` what a same-host peer
  // needs to share memory with it (host identity, pid, probe address, notice memfd, slot index).
  void AppendTrailer(size_t index, std::string* address) const;
  // Strips the trailer (AppendTrailer) from every address, by world rank, and decides which
  // ranks' memory this process can read. Returns "" or an error.
  std::string Connect(std::vector<std::string>* addresses);

  // True when this process can read world rank `peer`'s memory with Read (for local ranks
  // unless JAXCOMM_SHARED_MEMORY=0; for a rank of another process on this host after a
  // successful probe).
  bool Shares(int peer) const {
    return peer >= 0 && peer < static_cast<int>(shares_.size()) && shares_[peer];
  }
  // Copies `bytes` at `address` in world rank `peer`'s memory to `dst` (memcpy for a local
  // rank, process_vm_readv otherwise). Shares(peer) must hold. A peer process that is gone
  // gives kPeerFailed naming it.
  Status Read(int peer, uint64_t address, void* dst, size_t bytes, std::string_view context) const;

  // Local rank `self` reached step `step` of collective `seq`; with `notice`, it also
  // replaces what peers read from this rank for `seq` (without, the last one stays).
  void Post(int self, uint32_t seq, uint32_t step, const Notice* notice);
  // Waits until every rank in `peers` (world ranks, Shares) posted step `step` of `seq` or
  // later; `notices` (optional, parallel to `peers`) gets what each posted for `seq`. Fails
  // naming a peer whose process exited, or the peers that did not reach `step` by `deadline`.
  Status Wait(int self, const int* peers, size_t count, uint32_t seq, uint32_t step,
              Notice* notices, Deadline deadline, std::string_view context);

  // World rank `rank`'s staging area for collective `seq` (a rank of this process, or of a
  // process whose segment is mapped here), or null. Only `rank` itself writes it.
  void* StagingArea(int rank, uint32_t seq) const;

 private:
  bool IsLocal(int rank) const {
    return rank >= 0 && rank < static_cast<int>(local_index_of_rank_.size()) &&
           local_index_of_rank_[rank] >= 0;
  }

  std::vector<int> local_index_of_rank_;
  int64_t spin_ns_ = 0;
  // This process's segment (memfd, mapping) and, by world rank (set by Connect): whether its
  // memory is shared, its pid (same-host ranks of other processes, for process_vm_readv), the
  // first of its kNoticeSeqs slots (null where memory is not shared) and a pidfd of its process
  // (-1 for ranks of this process).
  int notice_fd_ = -1;
  void* segment_ = nullptr;
  size_t segment_bytes_ = 0;
  std::vector<bool> shares_;
  std::vector<int64_t> pids_;
  std::vector<NoticeSlot*> slots_;
  std::vector<int> pidfds_;
  std::vector<std::pair<void*, size_t>> peer_segments_;  // other processes' segments, mapped
};

}  // namespace jaxcomm::transport
