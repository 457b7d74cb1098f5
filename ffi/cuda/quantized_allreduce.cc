// Quantized allreduce and hierarchical allreduce on the GPU (platform "CUDA" of the targets
// jaxcomm_quantized_allreduce, jaxcomm_hierarchical_allreduce, jaxcomm_hierarchical_quantized):
// the algorithms of ffi/quantized_allreduce.cc (read its file comment first) with NCCL on XLA's
// stream as the transport and the kernels of kernels/cuda_kernels.h. Both follow the schedules
// of ffi/quantized_schedule.h and ffi/ring_schedule.h. Same attributes, operands
// and results as the CPU handlers; everything is enqueued on XLA's stream, nothing synchronizes.
//
// Quantized allreduce. Steps 1-6 of ffi/quantized_schedule.h, with these transport differences:
//   - NCCL needs counts on the host and a message's `used` word lives on the device, so every
//     quantized slice travels at its static capacity, kernels::QuantizedPackedWords(spec, len)
//     words (the decoders read only `used` of them). That is exact for OneBit, about 2 words
//     per column of slack for Adaptive, but for Threshold it is 1 + ceil(max_density * len)
//     words whatever the data: with the default max_density = 1 a Threshold slice costs as much
//     as a dense float slice. Pass a small max_density to Threshold on GPU.
//   - Reduce-scatter (step 3): a send of slice s to its owner s and a receive of my slice from
//     every other rank, posted together over the group's transport (one NCCL group). Allgather
//     (step 5): the same, in which every owner sends its quantized sum to every other rank
//     (slices differ in length, so no ncclAllGather without padding). Both move what the
//     CPU's pairwise/ring schedules move.
//   - The owner decodes the P contributions in rank order into a float sum starting at +0.0f
//     with the accumulate decoders (out += decoded, the CPU's float add), requantizes it with
//     a zero residual (the CPU's QuantizeSlice with a null residual for OneBit/Threshold: acc =
//     sum + 0.0f; Adaptive takes a null residual on both) and adds the requantization error to
//     its residual (kernels::AddInto). Every rank zero-fills the result and decodes the P
//     quantized sums into it with the same decoders. With the same kernels bit-identical to the
//     CPU's, the GPU result and residuals equal the CPU's bit for bit, identical on all ranks.
//   - Data errors cannot reach the host without synchronizing: where the CPU returns an error
//     (NaN/Inf in x + residual, a malformed message) the GPU makes the affected results NaN
//     (a compress writes packed[0] = 0, which every decoder turns into all-NaN).
//
// Hierarchical allreduce. The same chunk ownership as the CPU (local rank l ends the intra-node
// phase holding the node sum of chunk (l + 1) % L, ring::ChunkBegin boundaries), so the residual of
// the quantized inter-node phase lands where tests/reference.py hierarchical_quantized puts it:
//   intra-node reduce-scatter = ncclReduceScatter over L equal blocks of ceil(n / L) floats,
//     block r holding chunk (r + 1) % L zero-padded (NCCL needs equal counts);
//   inter-node = ncclAllReduce (dense) or the quantized allreduce above over the node group;
//   intra-node allgather = ncclAllGather of the same padded blocks;
//   single leader (leaders = 1): the reduce-scatter, then the chunks go to local rank 0 (one
//     NCCL group of sends/receives), the leader allreduces the whole vector across nodes and
//     ncclBroadcast shares it inside the node.
// NCCL sums floats in its own order inside the node (the CPU ring in another), so the
// hierarchical results equal the CPU's only up to float rounding of the dense intra-node sums
// (exactly where those sums are exact, e.g. L <= 2); every rank still gets the same bits.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/cuda/gpu_collective.h"
#include "ffi/quantized_common.h"
#include "ffi/quantized_schedule.h"
#include "ffi/ring_schedule.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_quantizer_table.h"
#include "kernels/quantized_slices.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {
namespace {

namespace kc = kernels::cuda;
using kernels::QuantizerSpec;
using quantized::kHierarchicalOp;
using quantized::kHierarchicalQuantizedOp;
using quantized::kQuantizedOp;
using quantized::QuantizerAttrs;

// ---- device counterparts of kernels/quantized_slices.h -----------------------------------

// The CUDA entry of the call's quantizer (kernels/cuda_quantizer_table.h) into *entry, or an
// error for a quantizer with CPU kernels only. Called before any communication, so every rank
// of a group refuses the call alike.
ffi::Error FindCudaEntry(const char* op, const QuantizerSpec& spec,
                         const kc::CudaQuantizer** entry) {
  *entry = kc::FindCudaQuantizer(spec.kind);
  if (*entry == nullptr) {
    return ffi_common::InvalidArgument(op, std::string("quantizer ") +
                                               quantized::KindLabel(spec.kind) +
                                               " has no CUDA kernels; run it on CPU");
  }
  return ffi::Error::Success();
}

// Scratch of QuantizeSliceGpu for a slice of n elements.
size_t QuantizeScratchBytes(const kc::CudaQuantizer& q, const QuantizerSpec& spec, int64_t n) {
  return n == 0 ? 0 : q.quantize_scratch_bytes(spec, n);
}

// kernels::QuantizeSlice on the device (the entry's quantize, kernels/cuda_quantizer_table.h):
// acc = x + residual_in (residual_in may be null: acc = x) of n >= 0 elements into packed
// (QuantizedPackedWords(spec, n) words) and residual_out = acc - decoded (may alias
// residual_in, not x). An empty slice is the single word used = 1.
cudaError_t QuantizeSliceGpu(const kc::CudaQuantizer& q, const QuantizerSpec& spec, const float* x,
                             const float* residual_in, int64_t n, uint32_t* packed,
                             float* residual_out, void* scratch, cudaStream_t stream) {
  if (n == 0) return kc::WriteWord(packed, 1u, stream);
  return q.quantize(spec, x, residual_in, n, packed, residual_out, scratch, stream);
}

// kernels::DequantizeAccumulate on the device: out[i] += decoded[i] for a message of n
// elements held in `words` words (its static capacity; the decoders check 1 <= used <= words,
// OneBit used == words). A malformed message makes out all-NaN instead of an error.
cudaError_t DequantizeAccumulateGpu(const kc::CudaQuantizer& q, const QuantizerSpec& spec,
                                    const uint32_t* packed, int64_t words, int64_t n, float* out,
                                    void* scratch, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;  // nothing to add (the CPU only checks used == 1)
  return q.dequantize_accumulate(spec, packed, words, n, out, scratch, stream);
}

// Steps (tags) of the quantized allreduce's messages; NCCL pairs them in posting order.
constexpr uint32_t kReduceScatterStep = 0;
constexpr uint32_t kAllgatherStep = 1;

// Runs `body` (which enqueues NCCL operations and returns the first failure) between
// ncclGroupStart and ncclGroupEnd; the group is closed even after a failure.
template <typename Body>
ffi::Error NcclGroup(GpuGroup& g, Body&& body) {
  JAXCOMM_RETURN_IF_ERROR(g.Check(g.nccl().group_start(), "ncclGroupStart"));
  ffi::Error first = body();
  ffi::Error end = g.Check(g.nccl().group_end(), "ncclGroupEnd");
  if (!first.success()) return first;
  return end;
}

template <typename T>
ffi::Error Allocate(ffi::ScratchAllocator& alloc, const char* name, int64_t count, T** out) {
  void* memory = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      AllocateScratch(alloc, name, sizeof(T) * static_cast<size_t>(count), &memory));
  *out = static_cast<T*>(memory);
  return ffi::Error::Success();
}

