#include "ffi/direct_allreduce.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/transport/transport.h"
#include "kernels/half.h"
#include "kernels/reduce.h"

namespace jaxcomm::collectives {
namespace {

// Elements per block of the fused reduction: three blocks (accumulator and two inputs read
// from other processes) of 256 KiB stay in a core's L2 (1 MiB on this machine). 16-bit
// inputs make half as many bytes per block, with a float32 accumulator of the same size.
constexpr int64_t kBlock = 1 << 16;

using Notice = transport::Transport::Notice;

// Waits for group rank q's notice of `step` (ffi/transport/shm.h, "Notices") and checks that it
// passed `n` elements before this rank reads a byte of its memory. One peer at a time, so a
// rank starts on the peers that are ready while the others still work.
ffi::Error WaitForPeer(Group& group, int q, int64_t n, uint32_t step, Notice* notice) {
  std::vector<Notice> notices;
  JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(step, &notices, q));
  if (notices[q].elements != n) {
    return ffi::Error::InvalidArgument(
        std::string(group.name()) + ": group rank " + std::to_string(q) + " passed " +
        std::to_string(notices[q].elements) + " elements where group rank " +
        std::to_string(group.rank()) + " passed " + std::to_string(n) +
        "; every rank must pass an array of the same shape and dtype");
  }
  *notice = notices[q];
  return ffi::Error::Success();
}

// Whether this call stages n elements of T through shared areas (ffi/transport/shm.h, "Staging
// areas"): when a member lives in another process (process_vm_readv would pin every page it
// reads) and the vector fits. The same on every rank of the group: n is checked, the members
// are the same.
template <typename T = float>
bool Staged(const Group& group, int64_t n) {
  return group.SpansProcesses() &&
         static_cast<size_t>(n) * sizeof(T) <= transport::Transport::kStagingBytes &&
         group.StagingArea(group.rank()) != nullptr;
}

// The peers' inputs during a reduce-scatter: rank q's x[at, at + len) as a pointer into this
// process's memory (this rank's x, a peer's staging area, the x of a rank of this process),
// or read into the caller's `buffer` (process_vm_readv). Waits for q's "here are my buffers"
// notice of `step` the first time it is asked for q.
template <typename T>
class PeerInputs {
 public:
  PeerInputs(Group& group, const T* x, int64_t n, uint32_t step, bool staged)
      : group_(group),
        x_(x),
        n_(n),
        step_(step),
        staged_(staged),
        notices_(group.size()),
        known_(group.size(), false) {}

  ffi::Error Get(int q, int64_t at, int64_t len, T* buffer, const T** data) {
    if (q == group_.rank()) {
      *data = x_ + at;
      return ffi::Error::Success();
    }
    if (!known_[q]) {
      JAXCOMM_RETURN_IF_ERROR(WaitForPeer(group_, q, n_, step_, &notices_[q]));
      known_[q] = true;
    }
    if (staged_) {
      *data = group_.StagingArea<T>(q) + at;
    } else if (const void* local = group_.LocalPointer(q, notices_[q].input)) {
      *data = static_cast<const T*>(local) + at;
    } else {
      TimedWork timed(group_, Work::kCopy);
      JAXCOMM_RETURN_IF_ERROR(
          group_.ReadFrom(q, notices_[q].input + sizeof(T) * at, buffer, sizeof(T) * len));
      *data = buffer;
    }
    return ffi::Error::Success();
  }

