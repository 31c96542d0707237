// ds_prelude.h: the write-once layer under every ds4-mlx kernel (QUANTS.md §3.4).
//
// The builder prepends `#define DS_METAL` or `#define DS_CUDA` and passes this file as the kernel `header`.
// Kernel bodies (*.body) use only the DS_* macros and the helpers below, so one body serves both backends.
// The IQ2_XXS grid is not typed here: the builder substitutes DS_IQ2_GRID_WORDS from gguf-py's table.

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
#define DS_FMA(a, b, c) metal::fma((a), (b), (c))
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
// Round an f32 to bf16 (RNE) and back: the prefill tile precision (QUANTS.md §8 ruling 2).
#define DS_BF16_ROUND(x) float(bfloat16_t(x))
// Prefill tiles: f32 storage of bf16-rounded values (simdgroup_float8x8 MMA; same numerics as bf16 tiles).
typedef float ds_tile_t;
#define DS_TILE(x) DS_BF16_ROUND(x)
// Store 4 floats as 4 tile elements (dst 16-byte aligned).
DS_FN void ds_store_tile4(threadgroup ds_tile_t* dst, float a, float b, float c, float d) {
  *((threadgroup float4*)dst) = float4(DS_TILE(a), DS_TILE(b), DS_TILE(c), DS_TILE(d));
}
#elif defined(DS_CUDA)
#include <mma.h>
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
#define DS_FMA(a, b, c) fmaf((a), (b), (c))
#define DS_FLOAT4(a, b, c, d) make_float4((a), (b), (c), (d))
#define DS_POPC(x) __popc(x)
#define DS_ATOMIC_ADD(p, v) atomicAdd((p), (v))
#define DS_ASYNC_COPIES 1
#define DS_BYTE_BITS(w, i) __byte_perm((w), 0x4B000000u, 0x7650u | (i))  // one PRMT
#define DS_ASYNC_COPY8(dst, src) \
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src))
#define DS_ASYNC_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define DS_ASYNC_WAIT_ALL() asm volatile("cp.async.wait_group 0;\n" ::)
#define DS_ASYNC_WAIT_PREV() asm volatile("cp.async.wait_group 1;\n" ::)
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

// GGML type ids (QUANTS.md §1.0).
#define DS_F32 0
#define DS_F16 1
#define DS_Q8_0 8
#define DS_Q2_K 10
#define DS_Q4_K 12
#define DS_IQ2_XXS 16
#define DS_BF16 30

// IQ2_XXS grid: 256 u64 words as (lo, hi) u32 pairs; byte j of word g = magnitude j of grid vector g.
DS_TABLE uint32_t ds_iq2_grid[512] = {DS_IQ2_GRID_WORDS};

// --- loads. IQ2_XXS and Q8_0 blocks are only 2-byte aligned: never read them as u32 (QUANTS.md §1.0) ----
DS_FN uint32_t ds_ld16(const DS_DEV uint8_t* p) { return (uint32_t)(*((const DS_DEV uint16_t*)p)); }
DS_FN uint32_t ds_ld32_a2(const DS_DEV uint8_t* p) { return ds_ld16(p) | (ds_ld16(p + 2) << 16); }
DS_FN uint32_t ds_ld32(const DS_DEV uint8_t* p) { return *((const DS_DEV uint32_t*)p); }  // 4-byte aligned only
DS_FN float ds_f16(const DS_DEV uint8_t* p) { return DS_F16_BITS(ds_ld16(p)); }
// The same from threadgroup memory (the matvec stages weight bytes there).
DS_FN uint32_t ds_tld16(const DS_TG uint8_t* p) { return (uint32_t)(*((const DS_TG uint16_t*)p)); }
DS_FN uint32_t ds_tld32_a2(const DS_TG uint8_t* p) { return ds_tld16(p) | (ds_tld16(p + 2) << 16); }
DS_FN uint32_t ds_tld32(const DS_TG uint8_t* p) { return *((const DS_TG uint32_t*)p); }
DS_FN float ds_tf16(const DS_TG uint8_t* p) { return DS_F16_BITS(ds_tld16(p)); }