// ---- quantized allreduce -----------------------------------------------------------------

// Quantized allreduce (file comment) of acc = x + residual_in (residual_in may be null) of n
// elements over `g`: the sum into `out`, the new residual into `residual_out`. `out` may
// alias `x` (x is read in step 2, out first written in step 6, in stream order); residual_out
// may alias residual_in.
ffi::Error QuantizedAllreduceGpu(GpuGroup& g, ffi::ScratchAllocator& alloc, cudaStream_t stream,
                                 const QuantizerSpec& spec, const float* x,
                                 const float* residual_in, int64_t n, float* out,
                                 float* residual_out) {
  const char* name = g.group().name();
  const int parts = g.size();
  const int rank = g.rank();
  const kc::CudaQuantizer* codec = nullptr;
  JAXCOMM_RETURN_IF_ERROR(FindCudaEntry(name, spec, &codec));
  // 1. The slices and their places.
  quantized::SliceLayout layout;
  layout.Assign(spec, n, parts);
  const std::vector<int64_t>& offsets = layout.offsets;
  auto words = [&](int q) { return layout.Words(q); };
  size_t work_bytes = codec->decode_scratch_bytes(spec);
  for (int q = 0; q < parts; ++q) {
    work_bytes = std::max(work_bytes, QuantizeScratchBytes(*codec, spec, layout.Length(q)));
  }
  const int64_t my_begin = layout.Begin(rank);
  const int64_t m = layout.Length(rank);
  const int64_t my_words = words(rank);

  uint32_t* mine = nullptr;      // this rank's quantized slices
  uint32_t* gathered = nullptr;  // the quantized sums of every slice, same offsets
  uint32_t* incoming = nullptr;  // contribution of rank q to my slice at my_words * q
  float* sum = nullptr;          // my slice's float sum
  float* error = nullptr;        // its requantization error
  void* work = nullptr;          // kernel scratch, reused in stream order
  JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, layout.TotalWords(), &mine));
  JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, layout.TotalWords(), &gathered));
  JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, my_words * parts, &incoming));
  JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, std::max<int64_t>(m, 1), &sum));
  JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, std::max<int64_t>(m, 1), &error));
  JAXCOMM_RETURN_IF_ERROR(AllocateScratch(alloc, name, work_bytes, &work));

  // 2. Quantize every slice with error feedback (a counter-based stochastic rounding draws
  // from this rank's stream at the slice's element indices, as on the CPU).
  QuantizerSpec slice_spec = spec;
  slice_spec.stream = static_cast<uint32_t>(rank);
  for (int q = 0; q < parts; ++q) {
    const int64_t b = layout.Begin(q);
    slice_spec.first_index = b;
    JAXCOMM_RETURN_IF_ERROR(CheckCuda(
        name,
        QuantizeSliceGpu(*codec, slice_spec, x + b, residual_in ? residual_in + b : nullptr,
                         layout.Length(q), mine + offsets[q], residual_out + b, work, stream),
        "quantizing a slice"));
  }

  // 3. Reduce-scatter: slice s to its owner, my slice from every other rank, posted together
  // over the group's transport (one NCCL group on `stream`: ffi/cuda/nccl_transport.h), which
  // counts the traffic.
  Group& group = g.group();
  std::vector<transport::Request> requests;
  requests.reserve(static_cast<size_t>(2 * (parts - 1)));
  if (parts > 1) {
    for (int k = 1; k < parts; ++k) {
      const auto [dst, src] = quantized::PairwiseExchange(rank, parts, k);
      requests.push_back(group.PostSend(dst, mine + offsets[dst], sizeof(uint32_t) * words(dst),
                                        kReduceScatterStep));
      requests.push_back(group.PostRecv(src, incoming + my_words * src, sizeof(uint32_t) * my_words,
                                        kReduceScatterStep));
    }
    JAXCOMM_RETURN_IF_ERROR(group.Wait(requests.data(), requests.size()));
  }

  // 4. The owner sums the P contributions in rank order, requantizes, keeps the error.
  if (m > 0) {
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(name, cudaMemsetAsync(sum, 0, sizeof(float) * m, stream), "zeroing the sum"));
    for (int q = 0; q < parts; ++q) {
      const uint32_t* message = q == rank ? mine + offsets[rank] : incoming + my_words * q;
      JAXCOMM_RETURN_IF_ERROR(CheckCuda(
          name, DequantizeAccumulateGpu(*codec, spec, message, my_words, m, sum, work, stream),
          "decoding a contribution"));
    }
  }
  slice_spec.stream = static_cast<uint32_t>(parts);  // the owners' sums: stream P
  slice_spec.first_index = my_begin;
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(name,
                                    QuantizeSliceGpu(*codec, slice_spec, sum, nullptr, m,
                                                     gathered + offsets[rank], error, work, stream),
                                    "requantizing the sum"));
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(name, kc::AddInto(residual_out + my_begin, error, m, stream), "residual update"));

  // 5. Allgather: every owner sends its quantized sum to every other rank.
  if (parts > 1) {
    requests.clear();
    for (int k = 1; k < parts; ++k) {
      const auto [dst, src] = quantized::PairwiseExchange(rank, parts, k);
      requests.push_back(group.PostSend(dst, gathered + offsets[rank], sizeof(uint32_t) * my_words,
                                        kAllgatherStep));
      requests.push_back(group.PostRecv(src, gathered + offsets[src], sizeof(uint32_t) * words(src),
                                        kAllgatherStep));
    }
    JAXCOMM_RETURN_IF_ERROR(group.Wait(requests.data(), requests.size()));
  }

  // 6. Decode every quantized sum into the zero-filled result.
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(name, cudaMemsetAsync(out, 0, sizeof(float) * n, stream), "zeroing the result"));
  for (int q = 0; q < parts; ++q) {
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(name,
                  DequantizeAccumulateGpu(*codec, spec, gathered + offsets[q], words(q),
                                          layout.Length(q), out + layout.Begin(q), work, stream),
                  "decoding a quantized sum"));
  }
  group.CountDenseEquivalent(ring::DenseRingBytes(n, parts, rank));
  return ffi::Error::Success();
}

