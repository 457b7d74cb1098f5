// Dense allreduce: the schedules of ffi/allreduce.h over UCX (ring reduce-scatter + ring
// allgather, the bandwidth-optimal schedule: each rank sends and receives 2(P-1)/P * n
// elements; recursive doubling for small vectors), and the choice among them and the
// shared-memory ones (DenseAllreduce).
#include "ffi/allreduce.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/direct_allreduce.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "ffi/ring_schedule.h"
#include "ffi/transport/settings.h"
#include "ffi/transport/transport.h"
#include "kernels/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

using ring::ChunkBegin;

constexpr char kAllreduceOp[] = "jaxcomm.allreduce";
// Chunks travel in up to kMaxSegments segments of at least kMinSegmentElements floats.
constexpr int64_t kMaxSegments = 16;
constexpr int64_t kMinSegmentElements = 1 << 17;

ffi::Error CheckReceived(const Group& group, size_t got, size_t expected, int from) {
  if (got == expected) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string(group.name()) + ": group rank " + std::to_string(from) + " sent " +
      std::to_string(got) + " bytes where " + std::to_string(expected) +
      " were expected; every rank must pass an array of the same shape and dtype");
}

}  // namespace

// RingAllreduce (ffi/allreduce.h).
//
// Pipelined: the chunk a rank sends at step s + 1 is the chunk it received (and reduced) at
// step s, so each chunk travels in segments and a segment is forwarded as soon as it has been
// reduced, instead of waiting for the whole chunk. That keeps both directions of every link
// busy across step boundaries.
//
// No copy of x into out first: the first send reads x, and each reduction writes
// out = x + received in one pass. Every chunk of out is written by the reduce-scatter or the
// allgather before it is read. A copy-in into a fresh output would delay the first byte by
// a full pass over memory plus its page faults (far more on busy cores), on the critical
// path of every rank; fused, those page faults overlap the wire.
ffi::Error RingAllreduce(Group& group, const float* x, float* data, int64_t n,
                         std::vector<float>* scratch) {
  const int parts = group.size();
  const int rank = group.rank();
  if (parts == 1) {
    if (data != x) {
      TimedWork timed(group, Work::kCopy);
      std::memcpy(data, x, sizeof(float) * n);
    }
    return ffi::Error::Success();
  }
  const int right = (rank + 1) % parts;
  const int left = (rank + parts - 1) % parts;
  auto begin = [&](int c) { return ChunkBegin(n, parts, c); };
  auto size = [&](int c) { return ring::ChunkSize(n, parts, c); };
  const int64_t max_chunk = size(0);
  // Tags carry step * kMaxSegments + segment in 16 bits.
  const int64_t max_segments = (2 * (parts - 1) * kMaxSegments <= 0xffff) ? kMaxSegments : 1;
  const int64_t segment =
      std::max<int64_t>(kMinSegmentElements, (max_chunk + max_segments - 1) / max_segments);
  auto segments_of = [&](int c) { return (size(c) + segment - 1) / segment; };
  auto segment_length = [&](int c, int64_t j) { return std::min(segment, size(c) - j * segment); };
  auto tag = [&](int step, int64_t j) { return static_cast<uint32_t>(step * max_segments + j); };
  scratch->resize(static_cast<size_t>(std::max<int64_t>(1, max_chunk)));

  std::vector<transport::Request> sends;
  std::vector<transport::Request> recvs;
  auto send_chunk = [&](const float* from, int c, int step) {
    for (int64_t j = 0; j < segments_of(c); ++j) {
      sends.push_back(group.PostSend(right, from + begin(c) + j * segment,
                                     sizeof(float) * segment_length(c, j), tag(step, j)));
    }
  };
  auto wait_sends = [&]() -> ffi::Error {
    ffi::Error e = group.Wait(sends.data(), sends.size());
    sends.clear();
    return e;
  };
  // One phase: `steps` ring steps; at step s this rank receives chunk recv_chunk(s) into `into`
  // (scratch to reduce, or data to copy) and forwards it at step s + 1.
  auto phase = [&](int first_step, const float* first_from, int first_send, auto recv_chunk,
                   bool reduce) -> ffi::Error {
    send_chunk(first_from, first_send, first_step);
    for (int s = 0; s < parts - 1; ++s) {
      const int c = recv_chunk(s);
      const int64_t count = segments_of(c);
      recvs.clear();
      for (int64_t j = 0; j < count; ++j) {
        float* into = reduce ? scratch->data() + j * segment : data + begin(c) + j * segment;
        recvs.push_back(group.PostRecv(left, into, sizeof(float) * segment_length(c, j),
                                       tag(first_step + s, j)));
      }
      for (int64_t j = 0; j < count; ++j) {
        size_t got = 0;
        JAXCOMM_RETURN_IF_ERROR(group.Wait(&recvs[j], 1, &got));
        const size_t expected = sizeof(float) * segment_length(c, j);
        JAXCOMM_RETURN_IF_ERROR(CheckReceived(group, got, expected, left));
        if (reduce) {
          TimedWork timed(group, Work::kReduce);
          const int64_t at = begin(c) + j * segment;
          const float* received = scratch->data() + j * segment;
          if (data == x) {
            kernels::AddInto(data + at, received, segment_length(c, j));
          } else {
            kernels::Add(data + at, x + at, received, segment_length(c, j));
          }
        }
        if (s + 1 < parts - 1) {
          sends.push_back(group.PostSend(right, data + begin(c) + j * segment, expected,
                                         tag(first_step + s + 1, j)));
        }
      }
    }
    return wait_sends();
  };

  // Reduce-scatter: after it, this rank holds the full sum of chunk (rank + 1) % P.
  JAXCOMM_RETURN_IF_ERROR(phase(
      0, x, rank, [&](int s) { return ring::ReduceScatterStep(rank, parts, s).recv_chunk; }, true));
  group.MarkPhase("reduce_scatter");
  // Allgather of the reduced chunks.
  JAXCOMM_RETURN_IF_ERROR(phase(
      parts - 1, data, ring::OwnedChunk(rank, parts),
      [&](int s) { return ring::AllgatherStep(rank, parts, s).recv_chunk; }, false));
  group.MarkPhase("allgather");
  return ffi::Error::Success();
}

