// Dense allreduce of bfloat16 / float16 arrays with 16-bit words on the wire and float32 sums.
//
// Why not the float32 ring (ffi/allreduce.cc) on 16-bit data: a ring adds a chunk's partial sum
// at every hop, so a 16-bit ring rounds P - 1 times (what a bf16 lax.psum does), and widening to
// float32 on the wire doubles the bytes, which is the cost a bf16 baseline exists to avoid.
// Instead (the schedule of the quantized allreduce, Dryden et al. §3.4, ffi/quantized_schedule.h,
// over the even chunks of ffi/ring_schedule.h):
//   1. Pairwise reduce-scatter: rank r sends its 16-bit copy of chunk c straight to the chunk's
//      owner c; every message crosses one link, (P - 1)/P of the data per rank.
//   2. The owner widens the P contributions, adds them in float32 in rank order and rounds
//      the sum once (round to nearest even).
//   3. Ring allgather of the rounded 16-bit chunks.
// Each rank sends 2 (P - 1)/P * n * 2 bytes, half of the float32 ring; every rank ends with the
// same bits, and the result is the float32 sum rounded once (independent of P's ring order).
//
// When every member shares memory (one host), the same schedule runs without the transport,
// as the float32 allreduce does (ffi/direct_allreduce.h, DirectHalfAllreduce): the owner reads
// the 16-bit slices straight from the peers (or their staging areas: half the bytes of
// float32), with the same float32 sum in rank order, so both paths give the same bits.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/direct_allreduce.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "ffi/quantized_schedule.h"
#include "ffi/ring_schedule.h"
#include "kernels/half.h"
#include "kernels/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

constexpr char kAllreduceOp[] = "jaxcomm.allreduce";

using ring::ChunkBegin;
using ring::ChunkSize;

ffi::Error WrongSize(const Group& group, size_t got, size_t expected, int from) {
  return ffi::Error::InvalidArgument(
      std::string(group.name()) + ": group rank " + std::to_string(from) + " sent " +
      std::to_string(got) + " bytes where " + std::to_string(expected) +
      " were expected; every rank must pass an array of the same shape and dtype");
}

