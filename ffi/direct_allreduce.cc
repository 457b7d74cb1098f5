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

// What ranks tell each other: a buffer address and the element count, which every rank
// checks against its own before it reads a byte of a peer's memory.
struct Notice {
  uint64_t address = 0;
  int64_t elements = 0;
};

// Sends {value, n} to every other rank and receives theirs; (*values)[q] gets rank q's address
// (step `step`). Fails, naming the peer, when a rank's element count differs.
ffi::Error ExchangeAddress(Group& group, uint64_t value, int64_t n, std::vector<uint64_t>* values,
                           uint32_t step) {
  const int parts = group.size();
  const int rank = group.rank();
  std::vector<Notice> notices(parts);
  notices[rank] = {value, n};
  std::vector<transport::Request> requests;
  requests.reserve(2 * (parts - 1));
  for (int q = 0; q < parts; ++q) {
    if (q != rank) requests.push_back(group.PostRecv(q, &notices[q], sizeof(Notice), step));
  }
  for (int q = 0; q < parts; ++q) {
    if (q != rank) requests.push_back(group.PostSend(q, &notices[rank], sizeof(Notice), step));
  }
  JAXCOMM_RETURN_IF_ERROR(group.Wait(requests.data(), requests.size()));
  values->assign(parts, 0);
  for (int q = 0; q < parts; ++q) {
    if (notices[q].elements != n) {
      return ffi::Error::InvalidArgument(
          std::string(group.name()) + ": group rank " + std::to_string(q) + " passed " +
          std::to_string(notices[q].elements) + " elements where group rank " +
          std::to_string(rank) + " passed " + std::to_string(n) +
          "; every rank must pass an array of the same shape and dtype");
    }
    (*values)[q] = notices[q].address;
  }
  return ffi::Error::Success();
}

// A notice without an address: every rank tells every other one it reached `step`.
ffi::Error Notify(Group& group, int64_t n, uint32_t step) {
  std::vector<uint64_t> ignored;
  return ExchangeAddress(group, 0, n, &ignored, step);
}

}  // namespace

ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n,
                               DirectPeers* peers, uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  JAXCOMM_RETURN_IF_ERROR(
      ExchangeAddress(group, transport::UcxWorld::AddressOf(x), n, &peers->inputs, (*step)++));
  thread_local std::vector<float> acc, first, next;
  acc.resize(kBlock);
  first.resize(kBlock);
  next.resize(kBlock);
  const int64_t begin = ring::ChunkBegin(n, parts, rank);
  const int64_t end = ring::ChunkBegin(n, parts, rank + 1);
  // Rank q's x[at, at + len): a pointer into this process's memory, or a copy in `buffer`.
  auto source = [&](int q, int64_t at, int64_t len, float* buffer,
                    const float** data) -> ffi::Error {
    if (q == rank) {
      *data = x + at;
    } else if (const void* local = group.LocalPointer(q, peers->inputs[q])) {
      *data = static_cast<const float*>(local) + at;
    } else {
      TimedWork timed(group, Work::kCopy);
      JAXCOMM_RETURN_IF_ERROR(
          group.ReadFrom(q, peers->inputs[q] + sizeof(float) * at, buffer, sizeof(float) * len));
      *data = buffer;
    }
    return ffi::Error::Success();
  };
  // The last addition writes `out` directly unless out is x itself (then through `acc`).
  const bool aliased = out == x;
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
      float* dst = (q == parts - 1 && !aliased) ? out + at : acc.data();
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
    read_bytes += sizeof(float) * static_cast<uint64_t>(len) * (parts - 1);
  }
  // What the peers read of this rank's x: their slices.
  group.CountTraffic(sizeof(float) * static_cast<uint64_t>(n - (end - begin)), read_bytes);
  group.MarkPhase("reduce_scatter");
  return ffi::Error::Success();
}

ffi::Error DirectAllgather(Group& group, float* out, int64_t n, DirectPeers* peers,
                           uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  // "Slice `rank` of my out is final, here it is" (and: I no longer read anyone's x).
  JAXCOMM_RETURN_IF_ERROR(
      ExchangeAddress(group, transport::UcxWorld::AddressOf(out), n, &peers->outputs, (*step)++));
  uint64_t read_bytes = 0;
  for (int k = 1; k < parts; ++k) {
    const int q = (rank + k) % parts;  // ranks start on different peers
    const int64_t at = ring::ChunkBegin(n, parts, q);
    const int64_t len = ring::ChunkSize(n, parts, q);
    TimedWork timed(group, Work::kCopy);
    if (const void* local = group.LocalPointer(q, peers->outputs[q])) {
      std::memcpy(out + at, static_cast<const float*>(local) + at, sizeof(float) * len);
    } else {
      JAXCOMM_RETURN_IF_ERROR(
          group.ReadFrom(q, peers->outputs[q] + sizeof(float) * at, out + at, sizeof(float) * len));
    }
    read_bytes += sizeof(float) * static_cast<uint64_t>(len);
  }
  const int64_t mine = ring::ChunkSize(n, parts, rank);
  group.CountTraffic(sizeof(float) * static_cast<uint64_t>(mine) * (parts - 1), read_bytes);
  // Nobody may return (and let XLA reuse its buffers) while a peer still copies from them.
  JAXCOMM_RETURN_IF_ERROR(Notify(group, n, (*step)++));
  group.MarkPhase("allgather");
  return ffi::Error::Success();
}

ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step) {
  const int rank = group.rank();
  const uint32_t address_step = (*step)++;
  const uint32_t done_step = (*step)++;
  if (group.size() == 1) return ffi::Error::Success();
  if (rank == root) {
    const Notice notice{transport::UcxWorld::AddressOf(out), n};
    std::vector<transport::Request> requests;
    for (int q = 0; q < group.size(); ++q) {
      if (q != root) requests.push_back(group.PostSend(q, &notice, sizeof(notice), address_step));
    }
    JAXCOMM_RETURN_IF_ERROR(group.Wait(requests.data(), requests.size()));
    requests.clear();
    std::vector<Notice> done(group.size());
    for (int q = 0; q < group.size(); ++q) {
      if (q != root) requests.push_back(group.PostRecv(q, &done[q], sizeof(Notice), done_step));
    }
    JAXCOMM_RETURN_IF_ERROR(group.Wait(requests.data(), requests.size()));
    group.CountTraffic(sizeof(float) * static_cast<uint64_t>(n) * (group.size() - 1), 0);
    return ffi::Error::Success();
  }
  // The hierarchical allreduce's phases before this one checked the element counts.
  Notice notice;
  size_t got = 0;
  JAXCOMM_RETURN_IF_ERROR(group.Recv(root, &notice, sizeof(notice), &got, address_step));
  {
    TimedWork timed(group, Work::kCopy);
    if (const void* local = group.LocalPointer(root, notice.address)) {
      std::memcpy(out, local, sizeof(float) * n);
    } else {
      JAXCOMM_RETURN_IF_ERROR(group.ReadFrom(root, notice.address, out, sizeof(float) * n));
    }
  }
  group.CountTraffic(0, sizeof(float) * static_cast<uint64_t>(n));
  const Notice done{0, n};
  return group.Send(root, &done, sizeof(done), done_step);
}

ffi::Error DirectAllreduce(Group& group, const float* x, float* out, int64_t n) {
  DirectPeers peers;
  uint32_t step = 0;
  JAXCOMM_RETURN_IF_ERROR(DirectReduceScatter(group, x, out, n, &peers, &step));
  return DirectAllgather(group, out, n, &peers, &step);
}

}  // namespace jaxcomm::collectives
