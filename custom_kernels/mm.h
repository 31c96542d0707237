// mm.h: helpers of the prefill kernels (mm.body, deq.body, index_mm.body, attn_chunk.body), after ds_quant.h in
// their `header`.

// attn_chunk's tiles: f16 on CUDA (wmma), f32 on Metal (simdgroup_float8x8). Its keys come as f16 rows.
// ds_bf16_t: index_mm's inputs.
#if defined(DS_METAL)
typedef float ds_att_t;
typedef bfloat16_t ds_bf16_t;
#else
typedef __half ds_att_t;
typedef __nv_bfloat16 ds_bf16_t;
#endif
template <typename T> DS_FN const DS_DEV T* ds_row_ptr(const DS_DEV T* base, uint32_t row, uint32_t width) {
  return base + (uint64_t)row * width;
}
// 8 values (f16 or f32, 16-byte aligned) into an attention tile, or zeros.
template <typename T> DS_FN void ds_att_load8(DS_TG ds_att_t* dst, const DS_DEV T* src, bool ok) {
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = ds_att_t(ok ? float(src[i]) : 0.0f);
}
#if !defined(DS_METAL)
// The same in one 16-byte load and one 16-byte store (f16 rows into the f16 tile), or two loads and a conversion
// (f32): the per-element copy took 16 load and store instructions where these take two to four.
DS_FN void ds_att_load8(ds_att_t* dst, const __half* src, bool ok) {
  uint4 v;
  v.x = v.y = v.z = v.w = 0u;
  if (ok) v = *((const uint4*)src);
  *((uint4*)dst) = v;
}
DS_FN uint32_t ds_half2_bits(float a, float b) {
  return (uint32_t)__half_as_ushort(__float2half_rn(a)) | ((uint32_t)__half_as_ushort(__float2half_rn(b)) << 16);
}
DS_FN void ds_att_load8(ds_att_t* dst, const float* src, bool ok) {
  float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
  if (ok) {
    a = ((const float4*)src)[0];
    b = ((const float4*)src)[1];
  }
  uint4 v;
  v.x = ds_half2_bits(a.x, a.y);
  v.y = ds_half2_bits(a.z, a.w);
  v.z = ds_half2_bits(b.x, b.y);
  v.w = ds_half2_bits(b.z, b.w);
  *((uint4*)dst) = v;
}
#endif

// The experts' prefill product (mm.body) multiplies f16 tiles, as ds4's Metal prefill does (docs/quants.md §8
// ruling 2): its x comes as f16 (rounded once, before the launch), its SwiGLU writes f16. On Metal the tiles
// hold the f16-rounded values as f32 (simdgroup_float8x8). ds_load_x8: 8 values of x as four words (or zeros);
// ds_store_x8: into the B tile; ds_mm_store4: 4 weights into the A tile.
#if defined(DS_METAL)
typedef float ds_mm_t;
typedef half ds_xin_t;
DS_FN uint4 ds_load_x8(const device ds_xin_t* src, bool ok) {
  if (!ok) return uint4(0u, 0u, 0u, 0u);
  const device uint4* p = (const device uint4*)src;
  return *p;
}
DS_FN float2 ds_h2_f(uint32_t w) { return float2(as_type<half2>(w)); }
DS_FN void ds_store_x8(threadgroup ds_mm_t* dst, uint4 v) {
  *((threadgroup float4*)dst) = float4(ds_h2_f(v.x), ds_h2_f(v.y));
  *((threadgroup float4*)(dst + 4)) = float4(ds_h2_f(v.z), ds_h2_f(v.w));
}
DS_FN void ds_mm_store4(threadgroup ds_mm_t* dst, float a, float b, float c, float d) {
  *((threadgroup float4*)dst) = float4(DS_F16R(a), DS_F16R(b), DS_F16R(c), DS_F16R(d));
}
#define DS_MM_A_SCALE(qt) 1.0f
#else
typedef __half ds_mm_t;
typedef __half ds_xin_t;
DS_FN uint4 ds_load_x8(const ds_xin_t* src, bool ok) {  // 16 bytes, 16-byte aligned
  uint4 v;
  if (ok) {
    v = *((const uint4*)src);
  } else {
    v.x = v.y = v.z = v.w = 0u;
  }
  return v;
}
DS_FN void ds_store_x8(ds_mm_t* dst, uint4 v) { *((uint4*)dst) = v; }  // f16 tiles: the bits as they are