// The flat quantized allreduce of one call; `step` is the step operand in device memory (null
// without one). Without error feedback the residual is neither read nor kept.
ffi::Error RunQuantizedCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                            const Caller& caller, const QuantizerAttrs& quantizer,
                            const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& residual,
                            const int32_t* step, ffi::ResultBuffer<ffi::F32> summed,
                            ffi::ResultBuffer<ffi::F32> new_residual) {
  quantized::QuantizedCall call;
  JAXCOMM_RETURN_IF_ERROR(quantized::CheckQuantizedCall(kQuantizedOp, x, residual, summed,
                                                        new_residual, quantizer, &call));
  // A quantizer with CPU kernels only is refused before any communication.
  const kc::CudaQuantizer* entry = nullptr;
  JAXCOMM_RETURN_IF_ERROR(FindCudaEntry(kQuantizedOp, call.spec, &entry));
  call.spec.device_step = step;
  GpuSite site;
  std::unique_ptr<GpuGroup> group;
  JAXCOMM_RETURN_IF_ERROR(BeginGpuCall(kQuantizedOp, stream, caller, &site, &group));
  if (call.n > 0) {
    const bool feedback = call.spec.error_feedback;
    float* residual_out = new_residual->typed_data();
    JAXCOMM_RETURN_IF_ERROR(QuantizedAllreduceGpu(
        *group, scratch, stream, call.spec, x.typed_data(),
        feedback ? residual.typed_data() : nullptr, call.n, summed->typed_data(), residual_out));
    if (!feedback) {
      JAXCOMM_RETURN_IF_ERROR(
          CheckCuda(kQuantizedOp, cudaMemsetAsync(residual_out, 0, sizeof(float) * call.n, stream),
                    "zeroing the residual"));
    }
  }
  JAXCOMM_RETURN_IF_ERROR(group->Watch(stream));
  group->Finish(quantized::KindLabel(call.spec.kind), call.n);
  return ffi::Error::Success();
}

