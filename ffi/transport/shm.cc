// Shared memory between the ranks of one host: see shm.h for the model.
#include "ffi/transport/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <new>

#include "ffi/transport/settings.h"

namespace jaxcomm::transport {

// ---- Notice slots (see "Notices" in shm.h) --------------------------------------------------
// One cache line per (rank, seq modulo kNoticeSeqs), in a MAP_SHARED memfd segment. The
// atomics are lock-free and address-free, so they work across the processes mapping it.
struct alignas(64) NoticeSlot {
  std::atomic<uint64_t> progress{0};  // NoticeKey(seq, step) last posted; 0 = nothing yet
  std::atomic<uint32_t> wake{0};      // futex word: bumped on every post
  std::atomic<uint32_t> sleepers{0};  // waiters inside futex(FUTEX_WAIT) on `wake`
  std::atomic<uint64_t> input{0}, output{0};
  std::atomic<int64_t> elements{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && sizeof(NoticeSlot) == 64);

namespace {

// ---- Address trailer --------------------------------------------------------------------
// AppendTrailer() appends to UCX's address: identity bytes, pid (8), probe address (8), notice
// memfd number (8), index of the rank's slots in it (8), identity length (4), kTrailerMagic (4).
// Connect() strips it again.
constexpr uint32_t kTrailerMagic = 0x4d43584b;  // "KXCM": the trailer with notice slots
constexpr size_t kTrailerFixed = 8 + 8 + 8 + 8 + 4 + 4;

// How often a waiter asleep on a futex wakes to check its peers' processes and the deadline.
constexpr int kNoticeCheckMs = 10;
// (seq, step) as one number that grows along a rank's program: seq has 31 bits, step 16.
constexpr int kNoticeKeyBits = 47;
uint64_t NoticeKey(uint32_t seq, uint32_t step) {
  return ((static_cast<uint64_t>(seq) << 16) | (step & 0xffffu)) &
         ((uint64_t{1} << kNoticeKeyBits) - 1);
}
// Whether `posted` is `wanted` or later, across the wrap of seq at 2^31.
bool NoticeReached(uint64_t posted, uint64_t wanted) {
  if (posted == 0) return false;
  return ((posted - wanted) & ((uint64_t{1} << kNoticeKeyBits) - 1)) <
         (uint64_t{1} << (kNoticeKeyBits - 1));
}
// A process's segment holds one block per local rank (in local-rank order): the rank's notice
// slots, padded to kNoticeBlockBytes, then its kStagingAreas staging areas. Pages are only
// backed once touched (a staging area costs what the collectives write into it).
constexpr size_t kNoticeBlockBytes = 4096;
static_assert(SharedMemory::kNoticeSeqs * sizeof(NoticeSlot) <= kNoticeBlockBytes);
constexpr size_t kRankBlockBytes =
    kNoticeBlockBytes + SharedMemory::kStagingAreas * SharedMemory::kStagingBytes;
size_t NoticeSegmentBytes(size_t local_ranks) { return local_ranks * kRankBlockBytes; }
NoticeSlot* RankBlock(void* segment, size_t index) {
  return reinterpret_cast<NoticeSlot*>(static_cast<char*>(segment) + index * kRankBlockBytes);
}
// Maps process `pid`'s notice segment (its memfd `fd`) into this process; null on failure.
void* MapNoticeSegment(int64_t pid, int64_t fd, size_t* bytes) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int opened = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) return nullptr;
  struct stat info {};
  void* segment = nullptr;
  if (fstat(opened, &info) == 0 && info.st_size > 0) {
    *bytes = static_cast<size_t>(info.st_size);
    segment = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
    if (segment == MAP_FAILED) segment = nullptr;
  }
  close(opened);  // the mapping keeps the memory
  return segment;
}
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// What a peer reads at Connect to prove it can read this process's memory.
constexpr uint64_t kProbeValue = 0x216d6d6f6378616aull;  // "jaxcomm!"
const volatile uint64_t g_probe = kProbeValue;

// Boot id and the PID, network and IPC namespaces: ranks with equal identities share a host
// as far as jaxcomm is concerned. Empty when unknown (then nothing is shared).
std::string HostIdentity() {
  std::string identity;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (!(boot >> boot_id)) return "";
  identity = boot_id;
  for (const char* ns : {"/proc/self/ns/pid", "/proc/self/ns/net", "/proc/self/ns/ipc"}) {
    char link[128];
    const ssize_t length = readlink(ns, link, sizeof(link));
    if (length <= 0) return "";
    identity += "|" + std::string(link, static_cast<size_t>(length));
  }
  return identity;
}

// Copies `bytes` from `address` in process `pid` into `dst`; returns 0 or an errno.
int ReadProcess(int64_t pid, uint64_t address, void* dst, size_t bytes) {
  auto* out = static_cast<char*>(dst);
  while (bytes > 0) {
    iovec local{out, bytes};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(address)), bytes};
    const ssize_t got = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EFAULT;
    out += got;
    address += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
  return 0;
}

}  // namespace

