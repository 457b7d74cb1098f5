// The CUDA adaptive kernels (kernels/cuda_kernels.h), called directly, against the CPU kernel
// (kernels/adaptive.h): the same packed and residual bytes, decompress with and without
// accumulate, corrupt messages decoding to NaN. Without XLA in between, the inputs may hold
// what an XLA CPU thread would flush (denormals) and residual_in may be null or aliased.
//
// Compiled only in CUDA builds (JAXCOMM_WITH_CUDA) and skipped without a GPU; tests/test_gpu.py
// builds and runs it on GPU machines.
#if JAXCOMM_WITH_CUDA

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/adaptive.h"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::kernels {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device copy of a host vector (at least one element, so that pointers are never null).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t size) : size_(size) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data_), (size ? size : 1) * sizeof(T)),
              cudaSuccess);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { Put(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void Put(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> Get() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
  T* data() const { return data_; }

 private:
  T* data_ = nullptr;
  size_t size_;
};

template <typename T>
void ExpectSameBytes(const std::vector<T>& want, const std::vector<T>& got, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &want[i], sizeof(a));
    std::memcpy(&b, &got[i], sizeof(b));
    ASSERT_EQ(a, b) << what << " differs at " << i << " of " << want.size();
  }
}

std::vector<float> Data(int64_t n, const std::string& kind, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    if (kind == "normal") {
      v[i] = normal(gen);
    } else if (kind == "ties") {  // few distinct values: the tie-break decides the selection
      v[i] = static_cast<float>(static_cast<int>(gen() % 7) - 3);
    } else {  // "special": signed zeros, denormals, tiny and huge finite values
      const float pool[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 3e-39f, -3e-39f, 1e-30f, -2.5f,
                            2.5f, 1e30f, -1e30f, 7.0f,    -7.0f,  1.0f,    -1.0f};
      v[i] = pool[gen() % (sizeof(pool) / sizeof(pool[0]))];
    }
  }
  return v;
}

struct Case {
  int64_t n;
  int64_t column_size;
  double proportion;
  int64_t sample_size;
};

std::string Name(const Case& c, const std::string& kind) {
  return "n=" + std::to_string(c.n) + " column_size=" + std::to_string(c.column_size) +
         " proportion=" + std::to_string(c.proportion) +
         " sample_size=" + std::to_string(c.sample_size) + " data=" + kind;
}

enum class Residual { kNull, kSeparate, kAliased };

