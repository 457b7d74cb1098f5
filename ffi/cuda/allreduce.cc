// Dense allreduce on the GPU (platform "CUDA" of target jaxcomm_allreduce): ncclAllReduce over
// the group's communicator on XLA's stream, or with JAXCOMM_TRANSPORT=ucx the CPU's schedule
// over UCX, host-staged (ffi/cuda/host_staged.h). NCCL's ring/tree gives every rank the same
// bits, as the CPU ring does. It takes no scratch memory, so it may run split (start/done) on
// jaxcomm's own stream (ffi/cuda/gpu_collective.h).
#include <cuda_runtime_api.h>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "ffi/cuda/host_staged.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

constexpr char kOp[] = "jaxcomm.allreduce";

ffi::Error AllreduceCuda(cudaStream_t stream, ffi::ScratchAllocator& /*scratch*/,
                         const Caller& caller, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": output size mismatch");
  }
  if (HostStagedSelected()) {
    return HostStagedAllreduce(kOp, stream, caller, x.typed_data(), out->typed_data(), n);
  }
  GpuSite site;
  std::unique_ptr<GpuGroup> group;
  JAXCOMM_RETURN_IF_ERROR(BeginGpuCall(kOp, stream, caller, &site, &group));
  JAXCOMM_RETURN_IF_ERROR(
      group->Check(group->nccl().all_reduce(x.typed_data(), out->typed_data(), n, ncclFloat32,
                                            ncclSum, group->comm(), stream),
                   "ncclAllReduce"));
  JAXCOMM_RETURN_IF_ERROR(group->Watch(stream));
  CountDenseRing(*group, n);
  group->Finish("dense", n);
  return ffi::Error::Success();
}

}  // namespace

JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE("jaxcomm_allreduce", AllreduceCuda, BindDenseData);

}  // namespace jaxcomm::collectives::gpu