ffi::Error QuantizedAllreduceCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                  const Caller& caller, const QuantizerAttrs& quantizer,
                                  ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                                  ffi::ResultBuffer<ffi::F32> summed,
                                  ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunQuantizedCuda(stream, scratch, caller, quantizer, x, residual, nullptr, summed,
                          new_residual);
}

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_quantized_allreduce", QuantizedAllreduceCuda,
                              quantized::BindQuantizedData);

ffi::Error BlockQuantAllreduceCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                   const Caller& caller, const QuantizerAttrs& quantizer,
                                   ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                                   ffi::BufferR0<ffi::S32> step, ffi::ResultBuffer<ffi::F32> summed,
                                   ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunQuantizedCuda(stream, scratch, caller, quantizer, x, residual, step.typed_data(),
                          summed, new_residual);
}

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_blockquant_allreduce", BlockQuantAllreduceCuda,
                              quantized::BindQuantizedData</*stepped=*/true>);

// ---- hierarchical ------------------------------------------------------------------------

// The groups of one hierarchical call, begun in the CPU's order (all, local, node): `all`
// only records the call's metrics (no communicator), `local` = this node's ranks, `node` = the
// ranks with this local index on every node.
struct Hierarchy {
  std::unique_ptr<Group> all;
  std::unique_ptr<GpuGroup> local, node;
  std::vector<int64_t> local_mask, node_mask;  // reduce masks the sites point into
};

