// mm.h: helpers of the prefill kernels (mm.body, deq.body, index_mm.body, attn_chunk.body), after ds_quant.h in
// their `header`.

// attn_chunk's tiles: f16 on CUDA (wmma), f32 on Metal (simdgroup_float8x8). Its keys come as f16 rows.
#if defined(DS_METAL)
typedef float ds_att_t;
#else
typedef __half ds_att_t;
#endif
template <typename T> DS_FN const DS_DEV T* ds_row_ptr(const DS_DEV T* base, uint32_t row, uint32_t width) {
  return base + (uint64_t)row * width;
}
// 8 values (f16 or f32, 16-byte aligned) into an attention tile, or zeros.
template <typename T> DS_FN void ds_att_load8(DS_TG ds_att_t* dst, const DS_DEV T* src, bool ok) {
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = ds_att_t(ok ? float(src[i]) : 0.0f);
}

// The experts' prefill product reads x as bfloat16 (the B tile's precision: rounding it once, before the launch,
// gives the same tile values). ds_copy_x8: 8 values of x into the B tile, or zeros.
#if defined(DS_METAL)
typedef bfloat16_t ds_xin_t;
DS_FN void ds_copy_x8(threadgroup ds_tile_t* dst, const device ds_xin_t* src, bool ok) {
#pragma unroll
  for (int i = 0; i < 8; i += 4)
    *((threadgroup float4*)(dst + i)) =
        ok ? float4(float(src[i]), float(src[i + 1]), float(src[i + 2]), float(src[i + 3])) : float4(0.0f, 0.0f, 0.0f, 0.0f);
}
#else
typedef __nv_bfloat16 ds_xin_t;
DS_FN void ds_copy_x8(ds_tile_t* dst, const ds_xin_t* src, bool ok) {  // 16 bytes: both 16-byte aligned
  uint4 v;
  if (ok) {
    v = *((const uint4*)src);
  } else {
    v.x = v.y = v.z = v.w = 0u;
  }
  *((uint4*)dst) = v;
}
#endif

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