// Two f16 products, or fused multiply-adds, in a word (PTX mul.rn.f16x2 / fma.rn.f16x2: one instruction each,
// rounding once to nearest even; sim.h computes the same).
#if defined(DS_SIM)
#define ds_h2_mul ds_sim_hmul2
#define ds_h2_fma ds_sim_hfma2
#else
DS_FN uint32_t ds_h2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
DS_FN uint32_t ds_h2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
#endif
// f in both halves of a word, rounded to f16.
DS_FN uint32_t ds_h2_splat(float f) { return (uint32_t)__half_as_ushort(__float2half_rn(f)) * 0x10001u; }

// The A tile of IQ2_XXS holds 8 times the weights (below); the product is scaled back in mm's epilogue.
#define DS_MM_A_SCALE(qt) ((qt) == DS_IQ2_XXS ? 0.125f : 1.0f)
#endif

// 16 weights (half `hf` of unit u of a row) in two steps, so a kernel can issue the loads of its next tile before it
// uses the words (ds_raw16_load), and decode them after its product of the current tile (ds_raw16_decode): the
// words a half-unit needs, its scale fields' words, and (F32, never prefetched) where it lies.
struct ds_raw16 {
  uint32_t w[8];
  uint32_t s0, s1;
  const DS_DEV uint8_t* p;
};

DS_FN ds_raw16 ds_raw16_load(int qt, const DS_DEV uint8_t* row, uint32_t u, uint32_t hf) {
  ds_raw16 r;
  r.s0 = r.s1 = 0u;
  r.p = row;
  if (qt == DS_Q8_0) {  // d, then 16 int8 (2-byte aligned blocks: halfword loads)
    const DS_DEV uint8_t* b = row + 34u * u;
    r.s0 = ds_ld16(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) r.w[i] = ds_ld16(b + 2 + 16 * hf + 2 * i);
  } else if (qt == DS_Q2_K) {  // 16 bytes of the 2-bit planes, (d, dmin), the group's scale byte
    const DS_DEV uint8_t* b = row + 84u * (u >> 3);
    const uint32_t rr = u & 7u;
    const DS_DEV uint8_t* q = b + 16 + 32 * (rr >> 2) + 16 * hf;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = ds_ld32(q + 4 * i);
    r.s0 = ds_ld32(b + 80);
    r.s1 = b[2 * rr + hf];
  } else if (qt == DS_Q4_K) {  // 16 bytes of nibbles, (d, dmin), the 12 scale bytes
    const DS_DEV uint8_t* b = row + 144u * (u >> 3);
    const uint32_t j = u & 7u;
    const DS_DEV uint8_t* q = b + 16 + 32 * (j >> 1) + 16 * hf;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = ds_ld32(q + 4 * i);
#pragma unroll
    for (int i = 0; i < 3; ++i) r.w[4 + i] = ds_ld32(b + 4 + 4 * i);
    r.s0 = ds_ld32(b);
  } else if (qt == DS_IQ2_XXS) {  // d, the group's grid indices and its signs/scale word
    const DS_DEV uint8_t* b = row + 66u * (u >> 3);
    const DS_DEV uint8_t* g = b + 2 + 8 * (u & 7u);
    r.w[0] = ds_ld32_a2(g);
    r.w[1] = ds_ld32_a2(g + 4);
    r.s0 = ds_ld16(b);
  } else if (qt == DS_F16 || qt == DS_BF16) {
    const DS_DEV uint8_t* b = row + 64u * u + 32u * hf;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.w[i] = ds_ld32(b + 4 * i);
  }
  return r;
}

