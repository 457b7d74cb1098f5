// gTop-k allreduce on the GPU (platform "CUDA" of target jaxcomm_gtopk), the same algorithm as
// ffi/gtopk.cc, driven by the same code (ffi/gtopk_run.h) over the group's NCCL transport on
// XLA's stream instead of UCX:
//
//   local top-k with error feedback (CUDA TopKAbs)
//   -> the fold / binomial-tree / broadcast schedule of ffi/gtopk_schedule.h (the CPU's), each
//      receive-and-merge a CUDA SparseMergeTopK(current, received) plus CollectDropped into one
//      fixed slot array per merge step
//   -> summed = 0, then summed[global index] = global value (the CPU's assignment)
//   -> the CPU's residual fix-ups, in the CPU's order: Alg. 4 line 10 (local values outside the
//      global set return to the residual), then each merge step's dropped partial sums at global
//      indices, one launch per step in merge order. Within a step the indices are distinct, so no
//      element is touched twice by one launch and every element sees the CPU's additions in the
//      CPU's order.
//
// Every buffer on the wire is one sparse set of exactly 2k words, so nothing is read back and
// the stream is never synchronized. A received index outside [0, n) turns summed into NaN (the
// CPU handler's error; kernels/cuda_kernels.h).
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "ffi/gtopk_run.h"
#include "kernels/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

namespace cuda = kernels::cuda;

constexpr char kOp[] = "jaxcomm.compressed_allreduce(GTopK)";

ffi::Error Launched(cudaError_t error, const char* what) { return CheckCuda(kOp, error, what); }

// A sparse set in device memory, as on the wire: [k indices][k values].
struct DeviceSet {
  uint32_t* words = nullptr;
  int64_t k = 0;
  int32_t* idx() const { return reinterpret_cast<int32_t*>(words); }
  float* val() const { return reinterpret_cast<float*>(words + k); }
};

// The sets of gtopk::RunSchedule on the device: one receive, merge and dropped slot array per
// merge step (the kernels of a step run after its receive, in stream order).
struct DeviceSets {
  int64_t k;
  cudaStream_t stream;
  void* merge_scratch;
  DeviceSet current_set;  // local, then each merge result, then the global set
  DeviceSet global_set;
  std::vector<DeviceSet> merged, received;
  std::vector<int32_t*> dropped_idx;
  std::vector<float*> dropped_val;

  const void* current() const { return current_set.words; }
  void* merge_input(int merge) const { return received[merge].words; }
  void* global() const { return global_set.words; }
  void TakeGlobal() { current_set = global_set; }
  ffi::Error Merge(int merge, int /*from*/) {
    const DeviceSet& in = received[merge];
    const DeviceSet& out = merged[merge];
    JAXCOMM_RETURN_IF_ERROR(
        Launched(cuda::SparseMergeTopK(current_set.idx(), current_set.val(), k, in.idx(), in.val(),
                                       k, k, out.idx(), out.val(), merge_scratch, stream),
                 "SparseMergeTopK"));
    JAXCOMM_RETURN_IF_ERROR(Launched(
        cuda::CollectDropped(current_set.idx(), current_set.val(), k, in.idx(), in.val(), k,
                             out.idx(), k, dropped_idx[merge], dropped_val[merge], stream),
        "CollectDropped"));
    current_set = out;
    return ffi::Error::Success();
  }
};

ffi::Error GTopKCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch, const Caller& caller,
                     int64_t k, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                     ffi::ResultBuffer<ffi::F32> summed, ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  JAXCOMM_RETURN_IF_ERROR(CheckSparseArguments(kOp, k, x.element_count(), residual.element_count(),
                                               summed->element_count(),
                                               new_residual->element_count()));
  // The merge counts 2k entries in 32-bit integers (CheckSparseArguments: n <= 2**31 - 1).
  if (2 * k > kernels::wire::kMaxElements) {
    return ffi_common::InvalidArgument(kOp, "on the GPU 2k must be below 2**31");
  }
  GpuSite site;
  std::unique_ptr<GpuGroup> group;
  JAXCOMM_RETURN_IF_ERROR(BeginGpuCall(kOp, stream, caller, &site, &group));
  const std::vector<gtopk::Step> schedule = gtopk::Schedule(group->rank(), group->size());
  const int merges = gtopk::CountMerges(schedule);

  // Scratch, one allocation: [top-k memory][merge memory][local][global][merged x M]
  // [received x M][dropped x M][bad flag]. A set is 2k words; a merge step's dropped slots are
  // 2k indices + 2k values.
  const size_t set_bytes = cuda::AlignUp(sizeof(uint32_t) * 2 * k);
  const size_t dropped_bytes =
      cuda::AlignUp(sizeof(int32_t) * 2 * k) + cuda::AlignUp(sizeof(float) * 2 * k);
  const size_t topk_bytes = cuda::AlignUp(cuda::TopKScratchBytes(n));
  const size_t merge_bytes = cuda::AlignUp(cuda::SparseMergeScratchBytes(k, k));
  const size_t total = topk_bytes + merge_bytes + set_bytes * (2 + 2 * merges) +
                       dropped_bytes * merges + sizeof(uint32_t);
  void* memory = nullptr;
  JAXCOMM_RETURN_IF_ERROR(AllocateScratch(scratch, kOp, total, &memory));
  char* p = static_cast<char*>(memory);
  auto carve = [&p](size_t bytes) {
    char* at = p;
    p += bytes;
    return at;
  };
  void* topk_scratch = carve(topk_bytes);
  void* merge_scratch = carve(merge_bytes);
  auto new_set = [&](void) { return DeviceSet{reinterpret_cast<uint32_t*>(carve(set_bytes)), k}; };
  const DeviceSet local = new_set();
  const DeviceSet global = new_set();
  std::vector<DeviceSet> merged, received;
  std::vector<int32_t*> dropped_idx;
  std::vector<float*> dropped_val;
  for (int s = 0; s < merges; ++s) merged.push_back(new_set());
  for (int s = 0; s < merges; ++s) received.push_back(new_set());
  for (int s = 0; s < merges; ++s) {
    dropped_idx.push_back(
        reinterpret_cast<int32_t*>(carve(cuda::AlignUp(sizeof(int32_t) * 2 * k))));
    dropped_val.push_back(reinterpret_cast<float*>(carve(cuda::AlignUp(sizeof(float) * 2 * k))));
  }
  auto* bad = reinterpret_cast<uint32_t*>(carve(sizeof(uint32_t)));

  float* r_out = new_residual->typed_data();
  JAXCOMM_RETURN_IF_ERROR(Launched(cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream), "memset"));
  JAXCOMM_RETURN_IF_ERROR(
      Launched(cuda::TopKAbs(x.typed_data(), residual.typed_data(), n, k, local.idx(), local.val(),
                             r_out, topk_scratch, stream),
               "TopKAbs"));

  // The schedule, through the driver the CPU handler runs (ffi/gtopk_run.h): its messages are
  // NCCL sends and receives on `stream` (the group's transport), each merge a pair of kernels.
  DeviceSets sets{k,      stream,   merge_scratch, local,      global,
                  merged, received, dropped_idx,   dropped_val};
  JAXCOMM_RETURN_IF_ERROR(
      gtopk::RunSchedule(kOp, group->group(), sizeof(uint32_t) * static_cast<size_t>(2 * k), sets));
  const DeviceSet current = sets.current_set;
  JAXCOMM_RETURN_IF_ERROR(group->Watch(stream));

  // `current` is now the global set (ascending), on every rank.
  float* out = summed->typed_data();
  JAXCOMM_RETURN_IF_ERROR(Launched(cudaMemsetAsync(out, 0, sizeof(float) * n, stream), "memset"));
  JAXCOMM_RETURN_IF_ERROR(
      Launched(cuda::ScatterSetSparse(current.idx(), current.val(), k, out, n, bad, stream),
               "ScatterSetSparse"));
  // Alg. 4 line 10: local values outside the global set return to the residual (whose selected
  // entries TopKAbs zeroed).
  JAXCOMM_RETURN_IF_ERROR(Launched(cuda::AddBySet(cuda::SetSide::kOutside, local.idx(), local.val(),
                                                  k, current.idx(), k, r_out, n, stream),
                                   "AddBySet(outside)"));
  // Partial sums this rank dropped at indices that still made it into the global set.
  for (int s = 0; s < merges; ++s) {
    JAXCOMM_RETURN_IF_ERROR(
        Launched(cuda::AddBySet(cuda::SetSide::kInside, dropped_idx[s], dropped_val[s], 2 * k,
                                current.idx(), k, r_out, n, stream),
                 "AddBySet(inside)"));
  }
  // The group counted the messages as they were posted.
  return FinishSparse(*group, kOp, "gtopk", n, bad, out, 0, 0, stream);
}

}  // namespace

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_gtopk", GTopKCuda, BindSparseCollective);

}  // namespace jaxcomm::collectives::gpu