// DoublingAllreduce (ffi/allreduce.h).
ffi::Error DoublingAllreduce(Group& group, const float* x, float* data, int64_t n,
                             std::vector<float>* scratch) {
  const int parts = group.size();
  const int rank = group.rank();
  if (data != x) {
    TimedWork timed(group, Work::kCopy);
    std::memcpy(data, x, sizeof(float) * n);
  }
  if (parts == 1) return ffi::Error::Success();
  scratch->resize(static_cast<size_t>(std::max<int64_t>(1, n)));
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  int p2 = 1;
  while (p2 * 2 <= parts) p2 *= 2;
  const int paired = 2 * (parts - p2);  // ranks [0, paired) fold in pairs
  // This rank's index among the p2 that exchange (-1: folded into rank + 1), and back.
  const int virtual_rank = rank < paired ? (rank % 2 == 1 ? rank / 2 : -1) : rank - paired / 2;
  auto real_rank = [&](int v) { return v < paired / 2 ? 2 * v + 1 : v + paired / 2; };
  uint32_t step = 0;
  size_t got = 0;
  if (rank < paired) {
    if (virtual_rank < 0) {
      JAXCOMM_RETURN_IF_ERROR(group.Send(rank + 1, data, bytes, step));
    } else {
      JAXCOMM_RETURN_IF_ERROR(group.Recv(rank - 1, scratch->data(), bytes, &got, step));
      JAXCOMM_RETURN_IF_ERROR(CheckReceived(group, got, bytes, rank - 1));
      TimedWork timed(group, Work::kReduce);
      // x[rank] + x[rank - 1]: the same bits as in rank order (addition commutes).
      kernels::AddInto(data, scratch->data(), n);
    }
  }
  ++step;
  for (int mask = 1; mask < p2; mask <<= 1, ++step) {
    if (virtual_rank < 0) continue;
    const int partner = real_rank(virtual_rank ^ mask);
    JAXCOMM_RETURN_IF_ERROR(
        group.SendRecv(partner, data, bytes, partner, scratch->data(), bytes, &got, step));
    JAXCOMM_RETURN_IF_ERROR(CheckReceived(group, got, bytes, partner));
    TimedWork timed(group, Work::kReduce);
    kernels::AddInto(data, scratch->data(), n);  // a + b here, b + a there: the same bits
  }
  if (rank < paired) {
    if (virtual_rank < 0) {
      JAXCOMM_RETURN_IF_ERROR(group.Recv(rank + 1, data, bytes, &got, step));
      JAXCOMM_RETURN_IF_ERROR(CheckReceived(group, got, bytes, rank + 1));
    } else {
      JAXCOMM_RETURN_IF_ERROR(group.Send(rank - 1, data, bytes, step));
    }
  }
  group.MarkPhase("doubling");
  return ffi::Error::Success();
}

size_t SmallAllreduceBytes() {
  // An invalid value was refused by jaxcomm.config at import; the default then stands here.
  static const size_t bytes =
      static_cast<size_t>(transport::ValueOrFallback(transport::kSmallAllreduceBytes));
  return bytes;
}

// DenseAllreduce (ffi/allreduce.h): the table at the top of ffi/allreduce.h.
ffi::Error DenseAllreduce(Group& group, const float* x, float* data, int64_t n,
                          std::vector<float>* scratch, const char** algorithm) {
  const bool small = sizeof(float) * static_cast<size_t>(n) <= SmallAllreduceBytes();
  const char* label;
  ffi::Error error;
  if (group.size() > 1 && group.SharesMemoryWithAll()) {
    // Every member's memory is readable from here (same process or same host): reduce
    // straight from the peers' inputs, no transport in between.
    label = small ? "dense_direct_oneshot" : "dense_direct";
    error = small ? DirectAllreduceOneShot(group, x, data, n) : DirectAllreduce(group, x, data, n);
  } else {
    label = small ? "dense_doubling" : "dense";
    error = small ? DoublingAllreduce(group, x, data, n, scratch)
                  : RingAllreduce(group, x, data, n, scratch);
  }
  if (algorithm != nullptr) *algorithm = label;
  return error;
}

namespace {

ffi::Error AllreduceImpl(const kernels::TaskRunner& /*run*/, const Caller& caller,
                         ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(std::string(kAllreduceOp) + ": output size mismatch");
  }
  std::unique_ptr<Group> group;
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(MakeCallSite(kAllreduceOp, caller), &group));
  kernels::AdviseHugePages(out->typed_data(), sizeof(float) * n);
  thread_local std::vector<float> scratch;
  const char* algorithm = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      DenseAllreduce(*group, x.typed_data(), out->typed_data(), n, &scratch, &algorithm));
  group->Finish(algorithm, n);
  return ffi::Error::Success();
}

}  // namespace

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_allreduce", AllreduceImpl, BindDenseData);

}  // namespace jaxcomm::collectives

// SmallAllreduceBytes(): tests/test_cost.py checks jaxcomm/cost/algorithm_costs/dense.py reads
// the same.
JAXCOMM_C_API int64_t jaxcomm_allreduce_small_bytes() {
  return static_cast<int64_t>(jaxcomm::collectives::SmallAllreduceBytes());
}