ffi::Error BeginHierarchy(const char* op, const GpuSite& site, const HierarchyAttrs& hierarchy,
                          Hierarchy* h) {
  const int64_t node_axis = hierarchy.node_axis;
  const int64_t local_axis = hierarchy.local_axis;
  const ffi::Span<const int64_t> reduce_axes = site.site.reduce_axes;
  const int64_t axes = static_cast<int64_t>(site.site.mesh_axis_sizes.size());
  if (node_axis < 0 || node_axis >= axes || local_axis < 0 || local_axis >= axes ||
      node_axis == local_axis || !reduce_axes[node_axis] || !reduce_axes[local_axis]) {
    return ffi_common::InvalidArgument(
        op, "node_axis and local_axis must be two distinct reduced mesh axes");
  }
  h->local_mask.assign(reduce_axes.begin(), reduce_axes.end());
  h->node_mask = h->local_mask;
  h->local_mask[node_axis] = 0;
  h->node_mask[local_axis] = 0;
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(site.site, &h->all));
  JAXCOMM_RETURN_IF_ERROR(GpuGroup::Begin(site, site.WithReduceAxes(h->local_mask), &h->local));
  return GpuGroup::Begin(site, site.WithReduceAxes(h->node_mask), &h->node);
}

// Block r of the padded intra-node layout holds chunk (r + 1) % L, the chunk local rank r owns.
struct Chunks {
  int64_t n;
  int parts;
  int64_t block;  // ceil(n / L) floats per block
  int Owned(int rank) const { return ring::OwnedChunk(rank, parts); }
  int64_t Begin(int chunk) const { return ring::ChunkBegin(n, parts, chunk); }
  int64_t Size(int chunk) const { return ring::ChunkSize(n, parts, chunk); }
};