 private:
  Group& group_;
  const T* x_;
  int64_t n_;
  uint32_t step_;
  bool staged_;
  std::vector<Notice> notices_;  // rank q's, once waited for (known_)
  std::vector<bool> known_;
};

// DirectReduceScatter over elements of T. `sum_block(inputs, at, len, dst, also)` writes the
// sum over every group rank q (inputs.Get, in rank order) of x_q[at, at + len) into dst[0, len)
// and, when `also` is not null, into also[0, len) too, in the same pass where it can; neither
// aliases an input. dst is this rank's staging area when staged (peers read the slice there;
// `also` is then out, unless out is x, which may still be an input: then a copy after), else
// out itself unless out is x (then a bounce block: x is still being read).
template <typename T, typename SumBlock>
ffi::Error ReduceScatter(Group& group, const T* x, T* out, int64_t n, uint32_t* step,
                         SumBlock&& sum_block) {
  const int parts = group.size();
  const int rank = group.rank();
  const int64_t begin = ring::ChunkBegin(n, parts, rank);
  const int64_t end = ring::ChunkBegin(n, parts, rank + 1);
  // Staged: the peers read their slices of x from this rank's staging area, and this rank
  // writes its reduced slice there for them (as well as into out).
  T* const staging = Staged<T>(group, n) ? group.StagingArea<T>(rank) : nullptr;
  if (staging != nullptr) {
    TimedWork timed(group, Work::kCopy);
    std::memcpy(staging, x, sizeof(T) * begin);
    std::memcpy(staging + end, x + end, sizeof(T) * (n - end));
  }
  // Both addresses at once: the allgather's "my slice is final" then needs no payload.
  const uint32_t ready = (*step)++;
  const Notice mine{transport::Transport::AddressOf(x), transport::Transport::AddressOf(out), n};
  group.PostNotice(ready, &mine);
  PeerInputs<T> inputs(group, x, n, ready, staging != nullptr);
  const bool aliased = out == x && staging == nullptr;
  thread_local std::vector<T> bounce;
  if (aliased) bounce.resize(kBlock);
  uint64_t read_bytes = 0;
  for (int64_t at = begin; at < end; at += kBlock) {
    const int64_t len = std::min(kBlock, end - at);
    if (parts == 1) {
      if (!aliased) std::memcpy(out + at, x + at, sizeof(T) * len);
      continue;
    }
    T* const dst = staging != nullptr ? staging + at : aliased ? bounce.data() : out + at;
    T* const also = staging != nullptr && out != x ? out + at : nullptr;
    JAXCOMM_RETURN_IF_ERROR(sum_block(inputs, at, len, dst, also));
    if (dst != out + at && also == nullptr) std::memcpy(out + at, dst, sizeof(T) * len);
    read_bytes += sizeof(T) * static_cast<uint64_t>(len) * (parts - 1);
  }
  // What the peers read of this rank's x: their slices.
  group.CountTraffic(sizeof(T) * static_cast<uint64_t>(n - (end - begin)), read_bytes);
  group.MarkPhase("reduce_scatter");
  return ffi::Error::Success();
}

// DirectAllgather over elements of T (bytes: nothing is added).
template <typename T>
ffi::Error Allgather(Group& group, T* out, int64_t n, uint32_t* step, bool rewritten) {
  const int parts = group.size();
  const int rank = group.rank();
  const bool staged = Staged<T>(group, n);  // as in the reduce-scatter: same call, same n
  if (staged && rewritten) {
    // Peers read slice `rank` of this area only after the notice below (the reduce-scatter
    // read the other slices), so it may change until then.
    TimedWork timed(group, Work::kCopy);
    const int64_t begin = ring::ChunkBegin(n, parts, rank);
    std::memcpy(group.StagingArea<T>(rank) + begin, out + begin,
                sizeof(T) * ring::ChunkSize(n, parts, rank));
  }
  // "Slice `rank` of my out is final" (and: I no longer read anyone's x). The addresses came
  // with the reduce-scatter's notice and stay in the slot.
  const uint32_t final_step = (*step)++;
  group.PostNotice(final_step);
  uint64_t read_bytes = 0;
  for (int k = 1; k < parts; ++k) {
    const int q = (rank + k) % parts;  // ranks start on different peers
    const int64_t at = ring::ChunkBegin(n, parts, q);
    const int64_t len = ring::ChunkSize(n, parts, q);
    Notice owner;
    JAXCOMM_RETURN_IF_ERROR(WaitForPeer(group, q, n, final_step, &owner));
    TimedWork timed(group, Work::kCopy);
    if (staged) {
      std::memcpy(out + at, group.StagingArea<T>(q) + at, sizeof(T) * len);
    } else if (const void* local = group.LocalPointer(q, owner.output)) {
      std::memcpy(out + at, static_cast<const T*>(local) + at, sizeof(T) * len);
    } else {
      JAXCOMM_RETURN_IF_ERROR(
          group.ReadFrom(q, owner.output + sizeof(T) * at, out + at, sizeof(T) * len));
    }
    read_bytes += sizeof(T) * static_cast<uint64_t>(len);
  }
  const int64_t mine = ring::ChunkSize(n, parts, rank);
  group.CountTraffic(sizeof(T) * static_cast<uint64_t>(mine) * (parts - 1), read_bytes);
  // Nobody may return (and let XLA reuse its buffers, or the next call its staging area)
  // while a peer still copies from them.
  const uint32_t done_step = (*step)++;
  group.PostNotice(done_step);
  JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(done_step, nullptr));
  group.MarkPhase("allgather");
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n,
                               uint32_t* step) {
  const int parts = group.size();
  thread_local std::vector<float> acc, first, next;
  acc.resize(kBlock);
  first.resize(kBlock);
  next.resize(kBlock);
  // Fused with the reads: the first addition writes acc from two inputs, the last one writes
  // dst, and `also` in the same pass (no separate pass to copy anything).
  auto sum_block = [&](PeerInputs<float>& inputs, int64_t at, int64_t len, float* dst,
                       float* also) -> ffi::Error {
    const float* a = nullptr;
    JAXCOMM_RETURN_IF_ERROR(inputs.Get(0, at, len, first.data(), &a));
    for (int q = 1; q < parts; ++q) {
      const float* b = nullptr;
      JAXCOMM_RETURN_IF_ERROR(inputs.Get(q, at, len, next.data(), &b));
      const bool last = q == parts - 1;
      const float* const so_far = q == 1 ? a : acc.data();
      TimedWork timed(group, Work::kReduce);
      if (last && also != nullptr) {
        kernels::AddTwice(dst, also, so_far, b, len);
      } else if (last || q == 1) {
        kernels::Add(last ? dst : acc.data(), so_far, b, len);
      } else {
        kernels::AddInto(acc.data(), b, len);
      }
    }
    return ffi::Error::Success();
  };
  return ReduceScatter(group, x, out, n, step, sum_block);
}

