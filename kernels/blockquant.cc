#include "kernels/blockquant.h"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <vector>

#include "kernels/quantizer_table.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

// t + 1.5 * 2^23 - 1.5 * 2^23 is t rounded to the nearest integer, ties to even (the default
// rounding mode), for |t| < 2^22: the sum lies in [2^23, 2^24), where floats are the integers.
// Unlike std::nearbyint it vectorizes on baseline x86-64 (no SSE4.1 roundps); without
// -ffast-math the compiler keeps the two additions.
constexpr float kRoundMagic = 12582912.0f;
// Stochastic rounding's floor: y + 256 is positive for every |y| <= 128, where truncation is
// floor (see BlockQuantParams in the header for the exact definition).
constexpr float kFloorShift = 256.0f;

#define JAXCOMM_ALWAYS_INLINE inline __attribute__((always_inline))

// The loops below are written once (the *Body functions) and compiled twice: for baseline
// x86-64 and, on x86, inside a target("avx2") wrapper chosen at run time
// (QuantizersUseAvx2()). "avx2" leaves out FMA, so both perform the same IEEE operations in the
// same order and produce the same bytes.

// acc[i] = x[i] + r[i] and the largest magnitude key (kernels/quantize_status.h).
JAXCOMM_ALWAYS_INLINE uint32_t AccumulateBody(const float* __restrict x, const float* __restrict r,
                                              int64_t len, float* __restrict acc) {
  uint32_t max_key = 0;
  for (int64_t i = 0; i < len; ++i) {
    const float a = x[i] + r[i];
    acc[i] = a;
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof(bits));
    const uint32_t key = bits & 0x7fffffffu;
    max_key = max_key > key ? max_key : key;
  }
  return max_key;
}

JAXCOMM_ALWAYS_INLINE uint32_t MaxKeyBody(const float* __restrict x, int64_t len) {
  uint32_t max_key = 0;
  for (int64_t i = 0; i < len; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    const uint32_t key = bits & 0x7fffffffu;
    max_key = max_key > key ? max_key : key;
  }
  return max_key;
}

// codes[i] = round(acc[i] * inv) clamped to [-qmax, qmax]; residual_out[i] = acc[i] - code *
// scale (when kResidual).
template <bool kStochastic, bool kResidual>
JAXCOMM_ALWAYS_INLINE void EncodeBody(const float* __restrict acc, int64_t len, float scale,
                                      float inv, float qmax, uint32_t key, uint32_t first,
                                      int8_t* __restrict codes, float* __restrict residual_out) {
  for (int64_t i = 0; i < len; ++i) {
    const float t = acc[i] * inv;
    float q;
    if (kStochastic) {
      const float y = t + BlockQuantUniform(key, first + static_cast<uint32_t>(i));
      q = static_cast<float>(static_cast<int32_t>(y + kFloorShift)) - kFloorShift;
    } else {
      q = (t + kRoundMagic) - kRoundMagic;
    }
    q = q < -qmax ? -qmax : q;
    q = q > qmax ? qmax : q;
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(q));
    if (kResidual) residual_out[i] = acc[i] - q * scale;
  }
}

// out[i] (+)= float(codes[i]) * scale.
template <bool kAccumulate>
JAXCOMM_ALWAYS_INLINE void DecodeBody(const int8_t* __restrict codes, int64_t len, float scale,
                                      float* __restrict out) {
  for (int64_t i = 0; i < len; ++i) {
    const float d = static_cast<float>(codes[i]) * scale;
    out[i] = kAccumulate ? out[i] + d : d;
  }
}

// Nibbles of int4 codes: byte j = codes[2j] & 15 | codes[2j + 1] << 4 (len even).
JAXCOMM_ALWAYS_INLINE void PackNibblesBody(const int8_t* __restrict codes, int64_t len,
                                           uint8_t* __restrict bytes) {
  for (int64_t j = 0; j < len / 2; ++j) {
    bytes[j] = static_cast<uint8_t>((static_cast<uint8_t>(codes[2 * j]) & 0x0fu) |
                                    (static_cast<uint8_t>(codes[2 * j + 1]) << 4));
  }
}

