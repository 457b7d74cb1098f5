// Dense allreduce over UCX: ring reduce-scatter + ring allgather, the bandwidth-optimal
// schedule (each rank sends and receives 2(P-1)/P * n elements).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/group.h"
#include "kernels/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

constexpr char kAllreduceOp[] = "jaxcomm.allreduce";

int64_t ChunkBegin(int64_t n, int parts, int chunk) {
  return chunk * (n / parts) + std::min<int64_t>(chunk, n % parts);
}

ffi::Error CheckReceived(const Group& group, size_t got, size_t expected, int from) {
  if (got == expected) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string(group.name()) + ": group rank " + std::to_string(from) + " sent " +
      std::to_string(got) + " bytes where " + std::to_string(expected) +
      " were expected; every rank must pass an array of the same shape and dtype");
}

}  // namespace

// In-place ring allreduce of data[0, n) across the group. Every rank ends with bit-identical
// sums: each chunk is reduced in one fixed order, then copied around the ring.
ffi::Error RingAllreduce(Group& group, float* data, int64_t n, std::vector<float>* scratch) {
  const int parts = group.size();
  const int rank = group.rank();
  if (parts == 1) return ffi::Error::Success();
  const int right = (rank + 1) % parts;
  const int left = (rank + parts - 1) % parts;
  auto chunk_size = [&](int c) { return ChunkBegin(n, parts, c + 1) - ChunkBegin(n, parts, c); };
  scratch->resize(static_cast<size_t>(std::max<int64_t>(1, chunk_size(0))));

  uint32_t step = 0;
  for (int s = 0; s < parts - 1; ++s, ++step) {
    const int send_chunk = (rank - s + parts) % parts;
    const int recv_chunk = (rank - s - 1 + parts) % parts;
    const size_t recv_bytes = sizeof(float) * chunk_size(recv_chunk);
    size_t got = 0;
    if (ffi::Error e = group.SendRecv(right, data + ChunkBegin(n, parts, send_chunk),
                                      sizeof(float) * chunk_size(send_chunk), left,
                                      scratch->data(), sizeof(float) * scratch->size(), &got, step);
        !e.success()) {
      return e;
    }
    if (ffi::Error e = CheckReceived(group, got, recv_bytes, left); !e.success()) return e;
    kernels::AddInto(data + ChunkBegin(n, parts, recv_chunk), scratch->data(),
                     chunk_size(recv_chunk));
  }
  for (int s = 0; s < parts - 1; ++s, ++step) {
    const int send_chunk = (rank + 1 - s + parts) % parts;
    const int recv_chunk = (rank - s + parts) % parts;
    const size_t recv_bytes = sizeof(float) * chunk_size(recv_chunk);
    size_t got = 0;
    if (ffi::Error e = group.SendRecv(right, data + ChunkBegin(n, parts, send_chunk),
                                      sizeof(float) * chunk_size(send_chunk), left,
                                      data + ChunkBegin(n, parts, recv_chunk), recv_bytes, &got,
                                      step);
        !e.success()) {
      return e;
    }
    if (ffi::Error e = CheckReceived(group, got, recv_bytes, left); !e.success()) return e;
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error AllreduceImpl(ffi::ThreadPool /*pool*/, int32_t device_id, ffi::Buffer<ffi::S32, 1> coordinates,
                         ffi::Buffer<ffi::S32, 0> token, int64_t world,
                         ffi::Span<const int64_t> world_devices,
                         ffi::Span<const int64_t> mesh_axis_sizes,
                         ffi::Span<const int64_t> reduce_axes, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::S32, 0> token_out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(std::string(kAllreduceOp) + ": output size mismatch");
  }
  std::unique_ptr<Group> group;
  if (ffi::Error e = Group::Begin(MakeCallSite(kAllreduceOp, device_id, coordinates, world,
                                               world_devices, mesh_axis_sizes, reduce_axes),
                                  &group);
      !e.success()) {
    return e;
  }
  if (out->typed_data() != x.typed_data()) {
    std::memcpy(out->typed_data(), x.typed_data(), sizeof(float) * n);
  }
  thread_local std::vector<float> scratch;
  if (ffi::Error e = RingAllreduce(*group, out->typed_data(), n, &scratch); !e.success()) return e;
  group->Finish("ring", n);
  token_out->typed_data()[0] = token.typed_data()[0] + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm::collectives

JAXCOMM_EXPORT_HANDLER(JaxcommAllreduce);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommAllreduce, jaxcomm::collectives::AllreduceImpl,
                              jaxcomm::collectives::BindCollective()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x: this rank's data
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out: the group sum
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>()  // token out
);