ffi::Error HalfAllreduce(Group& group, kernels::HalfFormat format, const uint16_t* x, int64_t n,
                         uint16_t* out) {
  const int parts = group.size();
  const int rank = group.rank();
  auto begin = [&](int c) { return ChunkBegin(n, parts, c); };
  auto size = [&](int c) { return ChunkSize(n, parts, c); };
  if (parts == 1) {
    if (out != x) std::memcpy(out, x, sizeof(uint16_t) * n);  // a split call sums in place
    return ffi::Error::Success();
  }
  thread_local std::vector<uint16_t> incoming;
  thread_local std::vector<float> sum;
  const int64_t mine = size(rank);
  incoming.resize(static_cast<size_t>(std::max<int64_t>(1, mine * parts)));

  // 1. Every contribution to my chunk, posted at once (steps 1 .. P-1 tag the sources).
  // Empty chunks (n < P) send nothing; both sides know every chunk's size.
  std::vector<transport::Request> recvs;
  std::vector<int> sources;
  std::vector<transport::Request> sends;
  for (int k = 1; k < parts && mine > 0; ++k) {
    const int src = quantized::PairwiseExchange(rank, parts, k).from;
    recvs.push_back(group.PostRecv(src, incoming.data() + mine * src, sizeof(uint16_t) * mine,
                                   static_cast<uint32_t>(k)));
    sources.push_back(src);
  }
  for (int k = 1; k < parts; ++k) {
    const int dst = quantized::PairwiseExchange(rank, parts, k).to;
    if (size(dst) == 0) continue;
    sends.push_back(group.PostSend(dst, x + begin(dst), sizeof(uint16_t) * size(dst),
                                   static_cast<uint32_t>(k)));
  }
  for (size_t j = 0; j < recvs.size(); ++j) {
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.Wait(&recvs[j], 1, &got));
    if (got != sizeof(uint16_t) * mine) {
      return WrongSize(group, got, sizeof(uint16_t) * mine, sources[j]);
    }
  }
  JAXCOMM_RETURN_IF_ERROR(group.Wait(sends.data(), sends.size()));

  // 2. Float32 sum in rank order, rounded once.
  sum.assign(static_cast<size_t>(mine), 0.0f);
  for (int q = 0; q < parts; ++q) {
    const uint16_t* part = q == rank ? x + begin(rank) : incoming.data() + mine * q;
    kernels::AddHalfInto(format, sum.data(), part, mine);
  }
  kernels::FloatToHalf(format, sum.data(), out + begin(rank), mine);

  // 3. Ring allgather: at step k, forward the chunk received at step k - 1 (first my own).
  const int right = ring::RightOf(rank, parts);
  const int left = ring::LeftOf(rank, parts);
  for (int k = 0; k < parts - 1; ++k) {
    const auto [send_chunk, recv_chunk] = ring::PassStep(rank, parts, k);
    size_t got = 0;
    const size_t expected = sizeof(uint16_t) * size(recv_chunk);
    const int dst = size(send_chunk) > 0 ? right : -1;
    const int src = expected > 0 ? left : -1;
    JAXCOMM_RETURN_IF_ERROR(
        group.SendRecv(dst, out + begin(send_chunk), sizeof(uint16_t) * size(send_chunk), src,
                       out + begin(recv_chunk), expected, &got, static_cast<uint32_t>(parts + k)));
    if (src >= 0 && got != expected) return WrongSize(group, got, expected, left);
  }
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error HalfAllreduceImpl(const kernels::TaskRunner& /*run*/, const Caller& caller,
                             ffi::Buffer<T> x, ffi::ResultBuffer<T> out) {
  const int64_t n = ffi_common::NumElements(x);
  if (ffi_common::NumElements(*out) != n) {
    return ffi_common::InvalidArgument(kAllreduceOp, "output size mismatch");
  }
  std::unique_ptr<Group> group;
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(MakeCallSite(kAllreduceOp, caller), &group));
  constexpr bool kBf16 = T == ffi::DataType::BF16;
  const kernels::HalfFormat format =
      kBf16 ? kernels::HalfFormat::kBFloat16 : kernels::HalfFormat::kFloat16;
  // As the float32 allreduce: a fresh output faults in 2 MiB pages, not 4 KiB ones.
  kernels::AdviseHugePages(out->typed_data(), sizeof(uint16_t) * n);
  if (group->size() > 1 && group->SharesMemoryWithAll()) {
    JAXCOMM_RETURN_IF_ERROR(
        DirectHalfAllreduce(*group, format, x.typed_data(), out->typed_data(), n));
    group->Finish(kBf16 ? "dense_bf16_direct" : "dense_f16_direct", n);
  } else {
    JAXCOMM_RETURN_IF_ERROR(HalfAllreduce(*group, format, x.typed_data(), n, out->typed_data()));
    group->Finish(kBf16 ? "dense_bf16" : "dense_f16", n);
  }
  return ffi::Error::Success();
}

// x in; the group sum, rounded once, and the token out.
template <ffi::DataType T, typename Binding>
auto BindHalfData(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<T>>()            // x: this rank's data
      .template Ret<ffi::Buffer<T>>()            // out: the group sum, rounded once
      .template Ret<ffi::BufferR0<ffi::S32>>();  // token out
}

}  // namespace

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_allreduce_bf16", HalfAllreduceImpl<ffi::DataType::BF16>,
                          BindHalfData<ffi::DataType::BF16>);
JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_allreduce_f16", HalfAllreduceImpl<ffi::DataType::F16>,
                          BindHalfData<ffi::DataType::F16>);

}  // namespace jaxcomm::collectives