ffi::Error CopyFloats(const char* name, float* dst, const float* src, int64_t count,
                      cudaStream_t stream) {
  if (count == 0 || dst == src) return ffi::Error::Success();
  return CheckCuda(
      name, cudaMemcpyAsync(dst, src, sizeof(float) * count, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpyAsync");
}

// Intra-node reduce-scatter with the CPU's ownership: afterwards data[chunk (l + 1) % L] of
// local rank l holds the node sum of that chunk (other chunks keep this rank's values).
ffi::Error IntraReduceScatter(GpuGroup& local, const Chunks& c, float* data, float* padded,
                              cudaStream_t stream) {
  const char* name = local.group().name();
  const int rank = local.rank();
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(
      name, cudaMemsetAsync(padded, 0, sizeof(float) * c.block * c.parts, stream), "padding"));
  for (int r = 0; r < c.parts; ++r) {
    const int chunk = c.Owned(r);
    JAXCOMM_RETURN_IF_ERROR(
        CopyFloats(name, padded + c.block * r, data + c.Begin(chunk), c.Size(chunk), stream));
  }
  // In place: rank r's result lands on its own block r.
  JAXCOMM_RETURN_IF_ERROR(
      local.Check(local.nccl().reduce_scatter(padded, padded + c.block * rank, c.block, ncclFloat32,
                                              ncclSum, local.comm(), stream),
                  "ncclReduceScatter"));
  const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(c.block) * (c.parts - 1);
  local.CountTraffic(bytes, bytes);
  const int mine = c.Owned(rank);
  return CopyFloats(name, data + c.Begin(mine), padded + c.block * rank, c.Size(mine), stream);
}

// Intra-node allgather matching IntraReduceScatter: local rank l contributes its chunk
// (l + 1) % L, everybody ends with every chunk.
ffi::Error IntraAllgather(GpuGroup& local, const Chunks& c, float* data, float* padded,
                          cudaStream_t stream) {
  const char* name = local.group().name();
  const int rank = local.rank();
  const int mine = c.Owned(rank);
  JAXCOMM_RETURN_IF_ERROR(
      CopyFloats(name, padded + c.block * rank, data + c.Begin(mine), c.Size(mine), stream));
  JAXCOMM_RETURN_IF_ERROR(
      local.Check(local.nccl().all_gather(padded + c.block * rank, padded, c.block, ncclFloat32,
                                          local.comm(), stream),
                  "ncclAllGather"));
  const uint64_t bytes = sizeof(float) * static_cast<uint64_t>(c.block) * (c.parts - 1);
  local.CountTraffic(bytes, bytes);
  for (int r = 0; r < c.parts; ++r) {
    const int chunk = c.Owned(r);
    JAXCOMM_RETURN_IF_ERROR(
        CopyFloats(name, data + c.Begin(chunk), padded + c.block * r, c.Size(chunk), stream));
  }
  return ffi::Error::Success();
}

// Allreduce of data[0, n) across nodes: dense ncclAllReduce, or quantized with the residual of
// the quantized part in residual_out (zero elsewhere is the caller's job). Every member of the
// node group has the same local index, hence the same n: an empty chunk is skipped by all.
ffi::Error InterNode(GpuGroup& node, ffi::ScratchAllocator& alloc, cudaStream_t stream,
                     const QuantizerSpec* spec, float* data, int64_t n, float* residual_out) {
  if (n == 0) return ffi::Error::Success();
  if (spec != nullptr) {
    return QuantizedAllreduceGpu(node, alloc, stream, *spec, data, nullptr, n, data, residual_out);
  }
  JAXCOMM_RETURN_IF_ERROR(
      node.Check(node.nccl().all_reduce(data, data, n, ncclFloat32, ncclSum, node.comm(), stream),
                 "ncclAllReduce"));
  CountDenseRing(node, n);
  return ffi::Error::Success();
}

// Hierarchical allreduce (file comment) of out[0, n), this rank's contribution on entry and
// the total on return; residual_out (null for dense) gets the inter-node quantization error.
ffi::Error HierarchicalGpu(Hierarchy& h, ffi::ScratchAllocator& alloc, cudaStream_t stream,
                           const QuantizerSpec* spec, int64_t leaders, float* out, int64_t n,
                           float* residual_out) {
  GpuGroup& local = *h.local;
  const char* name = local.group().name();
  const int parts = local.size();
  const int rank = local.rank();
  const Chunks c{n, parts, (n + parts - 1) / parts};
  float* padded = nullptr;
  if (parts > 1) {
    JAXCOMM_RETURN_IF_ERROR(Allocate(alloc, name, c.block * parts, &padded));
    JAXCOMM_RETURN_IF_ERROR(IntraReduceScatter(local, c, out, padded, stream));
  }
  const int owned = c.Owned(rank);
  const int64_t begin = c.Begin(owned);
  if (leaders > 1 || parts == 1) {
    JAXCOMM_RETURN_IF_ERROR(InterNode(*h.node, alloc, stream, spec, out + begin, c.Size(owned),
                                      residual_out ? residual_out + begin : nullptr));
    if (parts > 1) JAXCOMM_RETURN_IF_ERROR(IntraAllgather(local, c, out, padded, stream));
    return ffi::Error::Success();
  }
  // Single leader: the reduced chunks go to local rank 0, which allreduces the whole vector
  // across nodes and broadcasts it inside the node.
  const ncclComm_t comm = local.comm();
  const nccl::NcclApi& api = local.nccl();
  uint64_t sent = 0, received = 0;
  JAXCOMM_RETURN_IF_ERROR(NcclGroup(local, [&]() -> ffi::Error {
    if (rank != 0) {
      if (c.Size(owned) > 0) {
        JAXCOMM_RETURN_IF_ERROR(local.Check(
            api.send(out + begin, c.Size(owned), ncclFloat32, 0, comm, stream), "ncclSend"));
        sent += sizeof(float) * c.Size(owned);
      }
      return ffi::Error::Success();
    }
    for (int q = 1; q < parts; ++q) {
      const int chunk = c.Owned(q);
      if (c.Size(chunk) == 0) continue;
      JAXCOMM_RETURN_IF_ERROR(local.Check(
          api.recv(out + c.Begin(chunk), c.Size(chunk), ncclFloat32, q, comm, stream), "ncclRecv"));
      received += sizeof(float) * c.Size(chunk);
    }
    return ffi::Error::Success();
  }));
  if (rank == 0) {
    JAXCOMM_RETURN_IF_ERROR(InterNode(*h.node, alloc, stream, spec, out, n, residual_out));
  }
  JAXCOMM_RETURN_IF_ERROR(
      local.Check(api.broadcast(out, out, n, ncclFloat32, 0, comm, stream), "ncclBroadcast"));
  if (rank == 0) {
    sent += sizeof(float) * n;
  } else {
    received += sizeof(float) * n;
  }
  local.CountTraffic(sent, received);
  return ffi::Error::Success();
}

// Watch both communicators, fold their traffic into the call's line and record it.
ffi::Error FinishHierarchy(Hierarchy& h, cudaStream_t stream, const std::string& label, int64_t n) {
  JAXCOMM_RETURN_IF_ERROR(h.local->Watch(stream));
  JAXCOMM_RETURN_IF_ERROR(h.node->Watch(stream));
  h.all->Absorb(h.local->group());
  h.all->Absorb(h.node->group());
  h.all->Finish(label.c_str(), n);
  return ffi::Error::Success();
}

ffi::Error HierarchicalDenseCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                 const Caller& caller, const HierarchyAttrs& hierarchy,
                                 ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t leaders = hierarchy.leaders;
  const int64_t n = ffi_common::NumElements(x);
  JAXCOMM_RETURN_IF_ERROR(
      quantized::CheckSizes(kHierarchicalOp, n, {ffi_common::NumElements(*out)}));
  GpuSite site;
  JAXCOMM_RETURN_IF_ERROR(ResolveGpuSite(kHierarchicalOp, stream, caller, &site));
  Hierarchy h;
  JAXCOMM_RETURN_IF_ERROR(BeginHierarchy(kHierarchicalOp, site, hierarchy, &h));
  if (n > 0) {
    JAXCOMM_RETURN_IF_ERROR(
        CopyFloats(kHierarchicalOp, out->typed_data(), x.typed_data(), n, stream));
    JAXCOMM_RETURN_IF_ERROR(
        HierarchicalGpu(h, scratch, stream, nullptr, leaders, out->typed_data(), n, nullptr));
  }
  return FinishHierarchy(h, stream,
                         leaders > 1 ? "hierarchical_dense" : "hierarchical_dense_leader", n);
}

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_hierarchical_allreduce", HierarchicalDenseCuda,
                              quantized::BindHierarchicalDenseData);