ffi::Error DirectAllgather(Group& group, float* out, int64_t n, uint32_t* step, bool rewritten) {
  return Allgather(group, out, n, step, rewritten);
}

ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step) {
  const int rank = group.rank();
  const uint32_t address_step = (*step)++;
  const uint32_t done_step = (*step)++;
  if (group.size() == 1) return ffi::Error::Success();
  // Staged: the root's result goes through its staging area, read with plain loads (the
  // area is free: see the header). Every rank decides alike (Staged).
  const bool staged = Staged(group, n);
  if (rank == root) {
    if (staged) {
      TimedWork timed(group, Work::kCopy);
      std::memcpy(group.StagingArea(root), out, sizeof(float) * n);
    }
    const Notice notice{0, transport::Transport::AddressOf(out), n};
    group.PostNotice(address_step, &notice);
    JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(done_step, nullptr, -1));
    group.CountTraffic(sizeof(float) * static_cast<uint64_t>(n) * (group.size() - 1), 0);
    return ffi::Error::Success();
  }
  // The hierarchical allreduce's phases before this one checked the element counts.
  std::vector<Notice> notices;
  JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(address_step, &notices, root));
  {
    TimedWork timed(group, Work::kCopy);
    if (staged) {
      std::memcpy(out, group.StagingArea(root), sizeof(float) * n);
    } else if (const void* local = group.LocalPointer(root, notices[root].output)) {
      std::memcpy(out, local, sizeof(float) * n);
    } else {
      JAXCOMM_RETURN_IF_ERROR(group.ReadFrom(root, notices[root].output, out, sizeof(float) * n));
    }
  }
  group.CountTraffic(0, sizeof(float) * static_cast<uint64_t>(n));
  group.PostNotice(done_step);
  return ffi::Error::Success();
}