// Byte i (0..11) of the three words w[4..6] (Q4_K's scale bytes).
DS_FN uint32_t ds_raw_byte(DS_THR const ds_raw16& r, uint32_t i) { return (r.w[4 + i / 4] >> (8 * (i % 4))) & 255u; }

DS_FN void ds_raw16_decode(int qt, DS_THR const ds_raw16& r, uint32_t u, uint32_t hf, DS_THR float* out) {
  if (qt == DS_Q8_0) {
    const float d = DS_F16_BITS(r.s0);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t wx = r.w[i] ^ 0x8080u;
      out[2 * i] = d * ds_s8x_f(wx, 0);
      out[2 * i + 1] = d * ds_s8x_f(wx, 1);
    }
  } else if (qt == DS_Q2_K) {
    const uint32_t sh = 2u * ((u & 7u) & 3u), sc = r.s1;
    const float dl = DS_F16_BITS(r.s0 & 0xffffu) * float(sc & 15u), ml = DS_F16_BITS(r.s0 >> 16) * float(sc >> 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = (r.w[i] >> sh) & 0x03030303u;
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * i + j] = DS_FMA(dl, ds_byte_f(w, j), -ml);
    }
  } else if (qt == DS_Q4_K) {  // the 6-bit (scale, min) of sub-block j, as ds_q4k_scale_min takes them
    const uint32_t j = u & 7u, sh = 4u * (j & 1u);
    float sc, m;
    if (j < 4) {
      sc = float(ds_raw_byte(r, j) & 63u);
      m = float(ds_raw_byte(r, j + 4) & 63u);
    } else {
      sc = float((ds_raw_byte(r, j + 4) & 15u) | ((ds_raw_byte(r, j - 4) >> 6) << 4));
      m = float((ds_raw_byte(r, j + 4) >> 4) | ((ds_raw_byte(r, j) >> 6) << 4));
    }
    const float dl = DS_F16_BITS(r.s0 & 0xffffu) * sc, ml = DS_F16_BITS(r.s0 >> 16) * m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = (r.w[i] >> sh) & 0x0F0F0F0Fu;
#pragma unroll
      for (int k = 0; k < 4; ++k) out[4 * i + k] = DS_FMA(dl, ds_byte_f(w, k), -ml);
    }
  } else if (qt == DS_IQ2_XXS) {
    const uint32_t A = r.w[0], B = r.w[1];
    const float dl = DS_F16_BITS(r.s0) * (0.5f + ds_u2f(B >> 28)) * 0.25f;
    const float bias = -8388608.0f * dl;  // (2^23 + g)·dl − 2^23·dl = g·dl, rounded once by the FMA
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t k = 2 * hf + kk;
      const uint32_t gi = (A >> (8 * k)) & 255u;
      const uint32_t sg = ds_iq2_signs((B >> (7 * k)) & 127u);
      const uint32_t lo = ds_iq2_grid[2 * gi], hi = ds_iq2_grid[2 * gi + 1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = DS_FMA(DS_U32_AS_F(DS_BYTE_BITS(j < 4 ? lo : hi, j & 3)), dl, bias);
        out[8 * kk + j] = DS_U32_AS_F(DS_F_AS_U32(v) ^ ((sg << (31 - j)) & 0x80000000u));  // the sign bit
      }
    }
  } else if (qt == DS_F16 || qt == DS_BF16) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = r.w[i];
      out[2 * i] = qt == DS_F16 ? DS_F16_BITS(w & 0xffffu) : DS_U32_AS_F(w << 16);
      out[2 * i + 1] = qt == DS_F16 ? DS_F16_BITS(w >> 16) : DS_U32_AS_F(w & 0xffff0000u);
    }
  } else {
    const DS_DEV float* b = (const DS_DEV float*)(r.p + 128u * u + 64u * hf);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = b[i];
  }
}