JAXCOMM_ALWAYS_INLINE void UnpackNibblesBody(const uint8_t* __restrict bytes, int64_t len,
                                             int8_t* __restrict codes) {
  for (int64_t j = 0; j < len / 2; ++j) {
    const uint8_t b = bytes[j];
    codes[2 * j] = static_cast<int8_t>(static_cast<int8_t>(b << 4) >> 4);  // sign-extend
    codes[2 * j + 1] = static_cast<int8_t>(static_cast<int8_t>(b) >> 4);
  }
}

// One set of the loops, for one instruction set.
struct Loops {
  uint32_t (*accumulate)(const float*, const float*, int64_t, float*);
  uint32_t (*max_key)(const float*, int64_t);
  void (*encode[2][2])(const float*, int64_t, float, float, float, uint32_t, uint32_t, int8_t*,
                       float*);                              // [stochastic][residual]
  void (*decode[2])(const int8_t*, int64_t, float, float*);  // [accumulate]
  void (*pack)(const int8_t*, int64_t, uint8_t*);
  void (*unpack)(const uint8_t*, int64_t, int8_t*);
};

#define JAXCOMM_BQ_LOOPS(ATTR, NAME)                                                         \
  ATTR uint32_t NAME##Accumulate(const float* x, const float* r, int64_t len, float* acc) {  \
    return AccumulateBody(x, r, len, acc);                                                   \
  }                                                                                          \
  ATTR uint32_t NAME##MaxKey(const float* x, int64_t len) { return MaxKeyBody(x, len); }     \
  template <bool kStochastic, bool kResidual>                                                \
  ATTR void NAME##Encode(const float* acc, int64_t len, float scale, float inv, float qmax,  \
                         uint32_t key, uint32_t first, int8_t* codes, float* residual_out) { \
    EncodeBody<kStochastic, kResidual>(acc, len, scale, inv, qmax, key, first, codes,        \
                                       residual_out);                                        \
  }                                                                                          \
  template <bool kAccumulate>                                                                \
  ATTR void NAME##Decode(const int8_t* codes, int64_t len, float scale, float* out) {        \
    DecodeBody<kAccumulate>(codes, len, scale, out);                                         \
  }                                                                                          \
  ATTR void NAME##Pack(const int8_t* codes, int64_t len, uint8_t* bytes) {                   \
    PackNibblesBody(codes, len, bytes);                                                      \
  }                                                                                          \
  ATTR void NAME##Unpack(const uint8_t* bytes, int64_t len, int8_t* codes) {                 \
    UnpackNibblesBody(bytes, len, codes);                                                    \
  }                                                                                          \
  const Loops NAME##Loops = {NAME##Accumulate,                                               \
                             NAME##MaxKey,                                                   \
                             {{NAME##Encode<false, false>, NAME##Encode<false, true>},       \
                              {NAME##Encode<true, false>, NAME##Encode<true, true>}},        \
                             {NAME##Decode<false>, NAME##Decode<true>},                      \
                             NAME##Pack,                                                     \
                             NAME##Unpack};

JAXCOMM_BQ_LOOPS(, Portable)
#if JAXCOMM_QUANTIZERS_X86
JAXCOMM_BQ_LOOPS(__attribute__((target("avx2"))), Avx2)
#endif

const Loops& PickLoops() {
#if JAXCOMM_QUANTIZERS_X86
  if (QuantizersUseAvx2()) return Avx2Loops;
#endif
  return PortableLoops;
}

int64_t CodeWords(int64_t n, int64_t bits) { return (n * bits + 31) / 32; }

// Elements per chunk: whole blocks, an even count (int4 chunks start on a byte), about 4096
// elements so the scratch stays in L1/L2.
int64_t ChunkElements(int64_t block) {
  int64_t chunk = block * std::max<int64_t>(1, 4096 / block);
  return chunk % 2 ? 2 * chunk : chunk;
}

// Splits the chunks of n elements into tasks of at least kMinElementsPerTask elements; the
// split depends on n and block only, and each block's bytes on that block only.
template <typename Fn>
void ForChunkRanges(int64_t n, int64_t chunk, const TaskRunner& run, Fn&& fn) {
  const int num_tasks = NumTasksFor(n, std::max(kMinElementsPerTask, chunk), kMaxTasks);
  run(num_tasks, [&](int task) {
    const Range range = TaskRange(n, num_tasks, task, chunk);
    if (range.begin < range.end) fn(task, range.begin, range.end);
  });
}

}  // namespace

std::string CheckBlockQuantParams(const BlockQuantParams& params) {
  if (params.bits != 8 && params.bits != 4) {
    return "BlockQuant bits must be 8 or 4, got " + std::to_string(params.bits);
  }
  if (params.block < 1) {
    return "BlockQuant block must be >= 1 (e.g. 256), got " + std::to_string(params.block);
  }
  if (params.first_index < 0) return "BlockQuant first_index must be >= 0";
  return "";
}

int64_t BlockQuantNumBlocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

int64_t BlockQuantPackedWords(int64_t n, int64_t block, int64_t bits) {
  return wire::kHeaderWords + BlockQuantNumBlocks(n, block) + CodeWords(n, bits);
}

QuantizeStatus BlockQuantCompress(const float* x, const float* residual_in, int64_t n,
                                  const BlockQuantParams& params, uint32_t* packed,
                                  float* residual_out, const TaskRunner& run) {
  const Loops& loops = PickLoops();
  const int64_t block = params.block;
  const int64_t nblocks = BlockQuantNumBlocks(n, block);
  packed[0] = static_cast<uint32_t>(BlockQuantPackedWords(n, block, params.bits));
  uint32_t* scales = packed + wire::kHeaderWords;
  uint8_t* code_bytes = reinterpret_cast<uint8_t*>(scales + nblocks);
  // The last code word's unused bytes are zero (the wire format's padding).
  packed[BlockQuantPackedWords(n, block, params.bits) - 1] = 0;
  const float qmax = params.bits == 8 ? 127.0f : 7.0f;
  const uint32_t key = BlockQuantKey(params.seed, params.step, params.stream);
  const int64_t chunk = ChunkElements(block);
  const auto encode = loops.encode[params.stochastic][residual_out != nullptr];
  std::vector<int64_t> first_bad(kMaxTasks, -1);
  ForChunkRanges(n, chunk, run, [&](int task, int64_t begin, int64_t end) {
    thread_local std::vector<float> acc_scratch;
    thread_local std::vector<int8_t> codes;
    acc_scratch.resize(static_cast<size_t>(chunk));
    codes.resize(static_cast<size_t>(chunk));
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      for (int64_t b0 = c0; b0 < c1; b0 += block) {
        const int64_t len = std::min(block, c1 - b0);
        const float* acc = x + b0;
        uint32_t max_key;
        if (residual_in != nullptr) {
          float* scratch = acc_scratch.data() + (b0 - c0);
          max_key = loops.accumulate(x + b0, residual_in + b0, len, scratch);
          acc = scratch;
        } else {
          max_key = loops.max_key(x + b0, len);
        }
        if (max_key >= kNonFiniteKey) {
          for (int64_t i = 0; i < len; ++i) {
            if ((wire::FloatBits(acc[i]) & wire::kIndexMask) >= kNonFiniteKey) {
              first_bad[task] = b0 + i;
              return;
            }
          }
        }
        float scale = wire::BitsFloat(max_key) / qmax;
        float inv = 1.0f / scale;
        if (!(scale >= FLT_MIN)) scale = inv = 0.0f;  // all codes 0
        scales[b0 / block] = wire::FloatBits(scale);
        encode(acc, len, scale, inv, qmax, key, static_cast<uint32_t>(params.first_index + b0),
               codes.data() + (b0 - c0), residual_out ? residual_out + b0 : nullptr);
      }
      if (params.bits == 8) {
        std::memcpy(code_bytes + c0, codes.data(), static_cast<size_t>(c1 - c0));
      } else {
        const int64_t len = c1 - c0;
        if (len % 2) codes[len] = 0;  // the last element of an odd n: high nibble 0
        loops.pack(codes.data(), len + len % 2, code_bytes + c0 / 2);
      }
    }
  });
  return FirstNonFiniteOfTasks(first_bad);
}

std::string BlockQuantDecompress(const uint32_t* packed, int64_t words, int64_t n,
                                 const BlockQuantParams& params, float* out, bool accumulate,
                                 const TaskRunner& run) {
  const int64_t block = params.block;
  const int64_t expected = BlockQuantPackedWords(n, block, params.bits);
  if (words < 1) return "an empty message (no header word)";
  if (packed[0] != expected || words != expected) {
    return "a BlockQuant message of " + std::to_string(n) + " elements must be " +
           std::to_string(expected) + " words; got " + std::to_string(words) +
           " words with header " + std::to_string(packed[0]);
  }
  const int64_t nblocks = BlockQuantNumBlocks(n, block);
  const uint32_t* scales = packed + wire::kHeaderWords;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float s = wire::BitsFloat(scales[b]);
    if (!(s >= 0.0f && s <= FLT_MAX)) {
      return "block " + std::to_string(b) + " has scale " + std::to_string(s) +
             " (not finite and >= 0)";
    }
  }
  const Loops& loops = PickLoops();
  const uint8_t* code_bytes = reinterpret_cast<const uint8_t*>(scales + nblocks);
  const int64_t chunk = ChunkElements(block);
  const auto decode = loops.decode[accumulate];
  ForChunkRanges(n, chunk, run, [&](int, int64_t begin, int64_t end) {
    thread_local std::vector<int8_t> codes;
    codes.resize(static_cast<size_t>(chunk + 1));
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c1 = std::min(end, c0 + chunk);
      const int8_t* chunk_codes = reinterpret_cast<const int8_t*>(code_bytes + c0);
      if (params.bits == 4) {
        const int64_t len = c1 - c0;
        loops.unpack(code_bytes + c0 / 2, len + len % 2, codes.data());
        chunk_codes = codes.data();
      }
      for (int64_t b0 = c0; b0 < c1; b0 += block) {
        const int64_t len = std::min(block, c1 - b0);
        decode(chunk_codes + (b0 - c0), len, wire::BitsFloat(scales[b0 / block]), out + b0);
      }
    }
  });
  return "";
}

