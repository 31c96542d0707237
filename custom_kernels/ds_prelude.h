// ds_prelude.h: the write-once layer under every ds4-mlx kernel (docs/quants.md §3.4).
//
// The builder prepends `#define DS_METAL` or `#define DS_CUDA` and puts this file first in every kernel's
// `header`. Bodies (*.body) use only the DS_* macros below and the helpers of ds_quant.h (quant kernels) or
// fused.h (fused kernels), so one body serves both backends.

#if defined(DS_METAL)
#define DS_FN inline
#define DS_DEV device
#define DS_TG threadgroup
#define DS_TG_DECL threadgroup
#define DS_THR thread
#define DS_TABLE constant
#define DS_TG_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define DS_SIMD_BARRIER() simdgroup_barrier(mem_flags::mem_none)
#define DS_SIMD_BARRIER_TG() simdgroup_barrier(mem_flags::mem_threadgroup)
#define DS_SIMD_SUM(x) simd_sum(x)
#define DS_SHFL_XOR(x, m) simd_shuffle_xor((x), (m))
#define DS_F16_BITS(u) float(as_type<half>((ushort)(u)))
#define DS_U32_AS_F(u) as_type<float>((uint32_t)(u))
#define DS_F_AS_U32(f) as_type<uint32_t>((float)(f))
#define DS_EXP(x) metal::exp(x)
#define DS_SQRT(x) metal::sqrt(x)
#define DS_FMA(a, b, c) metal::fma((a), (b), (c))
#define DS_RINT(x) metal::rint(x)
#define DS_FABS(x) metal::fabs(x)
#define DS_F16R(x) float(half(x))
#define DS_FLOAT4(a, b, c, d) float4((a), (b), (c), (d))
#define DS_POPC(x) popcount(x)
#define DS_ATOMIC_ADD(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
// Device → threadgroup copy of 8 bytes (both 8-byte aligned). Synchronous on Metal; CUDA issues cp.async, so
// DS_ASYNC_COMMIT groups copies and DS_ASYNC_WAIT_ALL / DS_ASYNC_WAIT_PREV (all but the newest group) wait.
// DS_ASYNC_COPIES says which: bodies double-buffer only where copies overlap compute (and Metal's 32 KB of
// threadgroup memory is not spent on a second buffer that buys nothing).
#define DS_ASYNC_COPIES 0
#define DS_BYTE_BITS(w, i) (0x4B000000u | (((w) >> (8 * (i))) & 255u))
#define DS_ASYNC_COPY8(dst, src) (*((threadgroup uint2*)(dst)) = *((const device uint2*)(src)))
#define DS_ASYNC_COMMIT()
#define DS_ASYNC_WAIT_ALL()
#define DS_ASYNC_WAIT_PREV()
// Round an f32 to bf16 (RNE) and back: the prefill tile precision (docs/quants.md §8 ruling 2).
#define DS_BF16_ROUND(x) float(bfloat16_t(x))
// Prefill tiles: f32 storage of bf16-rounded values (simdgroup_float8x8 MMA; same numerics as bf16 tiles).
typedef float ds_tile_t;
#define DS_TILE(x) DS_BF16_ROUND(x)
// Store 4 floats as 4 tile elements (dst 16-byte aligned).
DS_FN void ds_store_tile4(threadgroup ds_tile_t* dst, float a, float b, float c, float d) {
  *((threadgroup float4*)dst) = float4(DS_TILE(a), DS_TILE(b), DS_TILE(c), DS_TILE(d));
}
#elif defined(DS_CUDA)
#ifndef DS_SIM  // custom_kernels/sim.h: this text run on the CPU
#include <mma.h>
#endif
#define DS_FN __device__ __forceinline__
#define DS_DEV
#define DS_TG
#define DS_TG_DECL __shared__
#define DS_THR
#define DS_TABLE __device__ const
#define DS_TG_BARRIER() __syncthreads()
#define DS_SIMD_BARRIER() __syncwarp()
#define DS_SIMD_BARRIER_TG() __syncwarp()
#define DS_SIMD_SUM(x) ds_warp_sum(x)
#define DS_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define DS_F16_BITS(u) __half2float(__ushort_as_half((unsigned short)(u)))
#define DS_U32_AS_F(u) __uint_as_float((uint32_t)(u))
#define DS_F_AS_U32(f) __float_as_uint((float)(f))
#define DS_EXP(x) expf(x)
#define DS_SQRT(x) sqrtf(x)
#define DS_FMA(a, b, c) fmaf((a), (b), (c))
#define DS_RINT(x) rintf(x)
#define DS_FABS(x) fabsf(x)
#define DS_F16R(x) __half2float(__float2half_rn(x))
#define DS_FLOAT4(a, b, c, d) make_float4((a), (b), (c), (d))
#define DS_POPC(x) __popc(x)
#define DS_ATOMIC_ADD(p, v) atomicAdd((p), (v))
#define DS_ASYNC_COPIES 1
#define DS_BYTE_BITS(w, i) __byte_perm((w), 0x4B000000u, 0x7650u | (i))  // one PRMT
#if defined(DS_SIM)  // no PTX on the CPU: the copy lands at once
#define DS_ASYNC_COPY8(dst, src) ds_sim_copy8((dst), (src))
#define DS_ASYNC_COMMIT()
#define DS_ASYNC_WAIT_ALL()
#define DS_ASYNC_WAIT_PREV()
#else
#define DS_ASYNC_COPY8(dst, src) \
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src))
#define DS_ASYNC_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define DS_ASYNC_WAIT_ALL() asm volatile("cp.async.wait_group 0;\n" ::)
#define DS_ASYNC_WAIT_PREV() asm volatile("cp.async.wait_group 1;\n" ::)
#endif
#define DS_BF16_ROUND(x) __bfloat162float(__float2bfloat16_rn(x))
// Prefill tiles: bf16 in shared memory for wmma (f32 accumulation).
typedef __nv_bfloat16 ds_tile_t;
#define DS_TILE(x) __float2bfloat16_rn(x)
// Store 4 floats as 4 bf16 tile elements in one 8-byte store (dst 8-byte aligned).
DS_FN void ds_store_tile4(ds_tile_t* dst, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 v;
  v.x = *((uint32_t*)&lo);
  v.y = *((uint32_t*)&hi);
  *((uint2*)dst) = v;
}
DS_FN float ds_warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
#else
#error "define DS_METAL or DS_CUDA before ds_prelude.h"
#endif

// v quantized as kernels.quantize_x does, octets being 8 adjacent lanes (every lane of the simdgroup calls it):
// q = rint(v / d), the remainder r = rint(128 (v − d·q) / d), d = max|v| / 127 over the lane's octet.
DS_FN void ds_xq_octet(float v, DS_THR float& q, DS_THR float& r, DS_THR float& d) {
  float a = DS_FABS(v);
  for (int m = 1; m < 8; m <<= 1) {
    const float b = DS_SHFL_XOR(a, m);
    a = a > b ? a : b;
  }
  d = a * (1.0f / 127.0f);
  const float iv = a > 0.0f ? 127.0f / a : 0.0f;
  q = DS_RINT(v * iv);
  r = DS_RINT((v - q * d) * (128.0f * iv));
}