SharedMemory::SharedMemory(std::vector<int> local_index_of_rank, int64_t spin_ns)
    : local_index_of_rank_(std::move(local_index_of_rank)), spin_ns_(spin_ns) {
  const size_t locals =
      static_cast<size_t>(std::count_if(local_index_of_rank_.begin(), local_index_of_rank_.end(),
                                        [](int index) { return index >= 0; }));
  segment_bytes_ = NoticeSegmentBytes(locals);
  notice_fd_ = memfd_create("jaxcomm-notices", MFD_CLOEXEC);
  if (notice_fd_ >= 0 && ftruncate(notice_fd_, static_cast<off_t>(segment_bytes_)) == 0) {
    void* segment =
        mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, notice_fd_, 0);
    if (segment != MAP_FAILED) {
      segment_ = segment;
      for (size_t i = 0; i < locals; ++i) {
        NoticeSlot* slots = RankBlock(segment, i);
        for (uint32_t k = 0; k < kNoticeSeqs; ++k) new (&slots[k]) NoticeSlot();
      }
    }
  }
}

SharedMemory::~SharedMemory() {
  for (auto& [segment, bytes] : peer_segments_) munmap(segment, bytes);
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
  if (segment_ != nullptr) munmap(segment_, segment_bytes_);
  if (notice_fd_ >= 0) close(notice_fd_);
}

void SharedMemory::AppendTrailer(size_t index, std::string* address) const {
  const std::string identity = HostIdentity();
  const int64_t pid = getpid();
  const uint64_t probe = reinterpret_cast<uintptr_t>(const_cast<const uint64_t*>(&g_probe));
  const int64_t notice_fd = segment_ != nullptr ? notice_fd_ : -1;
  const auto slot_index = static_cast<int64_t>(index);
  const auto identity_length = static_cast<uint32_t>(identity.size());
  std::string& bytes = *address;
  bytes += identity;
  bytes.append(reinterpret_cast<const char*>(&pid), 8);
  bytes.append(reinterpret_cast<const char*>(&probe), 8);
  bytes.append(reinterpret_cast<const char*>(&notice_fd), 8);
  bytes.append(reinterpret_cast<const char*>(&slot_index), 8);
  bytes.append(reinterpret_cast<const char*>(&identity_length), 4);
  bytes.append(reinterpret_cast<const char*>(&kTrailerMagic), 4);
}

