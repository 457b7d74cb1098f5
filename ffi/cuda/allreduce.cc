// Dense allreduce on the GPU (platform "CUDA" of target jaxcomm_allreduce): ncclAllReduce over
// the group's communicator on XLA's stream. NCCL's ring/tree gives every rank the same bits,
// as the CPU ring does.
#include <cuda_runtime_api.h>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

constexpr char kOp[] = "jaxcomm.allreduce";

ffi::Error AllreduceCuda(cudaStream_t stream, ffi::ScratchAllocator /*scratch*/,
                         int32_t device_ordinal, ffi::Buffer<ffi::S32, 1> coordinates,
                         ffi::Buffer<ffi::S32, 0> token, const CollectiveAttrs& attrs,
                         ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::S32, 0> token_out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != n) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": output size mismatch");
  }
  GpuSite site;
  std::unique_ptr<GpuGroup> group;
  JAXCOMM_RETURN_IF_ERROR(
      BeginGpuCall(kOp, stream, device_ordinal, coordinates, attrs, &site, &group));
  JAXCOMM_RETURN_IF_ERROR(
      group->Check(group->nccl().all_reduce(x.typed_data(), out->typed_data(), n, ncclFloat32,
                                            ncclSum, group->comm(), stream),
                   "ncclAllReduce"));
  JAXCOMM_RETURN_IF_ERROR(group->Watch(stream));
  CountDenseRing(*group, n);
  group->Finish("dense", n);
  return ForwardToken(stream, token, token_out);
}

}  // namespace
}  // namespace jaxcomm::collectives::gpu

JAXCOMM_EXPORT_HANDLER(JaxcommAllreduceCuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxcommAllreduceCuda, jaxcomm::collectives::gpu::AllreduceCuda,
    jaxcomm::collectives::BindDenseData(jaxcomm::collectives::gpu::BindGpuCollective()));