// The hierarchical quantized allreduce of one call (`step` as for RunQuantizedCuda).
ffi::Error RunHierarchicalCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                               const Caller& caller, const HierarchyAttrs& hierarchy,
                               const QuantizerAttrs& quantizer, const ffi::Buffer<ffi::F32>& x,
                               const ffi::Buffer<ffi::F32>& residual, const int32_t* step,
                               ffi::ResultBuffer<ffi::F32> summed,
                               ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t leaders = hierarchy.leaders;
  const char* op = kHierarchicalQuantizedOp;
  quantized::QuantizedCall call;
  JAXCOMM_RETURN_IF_ERROR(
      quantized::CheckQuantizedCall(op, x, residual, summed, new_residual, quantizer, &call));
  // A quantizer with CPU kernels only is refused before any communication.
  const kc::CudaQuantizer* entry = nullptr;
  JAXCOMM_RETURN_IF_ERROR(FindCudaEntry(op, call.spec, &entry));
  call.spec.device_step = step;
  const bool feedback = call.spec.error_feedback;
  GpuSite site;
  JAXCOMM_RETURN_IF_ERROR(ResolveGpuSite(op, stream, caller, &site));
  Hierarchy h;
  JAXCOMM_RETURN_IF_ERROR(BeginHierarchy(op, site, hierarchy, &h));
  if (call.n > 0) {
    float* out = summed->typed_data();
    float* residual_out = new_residual->typed_data();
    // acc = x + residual before the residual is cleared (residual may alias new_residual).
    if (feedback) {
      JAXCOMM_RETURN_IF_ERROR(
          CheckCuda(op, kc::AddVectors(x.typed_data(), residual.typed_data(), call.n, out, stream),
                    "x + residual"));
    } else {
      JAXCOMM_RETURN_IF_ERROR(CopyFloats(op, out, x.typed_data(), call.n, stream));
    }
    // Only the part this rank quantizes gets an error; the dense phases lose nothing.
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(op, cudaMemsetAsync(residual_out, 0, sizeof(float) * call.n, stream),
                  "zeroing the residual"));
    JAXCOMM_RETURN_IF_ERROR(
        HierarchicalGpu(h, scratch, stream, &call.spec, leaders, out, call.n, residual_out));
    if (!feedback) {
      JAXCOMM_RETURN_IF_ERROR(
          CheckCuda(op, cudaMemsetAsync(residual_out, 0, sizeof(float) * call.n, stream),
                    "zeroing the residual"));
    }
  }
  const std::string label = std::string("hierarchical_") + quantized::KindLabel(call.spec.kind) +
                            (leaders > 1 ? "" : "_leader");
  return FinishHierarchy(h, stream, label, call.n);
}

