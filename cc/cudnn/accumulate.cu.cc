// The accumulation kernel (see accumulate.h).
#include "cc/cudnn/accumulate.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tf_ucudnn {
namespace {

__device__ float ToFloat(__half x) { return __half2float(x); }
__device__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ void FromFloat(float x, __half* out) { *out = __float2half_rn(x); }
__device__ void FromFloat(float x, __nv_bfloat16* out) { *out = __float2bfloat16_rn(x); }

template <typename T>
__global__ void AccumulateWide(const T* src, T* dst, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

template <typename T>
__global__ void AccumulateNarrow(const T* src, T* dst, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    FromFloat(ToFloat(dst[i]) + ToFloat(src[i]), &dst[i]);
  }
}

template <typename T, void (*Kernel)(const T*, T*, int64_t)>
cudaError_t Launch(const void* src, void* dst, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, 65535 * 8);
  Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const T*>(src),
                                                                 static_cast<T*>(dst), count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAccumulate(const void* src, void* dst, int64_t count, AccumulatedType type,
                             cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  switch (type) {
    case AccumulatedType::kHalf:
      return Launch<__half, AccumulateNarrow<__half>>(src, dst, count, stream);
    case AccumulatedType::kBfloat16:
      return Launch<__nv_bfloat16, AccumulateNarrow<__nv_bfloat16>>(src, dst, count, stream);
    case AccumulatedType::kFloat:
      return Launch<float, AccumulateWide<float>>(src, dst, count, stream);
    case AccumulatedType::kDouble:
      return Launch<double, AccumulateWide<double>>(src, dst, count, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tf_ucudnn
