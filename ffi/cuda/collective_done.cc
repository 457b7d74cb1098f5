// jaxcomm_collective_done on the GPU (platform "CUDA"): the second half of a split collective
// (ffi/cuda/gpu_collective.h, "Split calls"). Makes XLA's stream wait for the event the start
// recorded after its NCCL work on jaxcomm's stream; the host never waits. The ticket operand
// only orders done after the start (its value is not read: it lives in device memory); the
// start is found by its result buffers, which done receives aliased.
#include "ffi/collective_done.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

ffi::Error CollectiveDoneCuda(cudaStream_t stream, ffi::BufferR0<ffi::S32> /*ticket*/,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<const void*> results;
  JAXCOMM_RETURN_IF_ERROR(DoneResults(args, rets, &results));
  return AwaitSplit("jaxcomm_collective_done", stream, results);
}

}  // namespace

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_collective_done", CollectiveDoneCuda,
                            ffi::Ffi::Bind()
                                .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: waits
                                .Arg<ffi::BufferR0<ffi::S32>>()            // ticket (orders only)
                                .RemainingArgs()    // start's results, then kept operands
                                .RemainingRets());  // start's results (aliased)

}  // namespace jaxcomm::collectives::gpu
