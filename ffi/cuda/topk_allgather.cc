// TopK-allgather on the GPU (platform "CUDA" of target jaxcomm_topk_allgather), the same
// algorithm as ffi/topk_allgather.cc: local top-k with error feedback (CUDA TopKAbs), an
// ncclAllGather of every rank's [k indices][k values] set, then summed = 0 plus a scatter-add of
// the P sets in rank order, one launch per set. Indices are distinct within a set and the
// launches run in stream order, so every element sees the CPU's additions in the CPU's order:
// summed is bit-identical to the CPU handler's and across ranks.
//
// Everything is enqueued on XLA's stream; message sizes are fixed (2k words per rank), so
// nothing is read back. A received index outside [0, n) (the CPU handler's error) turns summed
// into NaN instead (kernels/cuda_kernels.h).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "kernels/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

namespace cuda = kernels::cuda;

constexpr char kOp[] = "jaxcomm.compressed_allreduce(TopKAllgather)";

ffi::Error Launched(cudaError_t error, const char* what) { return CheckCuda(kOp, error, what); }

ffi::Error TopKAllgatherCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                             const Caller& caller, int64_t k, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> summed,
                             ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  JAXCOMM_RETURN_IF_ERROR(CheckSparseArguments(kOp, k, x.element_count(), residual.element_count(),
                                               summed->element_count(),
                                               new_residual->element_count()));
  GpuSite site;
  std::unique_ptr<GpuGroup> group;
  JAXCOMM_RETURN_IF_ERROR(BeginGpuCall(kOp, stream, caller, &site, &group));
  const int parts = group->size();
  const int rank = group->rank();

  // Scratch: [top-k working memory][slots: P x (k indices, k values)][bad flag].
  const size_t slot_words = static_cast<size_t>(2 * k);
  const size_t topk_bytes = cuda::AlignUp(cuda::TopKScratchBytes(n));
  const size_t slots_bytes = cuda::AlignUp(sizeof(uint32_t) * slot_words * parts);
  void* memory = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      AllocateScratch(scratch, kOp, topk_bytes + slots_bytes + sizeof(uint32_t), &memory));
  char* base = static_cast<char*>(memory);
  void* topk_scratch = base;
  auto* slots = reinterpret_cast<uint32_t*>(base + topk_bytes);
  auto* bad = reinterpret_cast<uint32_t*>(base + topk_bytes + slots_bytes);
  uint32_t* mine = slots + slot_words * rank;

  JAXCOMM_RETURN_IF_ERROR(Launched(cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream), "memset"));
  JAXCOMM_RETURN_IF_ERROR(
      Launched(cuda::TopKAbs(x.typed_data(), residual.typed_data(), n, k,
                             reinterpret_cast<int32_t*>(mine), reinterpret_cast<float*>(mine + k),
                             new_residual->typed_data(), topk_scratch, stream),
               "TopKAbs"));
  // In place (sendbuff == recvbuff + rank * sendcount): slot q ends up holding rank q's set.
  JAXCOMM_RETURN_IF_ERROR(group->Check(
      group->nccl().all_gather(mine, slots, slot_words, ncclUint32, group->comm(), stream),
      "ncclAllGather"));
  JAXCOMM_RETURN_IF_ERROR(group->Watch(stream));

  float* out = summed->typed_data();
  JAXCOMM_RETURN_IF_ERROR(Launched(cudaMemsetAsync(out, 0, sizeof(float) * n, stream), "memset"));
  for (int q = 0; q < parts; ++q) {
    const uint32_t* slot = slots + slot_words * q;
    JAXCOMM_RETURN_IF_ERROR(Launched(
        cuda::ScatterAddSparse(reinterpret_cast<const int32_t*>(slot),
                               reinterpret_cast<const float*>(slot + k), k, out, n, bad, stream),
        "ScatterAddSparse"));
  }
  // What a ring allgather sends and receives per rank: the P - 1 other slots.
  const uint64_t bytes = sizeof(uint32_t) * slot_words * static_cast<uint64_t>(parts - 1);
  return FinishSparse(*group, kOp, "topk_allgather", n, bad, out, bytes, bytes, stream);
}

}  // namespace

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_topk_allgather", TopKAllgatherCuda, BindSparseCollective);

}  // namespace jaxcomm::collectives::gpu