// Bytes of `units` consecutive 32-weight units starting at a block boundary (units % 8 == 0 for K/IQ types).
DS_FN uint32_t ds_span_bytes(int qt, uint32_t units) {
  return qt == DS_Q8_0 ? 34u * units : qt == DS_Q2_K ? 84u * (units >> 3) : qt == DS_Q4_K ? 144u * (units >> 3)
       : qt == DS_IQ2_XXS ? 66u * (units >> 3) : qt == DS_F32 ? 128u * units : 64u * units;
}

// Stage `nrows` rows × `nbytes` bytes of a span (row r at w + off + r·rb) into dst + r·pitch, lane-strided:
// 8-byte async copies where the row's bytes are 8-byte aligned, 2-byte stores otherwise (blocks are 2-byte
// aligned). The caller commits, waits and synchronizes the simdgroup before reading dst.
DS_FN void ds_stage_span(DS_TG uint8_t* dst, uint32_t pitch, const DS_DEV uint8_t* w, uint64_t off, uint32_t rb,
                         uint32_t nrows, uint32_t nbytes, uint32_t lane) {
  for (uint32_t r = 0; r < nrows; ++r) {
    const uint64_t o = off + (uint64_t)r * rb;
    const DS_DEV uint8_t* src = w + o;
    DS_TG uint8_t* d = dst + r * pitch;
    uint32_t done = 0;
    if ((o & 7) == 0) {
      const uint32_t nw = nbytes >> 3;
      for (uint32_t i = lane; i < nw; i += 32) DS_ASYNC_COPY8(d + 8 * i, src + 8 * i);
      done = nw << 3;
    }
    for (uint32_t i = (done >> 1) + lane; i < (nbytes >> 1); i += 32)
      ((DS_TG uint16_t*)d)[i] = ((const DS_DEV uint16_t*)src)[i];
  }
}

// Small integers to f32 without an int→float conversion instruction (quarter rate on NVIDIA): 2^23 + v has
// v in its low mantissa bits, so one OR and one subtraction give v exactly (v < 2^23).
DS_FN float ds_u2f(uint32_t v) { return DS_U32_AS_F(0x4B000000u | v) - 8388608.0f; }
// Byte i (0..3) of w as f32, by the same trick (DS_BYTE_BITS puts the byte under the 2^23 exponent).
DS_FN float ds_byte_f(uint32_t w, uint32_t i) { return DS_U32_AS_F(DS_BYTE_BITS(w, i)) - 8388608.0f; }
// A raw int8 byte b (0..255) as its signed value: 2^23 + (b XOR 0x80) − (2^23 + 128).
DS_FN float ds_s8f(uint32_t b) { return DS_U32_AS_F(0x4B000000u | (b ^ 0x80u)) - 8388736.0f; }

// Bytes per block and weights per block.
DS_FN uint32_t ds_type_size(int qt) {
  return qt == DS_Q8_0 ? 34u : qt == DS_Q2_K ? 84u : qt == DS_Q4_K ? 144u : qt == DS_IQ2_XXS ? 66u
       : qt == DS_F32 ? 4u : 2u;
}