std::string SharedMemory::Connect(std::vector<std::string>* addresses) {
  const int world_size = static_cast<int>(addresses->size());
  shares_.assign(world_size, false);
  pids_.assign(world_size, -1);
  const std::string my_identity = HostIdentity();
  const bool enabled = SharedMemoryEnabled() && segment_ != nullptr;
  slots_.assign(world_size, nullptr);
  pidfds_.assign(world_size, -1);
  // Other processes' notice segments (mapping, bytes), mapped once per process.
  std::map<int64_t, std::pair<void*, size_t>> segment_of_pid;
  const bool cross_process = enabled && !my_identity.empty();
  for (int r = 0; r < world_size; ++r) {
    std::string& a = (*addresses)[r];
    uint32_t magic = 0, identity_length = 0;
    if (a.size() >= kTrailerFixed) std::memcpy(&magic, a.data() + a.size() - 4, 4);
    if (magic == kTrailerMagic) {
      std::memcpy(&identity_length, a.data() + a.size() - 8, 4);
      if (a.size() < kTrailerFixed + identity_length) return "malformed address trailer";
      const size_t at = a.size() - kTrailerFixed - identity_length;
      const std::string identity = a.substr(at, identity_length);
      int64_t pid = -1, notice_fd = -1, slot_index = -1;
      uint64_t probe = 0;
      std::memcpy(&pid, a.data() + at + identity_length, 8);
      std::memcpy(&probe, a.data() + at + identity_length + 8, 8);
      std::memcpy(&notice_fd, a.data() + at + identity_length + 16, 8);
      std::memcpy(&slot_index, a.data() + at + identity_length + 24, 8);
      a.resize(at);
      if (!enabled) {
        shares_[r] = false;
      } else if (IsLocal(r)) {
        shares_[r] = true;
        slots_[r] = RankBlock(segment_, local_index_of_rank_[r]);
      } else if (cross_process && identity == my_identity && pid > 0 && notice_fd >= 0 &&
                 slot_index >= 0) {
        uint64_t seen = 0;
        pids_[r] = pid;
        auto& [segment, segment_bytes] = segment_of_pid[pid];
        if (segment == nullptr) segment = MapNoticeSegment(pid, notice_fd, &segment_bytes);
        const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
        const size_t block_end = (static_cast<size_t>(slot_index) + 1) * kRankBlockBytes;
        shares_[r] = ReadProcess(pid, probe, &seen, sizeof(seen)) == 0 && seen == kProbeValue &&
                     segment != nullptr && block_end <= segment_bytes && pidfd >= 0;
        if (shares_[r]) {
          slots_[r] = RankBlock(segment, static_cast<size_t>(slot_index));
          pidfds_[r] = pidfd;
        } else if (pidfd >= 0) {
          close(pidfd);
        }
      }
    } else {
      shares_[r] = enabled && IsLocal(r);
    }
  }
  for (auto& [pid, mapped] : segment_of_pid) {
    if (mapped.first != nullptr) peer_segments_.push_back(mapped);
  }
  return "";
}

Status SharedMemory::Read(int peer, uint64_t address, void* dst, size_t bytes,
                          std::string_view context) const {
  if (!Shares(peer)) {
    return Status(StatusCode::kInvalidArgument, std::string(context) + ": rank " +
                                                    std::to_string(peer) +
                                                    " does not share memory with this process");
  }
  if (bytes == 0) return Status::Ok();
  if (IsLocal(peer)) {
    std::memcpy(dst, reinterpret_cast<const void*>(static_cast<uintptr_t>(address)), bytes);
    return Status::Ok();
  }
  const int error = ReadProcess(pids_[peer], address, dst, bytes);
  if (error == 0) return Status::Ok();
  if (error == ESRCH) {
    return Status(StatusCode::kPeerFailed, std::string(context) + ": peer rank " +
                                               std::to_string(peer) + " failed (process " +
                                               std::to_string(pids_[peer]) + " is gone)");
  }
  return Status(StatusCode::kInternal, std::string(context) + ": reading " + std::to_string(bytes) +
                                           " bytes of peer rank " + std::to_string(peer) +
                                           "'s memory failed: " + std::strerror(error));
}

void* SharedMemory::StagingArea(int rank, uint32_t seq) const {
  if (rank < 0 || rank >= static_cast<int>(slots_.size()) || slots_[rank] == nullptr) {
    return nullptr;
  }
  return reinterpret_cast<char*>(slots_[rank]) + kNoticeBlockBytes +
         (seq % kStagingAreas) * kStagingBytes;
}