// Compresses on both sides and compares every word of packed and every residual bit, then
// decompresses the GPU's packed on both sides, plain and accumulating.
void CompareWithCpu(const Case& c, const std::string& kind, Residual residual) {
  SCOPED_TRACE(Name(c, kind) + " residual=" + std::to_string(static_cast<int>(residual)));
  const AdaptiveLayout layout{c.n, c.column_size, c.proportion};
  const int64_t words = layout.PackedWords();
  const std::vector<float> x = Data(c.n, kind, 1);
  std::vector<float> r = Data(c.n, kind == "special" ? kind : "normal", 2);
  for (float& v : r) v *= 0.25f;
  const bool has_r = residual != Residual::kNull;

  std::vector<uint32_t> cpu_packed(words, 0xdeadbeefu);
  std::vector<float> cpu_residual(c.n);
  ASSERT_EQ(AdaptiveCompress(x.data(), has_r ? r.data() : nullptr, layout, c.sample_size,
                             cpu_packed.data(), cpu_residual.data()),
            -1);

  DeviceArray<float> d_x(x);
  DeviceArray<float> d_r(r);
  DeviceArray<float> d_out(static_cast<size_t>(c.n));
  DeviceArray<uint32_t> d_packed(static_cast<size_t>(words));
  CUDA_OK(cudaMemset(d_packed.data(), 0xab, words * sizeof(uint32_t)));
  DeviceArray<char> scratch(
      cuda::AdaptiveCompressScratchBytes(c.n, c.column_size, c.proportion, c.sample_size));
  float* residual_out = residual == Residual::kAliased ? d_r.data() : d_out.data();
  CUDA_OK(cuda::AdaptiveCompress(d_x.data(), has_r ? d_r.data() : nullptr, c.n, c.column_size,
                                 c.proportion, c.sample_size, d_packed.data(), residual_out,
                                 scratch.data(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> gpu_packed = d_packed.Get();
  ExpectSameBytes(cpu_packed, gpu_packed, "packed");
  ExpectSameBytes(cpu_residual, residual == Residual::kAliased ? d_r.Get() : d_out.Get(),
                  "residual");

  DeviceArray<char> decode_scratch(cuda::AdaptiveDecompressScratchBytes());
  for (const bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "plain");
    std::vector<float> cpu_x_hat = Data(c.n, "normal", 3);  // what accumulate adds to
    DeviceArray<float> d_x_hat(cpu_x_hat);
    ASSERT_EQ(AdaptiveDecompress(gpu_packed.data(), words, layout, cpu_x_hat.data(), accumulate),
              "");
    CUDA_OK(cuda::AdaptiveDecompress(d_packed.data(), words, c.n, c.column_size, c.proportion,
                                     d_x_hat.data(), accumulate, decode_scratch.data(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    ExpectSameBytes(cpu_x_hat, d_x_hat.Get(), "x_hat");
  }
}

TEST(AdaptiveCudaTest, MatchesCpuKernel) {
  SKIP_WITHOUT_GPU();
  // Column sizes below and above the 4096 elements staged in shared memory, ragged last
  // columns, one column longer than a block, a sample above the staged size.
  const Case cases[] = {
      {1, 1024, 64.0, 0},         {7, 3, 3.5, 0},
      {1000, 64, 64.0, 0},        {1000, 7, 1.0, 0},
      {1000, 333, 3.5, 0},        {100003, 1024, 64.0, 0},
      {100003, 1000, 3.5, 0},     {100003, 5000, 64.0, 0},
      {100003, 1 << 20, 64.0, 0}, {100003, 4096, 1000, 0},
      {1, 1024, 64.0, 256},       {7, 3, 3.5, 5},
      {1000, 64, 64.0, 48},       {1000, 333, 3.5, 1},
      {100003, 1024, 64.0, 256},  {100003, 1000, 3.5, 300},
      {100003, 5000, 64.0, 5000}, {100003, 5000, 64.0, 256},
      {100003, 64, 2.0, 6000},    {100003, 1 << 20, 64.0, 256},
  };
  for (const Case& c : cases) {
    for (const char* kind : {"normal", "ties", "special"}) {
      for (const Residual residual : {Residual::kNull, Residual::kSeparate, Residual::kAliased}) {
        CompareWithCpu(c, kind, residual);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(AdaptiveCudaTest, NonFiniteMarksHeader) {
  SKIP_WITHOUT_GPU();
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    for (const int64_t sample_size : {int64_t{0}, int64_t{64}}) {
      const int64_t n = 5000;
      const AdaptiveLayout layout{n, 1024, 64.0};
      std::vector<float> x = Data(n, "normal", 4);
      x[3777] = bad;
      DeviceArray<float> d_x(x);
      DeviceArray<float> d_r(std::vector<float>(n, 0.0f));
      DeviceArray<uint32_t> d_packed(static_cast<size_t>(layout.PackedWords()));
      DeviceArray<char> scratch(cuda::AdaptiveCompressScratchBytes(n, 1024, 64.0, sample_size));
      CUDA_OK(cuda::AdaptiveCompress(d_x.data(), d_r.data(), n, 1024, 64.0, sample_size,
                                     d_packed.data(), d_r.data(), scratch.data(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(d_packed.Get()[0], 0u);
    }
  }
}

// Every corruption the CPU decompress rejects decodes to all-NaN, with or without accumulate.
TEST(AdaptiveCudaTest, CorruptMessagesDecodeToNaN) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 64;
  const AdaptiveLayout layout{n, 16, 4.0};  // 4 columns of capacity min(16, 2 * 4 + 2) = 10
  const int64_t header = layout.HeaderWords();
  const int64_t words = layout.PackedWords();
  std::vector<uint32_t> valid(words, 0u);
  AdaptiveCompress(Data(n, "normal", 5).data(), nullptr, layout, 0, valid.data(),
                   std::vector<float>(n).data());
  ASSERT_GT(valid[0], header + 1);
  std::vector<std::vector<uint32_t>> corrupt;
  auto with = [&](int64_t word, uint32_t value) {
    std::vector<uint32_t> p = valid;
    p[word] = value;
    corrupt.push_back(p);
  };
  with(0, static_cast<uint32_t>(words + 1));   // used beyond the buffer
  with(0, static_cast<uint32_t>(header - 1));  // used inside the header
  with(header, 64u);                           // index out of range
  with(header + 1, valid[header]);             // not ascending (repeated)
  std::vector<uint32_t> full(words, 0u);       // column 0 over its capacity of 10
  full[0] = static_cast<uint32_t>(header + 11);
  for (uint32_t j = 0; j < 11; ++j) full[header + j] = 0x80000000u | j;
  corrupt.push_back(full);

  DeviceArray<char> decode_scratch(cuda::AdaptiveDecompressScratchBytes());
  for (size_t k = 0; k < corrupt.size(); ++k) {
    SCOPED_TRACE("corruption " + std::to_string(k));
    std::vector<float> cpu_out(n, 1.0f);
    EXPECT_NE(AdaptiveDecompress(corrupt[k].data(), words, layout, cpu_out.data()), "");
    DeviceArray<uint32_t> d_packed(corrupt[k]);
    for (const bool accumulate : {false, true}) {
      DeviceArray<float> d_out(std::vector<float>(n, 1.0f));
      CUDA_OK(cuda::AdaptiveDecompress(d_packed.data(), words, n, 16, 4.0, d_out.data(), accumulate,
                                       decode_scratch.data(), nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      for (const float v : d_out.Get()) ASSERT_TRUE(std::isnan(v)) << "accumulate=" << accumulate;
    }
  }
}

}  // namespace
}  // namespace jaxcomm::kernels

#endif  // JAXCOMM_WITH_CUDA