// Q4_K 6-bit (scale, min) of sub-block j (QUANTS.md §1.3).
DS_FN void ds_q4k_scale_min(const DS_DEV uint8_t* s, uint32_t j, DS_THR float& sc, DS_THR float& m) {
  if (j < 4) {
    sc = float(s[j] & 63);
    m = float(s[j + 4] & 63);
  } else {
    sc = float((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    m = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// IQ2_XXS sign mask of sign index s: s | parity(s) << 7 (QUANTS.md §1.4).
DS_FN uint32_t ds_iq2_signs(uint32_t s) { return s | ((DS_POPC(s) & 1u) << 7); }

// --- the 32-weight unit: unit u of a row is weights 32u .. 32u+31 -------------------------------------------
// Every supported type decodes in 32-weight units (one Q8_0 block, a Q4_K sub-block, an IQ2_XXS group,
// two Q2_K groups, 32 plain elements), so matvec lanes and matmul tiles step through K in units.

// Dot of unit u of `row` (bytes staged in threadgroup memory; `grid` = the IQ2 grid there) with x[0..31] in registers; xs[0..1] = Σx over the unit's halves (for the K-quant
// min terms, shared by all rows).
DS_FN float ds_dot32(int qt, const DS_TG uint8_t* row, uint32_t u, const DS_THR float* x, const DS_THR float* xs,
                     const DS_TG uint32_t* grid) {
  if (qt == DS_Q8_0) {
    const DS_TG uint8_t* b = row + 34u * u;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t q = ds_tld16(b + 2 + 2 * i);
      s = DS_FMA(ds_s8f(q & 255u), x[2 * i], s);
      s = DS_FMA(ds_s8f(q >> 8), x[2 * i + 1], s);
    }
    return ds_tf16(b) * s;
  } else if (qt == DS_Q2_K) {
    const DS_TG uint8_t* b = row + 84u * (u >> 3);
    const uint32_t r = u & 7u, h = r >> 2, sh = 2u * (r & 3u);
    const DS_TG uint8_t* q = b + 16 + 32 * h;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t w0 = ds_tld32(q + 4 * i) >> sh, w1 = ds_tld32(q + 16 + 4 * i) >> sh;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s0 = DS_FMA(ds_u2f((w0 >> (8 * j)) & 3u), x[4 * i + j], s0);
        s1 = DS_FMA(ds_u2f((w1 >> (8 * j)) & 3u), x[16 + 4 * i + j], s1);
      }
    }
    const uint32_t sc0 = b[2 * r], sc1 = b[2 * r + 1];
    const float d = ds_tf16(b + 80), dmin = ds_tf16(b + 82);
    return d * (float(sc0 & 15u) * s0 + float(sc1 & 15u) * s1) - dmin * (float(sc0 >> 4) * xs[0] + float(sc1 >> 4) * xs[1]);
  } else if (qt == DS_Q4_K) {
    const DS_TG uint8_t* b = row + 144u * (u >> 3);
    const uint32_t j = u & 7u, sh = 4u * (j & 1u);
    const DS_TG uint8_t* q = b + 16 + 32 * (j >> 1);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t w = ds_tld32(q + 4 * i) >> sh;
#pragma unroll
      for (int k = 0; k < 4; ++k) s = DS_FMA(ds_u2f((w >> (8 * k)) & 15u), x[4 * i + k], s);
    }
    float sc, m;
    ds_q4k_scale_min(b + 4, j, sc, m);
    return ds_tf16(b) * sc * s - ds_tf16(b + 2) * m * (xs[0] + xs[1]);
  } else if (qt == DS_IQ2_XXS) {
    const DS_TG uint8_t* b = row + 66u * (u >> 3);
    const DS_TG uint8_t* g = b + 2 + 8 * (u & 7u);
    const uint32_t A = ds_tld32_a2(g), B = ds_tld32_a2(g + 4);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t gi = (A >> (8 * k)) & 255u;
      const uint32_t sg = ds_iq2_signs((B >> (7 * k)) & 127u);
      const uint32_t lo = grid[2 * gi], hi = grid[2 * gi + 1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = ds_byte_f(j < 4 ? lo : hi, j & 3);
        s = DS_FMA(DS_U32_AS_F(DS_F_AS_U32(v) ^ (((sg >> j) & 1u) << 31)), x[8 * k + j], s);  // sign by bit flip
      }
    }
    return ds_tf16(b) * (0.5f + float(B >> 28)) * 0.25f * s;
  } else if (qt == DS_F16 || qt == DS_BF16) {
    const DS_TG uint8_t* b = row + 64u * u;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t w = ds_tld32(b + 4 * i);
      float w0 = qt == DS_F16 ? DS_F16_BITS(w & 0xffffu) : DS_U32_AS_F(w << 16);
      float w1 = qt == DS_F16 ? DS_F16_BITS(w >> 16) : DS_U32_AS_F(w & 0xffff0000u);
      s = DS_FMA(w0, x[2 * i], s);
      s = DS_FMA(w1, x[2 * i + 1], s);
    }
    return s;
  } else {  // DS_F32
    const DS_TG float* b = (const DS_TG float*)(row + 128u * u);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) s = DS_FMA(b[i], x[i], s);
    return s;
  }
}