ffi::Error HierarchicalQuantizedCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                     const Caller& caller, const HierarchyAttrs& hierarchy,
                                     const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                     ffi::Buffer<ffi::F32> residual,
                                     ffi::ResultBuffer<ffi::F32> summed,
                                     ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunHierarchicalCuda(stream, scratch, caller, hierarchy, quantizer, x, residual, nullptr,
                             summed, new_residual);
}

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_hierarchical_quantized", HierarchicalQuantizedCuda,
                              quantized::BindHierarchicalQuantizedData);

ffi::Error HierarchicalBlockQuantCuda(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                                      const Caller& caller, const HierarchyAttrs& hierarchy,
                                      const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                      ffi::Buffer<ffi::F32> residual, ffi::BufferR0<ffi::S32> step,
                                      ffi::ResultBuffer<ffi::F32> summed,
                                      ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunHierarchicalCuda(stream, scratch, caller, hierarchy, quantizer, x, residual,
                             step.typed_data(), summed, new_residual);
}

JAXCOMM_DEFINE_GPU_COLLECTIVE("jaxcomm_hierarchical_blockquant", HierarchicalBlockQuantCuda,
                              quantized::BindHierarchicalQuantizedData</*stepped=*/true>);

}  // namespace
}  // namespace jaxcomm::collectives::gpu