void SharedMemory::Post(int self, uint32_t seq, uint32_t step, const Notice* notice) {
  NoticeSlot* slots = IsLocal(self) && !slots_.empty() ? slots_[self] : nullptr;
  if (slots == nullptr) return;  // Wait of the peers fails on their side
  NoticeSlot& slot = slots[seq % kNoticeSeqs];
  if (notice != nullptr) {
    // Read by peers only after they saw `progress` (seq_cst below orders these before it).
    slot.input.store(notice->input, std::memory_order_relaxed);
    slot.output.store(notice->output, std::memory_order_relaxed);
    slot.elements.store(notice->elements, std::memory_order_relaxed);
  }
  slot.progress.store(NoticeKey(seq, step));
  // A waiter registers in `sleepers` before its last look at `progress` and sleeps only while
  // `wake` is unchanged, so either it sees this post or this sees it and wakes it.
  slot.wake.fetch_add(1);
  if (slot.sleepers.load() > 0) FutexWakeAll(&slot.wake);
}

Status SharedMemory::Wait(int self, const int* peers, size_t count, uint32_t seq, uint32_t step,
                          Notice* notices, Deadline deadline, std::string_view context) {
  const uint64_t wanted = NoticeKey(seq, step);
  auto where = [&] {
    return " while rank " + std::to_string(self) + " waited for seq " + std::to_string(seq) +
           " step " + std::to_string(step);
  };
  for (size_t i = 0; i < count; ++i) {
    if (!IsLocal(self) || peers[i] < 0 || peers[i] >= static_cast<int>(slots_.size()) ||
        slots_[peers[i]] == nullptr) {
      return Status(StatusCode::kInvalidArgument,
                    std::string(context) + ": rank " + std::to_string(peers[i]) +
                        " has no notice slot shared with rank " + std::to_string(self));
    }
  }
  auto slot_of = [&](size_t i) -> NoticeSlot& { return slots_[peers[i]][seq % kNoticeSeqs]; };
  size_t next = 0;  // peers before `next` have reached the step
  const Deadline spin_until = Clock::now() + std::chrono::nanoseconds(spin_ns_);
  for (;;) {
    while (next < count && NoticeReached(slot_of(next).progress.load(), wanted)) ++next;
    if (next == count) break;
    const Deadline now = Clock::now();
    if (now < spin_until) {
      sched_yield();
      continue;
    }
    // Dead processes first: their slots will never move.
    for (size_t i = next; i < count; ++i) {
      const int pidfd = pidfds_[peers[i]];
      if (pidfd < 0) continue;
      pollfd exited{pidfd, POLLIN, 0};
      if (poll(&exited, 1, 0) > 0) {
        return Status(StatusCode::kPeerFailed,
                      std::string(context) + ": peer rank " + std::to_string(peers[i]) +
                          " failed (its process " + std::to_string(pids_[peers[i]]) + " exited)" +
                          where());
      }
    }
    if (now >= deadline) {
      std::string late;
      for (size_t i = next; i < count; ++i) {
        if (!NoticeReached(slot_of(i).progress.load(), wanted)) {
          late += (late.empty() ? "" : ", ") + std::to_string(peers[i]);
        }
      }
      return Status(StatusCode::kDeadlineExceeded, std::string(context) + ": deadline exceeded" +
                                                       where() + "; waiting on peer rank(s) " +
                                                       late +
                                                       " (default timeout: env JAXCOMM_TIMEOUT_S)");
    }
    NoticeSlot& slot = slot_of(next);
    const uint32_t seen = slot.wake.load();
    slot.sleepers.fetch_add(1);
    if (!NoticeReached(slot.progress.load(), wanted)) {
      const int64_t remaining_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count() + 1;
      FutexWait(&slot.wake, seen, std::min<int64_t>(remaining_ns, kNoticeCheckMs * 1000000));
    }
    slot.sleepers.fetch_sub(1);
  }
  if (notices != nullptr) {
    for (size_t i = 0; i < count; ++i) {
      const NoticeSlot& slot = slot_of(i);
      notices[i] = {slot.input.load(std::memory_order_relaxed),
                    slot.output.load(std::memory_order_relaxed),
                    slot.elements.load(std::memory_order_relaxed)};
    }
  }
  return Status::Ok();
}

}  // namespace jaxcomm::transport