ffi::Error DirectAllreduce(Group& group, const float* x, float* out, int64_t n) {
  uint32_t step = 0;
  JAXCOMM_RETURN_IF_ERROR(DirectReduceScatter(group, x, out, n, &step));
  return DirectAllgather(group, out, n, &step);
}

ffi::Error DirectAllreduceOneShot(Group& group, const float* x, float* out, int64_t n) {
  const int parts = group.size();
  const int rank = group.rank();
  float* const staging = Staged(group, n) ? group.StagingArea(rank) : nullptr;
  if (staging != nullptr) {
    TimedWork timed(group, Work::kCopy);
    std::memcpy(staging, x, sizeof(float) * n);
  }
  uint32_t step = 0;
  const uint32_t ready = step++;
  const Notice mine{transport::Transport::AddressOf(x), transport::Transport::AddressOf(out), n};
  group.PostNotice(ready, &mine);
  PeerInputs<float> inputs(group, x, n, ready, staging != nullptr);
  // Peers may read x itself (unstaged): when out is x, sum into `acc` and copy after the done
  // round.
  thread_local std::vector<float> acc, copied;
  const bool aliased = out == x && staging == nullptr;
  if (aliased) acc.resize(static_cast<size_t>(n));
  // Read with process_vm_readv (unstaged peers of another process) into `copied`.
  if (staging == nullptr && group.SpansProcesses()) copied.resize(static_cast<size_t>(n));
  float* const sum = aliased ? acc.data() : out;
  for (int q = 0; q < parts; ++q) {
    const float* input = nullptr;
    if (q == rank && staging != nullptr) {
      input = staging;  // its own copy: with out == x, summing may overwrite x first
    } else {
      JAXCOMM_RETURN_IF_ERROR(inputs.Get(q, 0, n, copied.data(), &input));
    }
    TimedWork timed(group, Work::kReduce);
    if (q == 0) {
      if (input != sum) std::memcpy(sum, input, sizeof(float) * n);
    } else {
      kernels::AddInto(sum, input, n);  // ((x0 + x1) + x2) + ...: rank order on every rank
    }
  }
  const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(n) * (parts - 1);
  group.CountTraffic(bytes, bytes);  // every peer reads all of this rank's x, and vice versa
  const uint32_t done_step = step++;
  group.PostNotice(done_step);
  JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(done_step, nullptr));
  if (aliased) std::memcpy(out, acc.data(), sizeof(float) * n);
  group.MarkPhase("oneshot");
  return ffi::Error::Success();
}

ffi::Error DirectHalfAllreduce(Group& group, kernels::HalfFormat format, const uint16_t* x,
                               uint16_t* out, int64_t n) {
  const int parts = group.size();
  thread_local std::vector<float> acc;
  thread_local std::vector<uint16_t> buffer;
  acc.resize(kBlock);
  buffer.resize(kBlock);
  // As HalfAllreduce's owner does (ffi/allreduce_half.cc): widen and add every rank's
  // contribution in rank order into a float32 sum that starts at +0 (so that -0 inputs give
  // the ring's +0, bit for bit), then round once.
  auto sum_block = [&](PeerInputs<uint16_t>& inputs, int64_t at, int64_t len, uint16_t* dst,
                       uint16_t* also) -> ffi::Error {
    std::fill_n(acc.data(), len, 0.0f);
    for (int q = 0; q < parts; ++q) {
      const uint16_t* part = nullptr;
      JAXCOMM_RETURN_IF_ERROR(inputs.Get(q, at, len, buffer.data(), &part));
      TimedWork timed(group, Work::kReduce);
      kernels::AddHalfInto(format, acc.data(), part, len);
    }
    TimedWork timed(group, Work::kReduce);
    kernels::FloatToHalf(format, acc.data(), dst, len);
    if (also != nullptr) std::memcpy(also, dst, sizeof(uint16_t) * len);  // dst is in cache
    return ffi::Error::Success();
  };
  uint32_t step = 0;
  JAXCOMM_RETURN_IF_ERROR(ReduceScatter(group, x, out, n, &step, sum_block));
  return Allgather(group, out, n, &step, false);
}

}  // namespace jaxcomm::collectives