// ---- entry of the quantized allreduce (kernels/quantizer_table.h) ------------------------
namespace {

// The spec's column_size is the block; seed, step, stream and first_index are the stochastic
// rounding's counter.
BlockQuantParams BlockQuantParamsOf(const QuantizerSpec& spec) {
  BlockQuantParams p;
  p.block = spec.column_size;
  p.bits = spec.bits;
  p.stochastic = spec.stochastic;
  p.seed = spec.seed;
  p.step = spec.step;
  p.stream = spec.stream;
  p.first_index = spec.first_index;
  return p;
}

std::string BlockQuantCheckSpec(const QuantizerSpec& spec) {
  return CheckBlockQuantParams(BlockQuantParamsOf(spec));
}

int64_t BlockQuantSliceUnit(const QuantizerSpec& spec) { return spec.column_size; }

int64_t BlockQuantSliceWords(const QuantizerSpec& spec, int64_t n) {
  return BlockQuantPackedWords(n, spec.column_size, spec.bits);
}

QuantizeStatus BlockQuantQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                       const float* residual_in, int64_t n, uint32_t* packed,
                                       float* residual_out, const TaskRunner& run) {
  return BlockQuantCompress(x, residual_in, n, BlockQuantParamsOf(spec), packed, residual_out, run);
}

std::string BlockQuantDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                           int64_t words, int64_t n, float* out,
                                           std::vector<float>*) {
  return BlockQuantDecompress(packed, words, n, BlockQuantParamsOf(spec), out,
                              /*accumulate=*/true);
}

}  // namespace

const Quantizer kBlockQuantizer = {
    kBlockQuantKind,
    "blockquant",
    BlockQuantCheckSpec,
    BlockQuantSliceUnit,
    BlockQuantSliceWords,
    BlockQuantQuantizeSlice,
    BlockQuantDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels
