#include "ffi/direct_allreduce.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/transport/ucx_world.h"
#include "kernels/reduce.h"

namespace jaxcomm::collectives {
namespace {

// Elements per block of the fused reduction: three blocks (accumulator and two inputs read
// from other processes) of 256 KiB stay in a core's L2 (1 MiB on this machine).
constexpr int64_t kBlock = 1 << 16;

using Notice = transport::UcxWorld::Notice;

// Waits for group rank q's notice of `step` (ucx_world.h, "Notices") and checks that it
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

// Whether this call stages through shared areas (ucx_world.h, "Staging areas"): when a member
// lives in another process (process_vm_readv would pin every page it reads) and the vector
// fits. The same on every rank of the group: n is checked, the members are the same.
bool Staged(const Group& group, int64_t n) {
  return group.SpansProcesses() &&
         static_cast<size_t>(n) * sizeof(float) <= transport::UcxWorld::kStagingBytes &&
         group.StagingArea(group.rank()) != nullptr;
}

}  // namespace

ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n,
                               uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  const int64_t begin = ring::ChunkBegin(n, parts, rank);
  const int64_t end = ring::ChunkBegin(n, parts, rank + 1);
  // Staged: the peers read their slices of x from this rank's staging area, and this rank
  // writes its reduced slice there for them (as well as into out).
  float* const staging = Staged(group, n) ? group.StagingArea(rank) : nullptr;
  if (staging != nullptr) {
    TimedWork timed(group, Work::kCopy);
    std::memcpy(staging, x, sizeof(float) * begin);
    std::memcpy(staging + end, x + end, sizeof(float) * (n - end));
  }
  // Both addresses at once: the allgather's "my slice is final" then needs no payload.
  const uint32_t ready = (*step)++;
  const Notice mine{transport::UcxWorld::AddressOf(x), transport::UcxWorld::AddressOf(out), n};
  group.PostNotice(ready, &mine);
  std::vector<Notice> inputs(parts);  // rank q's, once waited for (`known`)
  std::vector<bool> known(parts, false);
  thread_local std::vector<float> acc, first, next;
  acc.resize(kBlock);
  first.resize(kBlock);
  next.resize(kBlock);
  // Rank q's x[at, at + len): a pointer into this process's memory (its x, or its staging
  // area), or a copy in `buffer`.
  auto source = [&](int q, int64_t at, int64_t len, float* buffer,
                    const float** data) -> ffi::Error {
    if (q == rank) {
      *data = x + at;
      return ffi::Error::Success();
    }
    if (!known[q]) {
      JAXCOMM_RETURN_IF_ERROR(WaitForPeer(group, q, n, ready, &inputs[q]));
      known[q] = true;
    }
    if (staging != nullptr) {
      *data = group.StagingArea(q) + at;
    } else if (const void* local = group.LocalPointer(q, inputs[q].input)) {
      *data = static_cast<const float*>(local) + at;
    } else {
      TimedWork timed(group, Work::kCopy);
      JAXCOMM_RETURN_IF_ERROR(
          group.ReadFrom(q, inputs[q].input + sizeof(float) * at, buffer, sizeof(float) * len));
      *data = buffer;
    }
    return ffi::Error::Success();
  };
  // The last addition writes the staging area, or `out` directly unless out is x itself
  // (then through `acc`).
  const bool aliased = out == x && staging == nullptr;
  uint64_t read_bytes = 0;
  for (int64_t at = begin; at < end; at += kBlock) {
    const int64_t len = std::min(kBlock, end - at);
    const float* a = nullptr;
    JAXCOMM_RETURN_IF_ERROR(source(0, at, len, first.data(), &a));
    if (parts == 1) {
      if (!aliased) std::memcpy(out + at, a, sizeof(float) * len);
      continue;
    }
    for (int q = 1; q < parts; ++q) {
      const float* b = nullptr;
      JAXCOMM_RETURN_IF_ERROR(source(q, at, len, next.data(), &b));
      float* const last = staging != nullptr ? staging + at : out + at;
      float* dst = (q == parts - 1 && !aliased) ? last : acc.data();
      TimedWork timed(group, Work::kReduce);
      if (q == 1) {
        kernels::Add(dst, a, b, len);
      } else if (dst == acc.data()) {
        kernels::AddInto(acc.data(), b, len);
      } else {
        kernels::Add(dst, acc.data(), b, len);
      }
    }
    if (aliased) std::memcpy(out + at, acc.data(), sizeof(float) * len);
    if (staging != nullptr) std::memcpy(out + at, staging + at, sizeof(float) * len);
    read_bytes += sizeof(float) * static_cast<uint64_t>(len) * (parts - 1);
  }
  // What the peers read of this rank's x: their slices.
  group.CountTraffic(sizeof(float) * static_cast<uint64_t>(n - (end - begin)), read_bytes);
  group.MarkPhase("reduce_scatter");
  return ffi::Error::Success();
}

ffi::Error DirectAllgather(Group& group, float* out, int64_t n, uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  // "Slice `rank` of my out is final" (and: I no longer read anyone's x). The addresses came
  // with DirectReduceScatter's notice and stay in the slot.
  const uint32_t final_step = (*step)++;
  group.PostNotice(final_step);
  const bool staged = Staged(group, n);  // as in DirectReduceScatter: same call, same n
  uint64_t read_bytes = 0;
  for (int k = 1; k < parts; ++k) {
    const int q = (rank + k) % parts;  // ranks start on different peers
    const int64_t at = ring::ChunkBegin(n, parts, q);
    const int64_t len = ring::ChunkSize(n, parts, q);
    Notice owner;
    JAXCOMM_RETURN_IF_ERROR(WaitForPeer(group, q, n, final_step, &owner));
    TimedWork timed(group, Work::kCopy);
    if (staged) {
      std::memcpy(out + at, group.StagingArea(q) + at, sizeof(float) * len);
    } else if (const void* local = group.LocalPointer(q, owner.output)) {
      std::memcpy(out + at, static_cast<const float*>(local) + at, sizeof(float) * len);
    } else {
      JAXCOMM_RETURN_IF_ERROR(
          group.ReadFrom(q, owner.output + sizeof(float) * at, out + at, sizeof(float) * len));
    }
    read_bytes += sizeof(float) * static_cast<uint64_t>(len);
  }
  const int64_t mine = ring::ChunkSize(n, parts, rank);
  group.CountTraffic(sizeof(float) * static_cast<uint64_t>(mine) * (parts - 1), read_bytes);
  // Nobody may return (and let XLA reuse its buffers, or the next call its staging area)
  // while a peer still copies from them.
  const uint32_t done_step = (*step)++;
  group.PostNotice(done_step);
  JAXCOMM_RETURN_IF_ERROR(group.WaitNotices(done_step, nullptr));
  group.MarkPhase("allgather");
  return ffi::Error::Success();
}

ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step) {
  const int rank = group.rank();
  const uint32_t address_step = (*step)++;
  const uint32_t done_step = (*step)++;
  if (group.size() == 1) return ffi::Error::Success();
  if (rank == root) {
    const Notice notice{0, transport::UcxWorld::AddressOf(out), n};
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
    if (const void* local = group.LocalPointer(root, notices[root].output)) {
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
  const Notice mine{transport::UcxWorld::AddressOf(x), transport::UcxWorld::AddressOf(out), n};
  group.PostNotice(ready, &mine);
  // Peers may read x itself (unstaged): when out is x, sum into `acc` and copy after the done
  // round.
  thread_local std::vector<float> acc, copied;
  const bool aliased = out == x && staging == nullptr;
  if (aliased) acc.resize(static_cast<size_t>(n));
  float* const sum = aliased ? acc.data() : out;
  for (int q = 0; q < parts; ++q) {
    // This rank's own x from its staging copy: with out == x, summing may overwrite x first.
    const float* input = staging != nullptr ? staging : x;
    if (q != rank) {
      Notice notice;
      JAXCOMM_RETURN_IF_ERROR(WaitForPeer(group, q, n, ready, &notice));
      if (staging != nullptr) {
        input = group.StagingArea(q);
      } else if (const void* local = group.LocalPointer(q, notice.input)) {
        input = static_cast<const float*>(local);
      } else {
        TimedWork timed(group, Work::kCopy);
        copied.resize(static_cast<size_t>(n));
        JAXCOMM_RETURN_IF_ERROR(group.ReadFrom(q, notice.input, copied.data(), sizeof(float) * n));
        input = copied.data();
      }
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

}  // namespace jaxcomm::collectives