// Dequantize 16 weights: half `hf` (0/1) of unit u of `row`, exact f32 values (docs/quants.md §1.7).
DS_FN void ds_deq16(int qt, const DS_DEV uint8_t* row, uint32_t u, uint32_t hf, DS_THR float* out) {
  const ds_raw16 r = ds_raw16_load(qt, row, u, hf);
  ds_raw16_decode(qt, r, u, hf, out);
}

#if defined(DS_METAL)
// mm's A tile: 16 weights (half `hf` of unit u, as ds_raw16_decode) rounded to f16 into `dst`, or zeros (!ok).
DS_FN void ds_mm_decode_a(int qt, DS_THR const ds_raw16& r, uint32_t u, uint32_t hf, bool ok, DS_TG ds_mm_t* dst) {
  float v[16];
  if (ok) {
    ds_raw16_decode(qt, r, u, hf, v);
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e) v[e] = 0.0f;
  }
#pragma unroll
  for (int e = 0; e < 16; e += 4) ds_mm_store4(dst + e, v[e], v[e + 1], v[e + 2], v[e + 3]);
}
#else
// The sign bits of IQ2_XXS weights 2i and 2i + 1 (bits 2i, 2i + 1 of `sg`) as the sign bits of an f16 pair: one
// multiply puts bit 0 at bit 15 and bit 1 at bit 31 (sg's higher bits land outside the mask, with no carries).
DS_FN uint32_t ds_iq2_sign_pair(uint32_t sg, int i) { return ((sg >> (2 * i)) * 0x40008000u) & 0x80008000u; }

// 16 weights (as ds_raw16_decode) as 8 words of f16 pairs for mm's tiles, each rounded once. IQ2_XXS in f16x2
// arithmetic, ~3 instructions a weight against ~6 in f32: a PRMT makes two grid bytes g into the f16 values
// 1024 + g, one FMA gives (1024 + g)·s − 1024·s = g·s with s = 2ls + 1 (exact: the fused product is exact and
// g·s ≤ 1333 fits f16's integers), and the product by d is the one rounding, of 8·w (DS_MM_A_SCALE takes the 8
// back). Other types: decoded exactly in f32, then rounded (Q2_K's min term would cancel in f16: dl·q − ml, both
// rounded, is off by many ulps).
DS_FN void ds_raw16_decode_h(int qt, const ds_raw16& r, uint32_t u, uint32_t hf, uint32_t* out) {
  if (qt == DS_IQ2_XXS) {
    const uint32_t A = r.w[0], B = r.w[1];
    const float sf = ds_u2f(2u * (B >> 28) + 1u);
    const uint32_t s = ds_h2_splat(sf), c = ds_h2_splat(-1024.0f * sf), d = (r.s0 & 0xffffu) * 0x10001u;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t k = 2 * hf + kk, gi = (A >> (8 * k)) & 255u, sg = ds_iq2_signs((B >> (7 * k)) & 127u);
      const uint32_t g[2] = {ds_iq2_grid[2 * gi], ds_iq2_grid[2 * gi + 1]};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t h = __byte_perm(g[i >> 1], 0x64646464u, (i & 1) ? 0x4342u : 0x4140u);  // 0x64gg: 1024 + g
        out[4 * kk + i] = ds_h2_mul(ds_h2_fma(h, s, c), d) ^ ds_iq2_sign_pair(sg, i);
      }
    }
  } else {
    float v[16];
    ds_raw16_decode(qt, r, u, hf, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = ds_half2_bits(v[2 * i], v[2 * i + 1]);
  }
}

// mm's A tile: 16 weights (as ds_raw16_decode_h) into `dst` as two 16-byte stores, or zeros (!ok).
DS_FN void ds_mm_decode_a(int qt, const ds_raw16& r, uint32_t u, uint32_t hf, bool ok, ds_mm_t* dst) {
  uint32_t h[8];
  if (ok) {
    ds_raw16_decode_h(qt, r, u, hf, h);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = 0u;
  }
  ((uint4*)dst)[0] = make_uint4(h[0], h[1], h[2], h[3]);
  ((uint4*)dst)[1] = make_uint4(h[4], h[5], h[6], h[7]);
}
#endif