// Dequantize 16 weights: half `hf` (0/1) of unit u of `row`, exact f32 values (QUANTS.md §1.7).
DS_FN void ds_deq16(int qt, const DS_DEV uint8_t* row, uint32_t u, uint32_t hf, DS_THR float* out) {
  if (qt == DS_Q8_0) {
    const DS_DEV uint8_t* b = row + 34u * u;
    const float d = ds_f16(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t q = ds_ld16(b + 2 + 16 * hf + 2 * i);
      out[2 * i] = d * float((int8_t)(q & 255u));
      out[2 * i + 1] = d * float((int8_t)(q >> 8));
    }
  } else if (qt == DS_Q2_K) {
    const DS_DEV uint8_t* b = row + 84u * (u >> 3);
    const uint32_t r = u & 7u, sh = 2u * (r & 3u), grp = 2 * r + hf;
    const DS_DEV uint8_t* q = b + 16 + 32 * (r >> 2) + 16 * hf;
    const uint32_t sc = b[grp];
    const float dl = ds_f16(b + 80) * float(sc & 15u), ml = ds_f16(b + 82) * float(sc >> 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t w = ds_ld32(q + 4 * i) >> sh;
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * i + j] = dl * float((w >> (8 * j)) & 3u) - ml;
    }
  } else if (qt == DS_Q4_K) {
    const DS_DEV uint8_t* b = row + 144u * (u >> 3);
    const uint32_t j = u & 7u, sh = 4u * (j & 1u);
    const DS_DEV uint8_t* q = b + 16 + 32 * (j >> 1) + 16 * hf;
    float sc, m;
    ds_q4k_scale_min(b + 4, j, sc, m);
    const float dl = ds_f16(b) * sc, ml = ds_f16(b + 2) * m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t w = ds_ld32(q + 4 * i) >> sh;
#pragma unroll
      for (int k = 0; k < 4; ++k) out[4 * i + k] = dl * float((w >> (8 * k)) & 15u) - ml;
    }
  } else if (qt == DS_IQ2_XXS) {
    const DS_DEV uint8_t* b = row + 66u * (u >> 3);
    const DS_DEV uint8_t* g = b + 2 + 8 * (u & 7u);
    const uint32_t A = ds_ld32_a2(g), B = ds_ld32_a2(g + 4);
    const float dl = ds_f16(b) * (0.5f + float(B >> 28)) * 0.25f;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t k = 2 * hf + kk;
      const uint32_t gi = (A >> (8 * k)) & 255u;
      const uint32_t sg = ds_iq2_signs((B >> (7 * k)) & 127u);
      const uint32_t lo = ds_iq2_grid[2 * gi], hi = ds_iq2_grid[2 * gi + 1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = dl * float(((j < 4 ? lo : hi) >> (8 * (j & 3))) & 255u);
        out[8 * kk + j] = (sg >> j) & 1u ? -v : v;
      }
    }
  } else if (qt == DS_F16 || qt == DS_BF16) {
    const DS_DEV uint8_t* b = row + 64u * u + 32u * hf;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t w = ds_ld32(b + 4 * i);
      out[2 * i] = qt == DS_F16 ? DS_F16_BITS(w & 0xffffu) : DS_U32_AS_F(w << 16);
      out[2 * i + 1] = qt == DS_F16 ? DS_F16_BITS(w >> 16) : DS_U32_AS_F(w & 0xffff0000u);
    }
  } else {
    const DS_DEV float* b = (const DS_DEV float*)(row + 128u * u + 64u * hf);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = b[i];
  }
}
