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

// 8 weights of one scale. Q8_0: 4 words of two int8 each (low byte first), times d. Q2_K and Q4_K: 2 words of
// packed codes at bit shift sh (mask: the code's bits in each byte), each dl·q − ml in one FMA.
DS_FN void ds_q8_8(DS_THR const uint32_t* w, float d, DS_THR float* out) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t wx = w[i] ^ 0x8080u;
    out[2 * i] = d * ds_s8x_f(wx, 0);
    out[2 * i + 1] = d * ds_s8x_f(wx, 1);
  }
}
DS_FN void ds_k_8(DS_THR const uint32_t* w, uint32_t sh, uint32_t mask, float dl, float ml, DS_THR float* out) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t v = (w[i] >> sh) & mask;
#pragma unroll
    for (int j = 0; j < 4; ++j) out[4 * i + j] = DS_FMA(dl, ds_byte_f(v, j), -ml);
  }
}
// Q2_K's (dl, ml) of a 16-weight group: (d, dmin) as the word dm, the group's scale byte sc.
DS_FN void ds_q2k_dm(uint32_t dm, uint32_t sc, DS_THR float& dl, DS_THR float& ml) {
  dl = DS_F16_BITS(dm & 0xffffu) * float(sc & 15u);
  ml = DS_F16_BITS(dm >> 16) * float(sc >> 4);
}
// Q4_K's (dl, ml) of sub-block j: (d, dmin) as the word dm, the 12 scale bytes as three words s, the 6-bit scale
// and min unpacked as ds_q4k_scale_min unpacks them.
DS_FN void ds_q4k_dm(uint32_t dm, DS_THR const uint32_t* s, uint32_t j, DS_THR float& dl, DS_THR float& ml) {
#define DS_SB(i) ((s[(i) / 4] >> (8 * ((i) % 4))) & 255u)
  float sc, m;
  if (j < 4) {
    sc = float(DS_SB(j) & 63u);
    m = float(DS_SB(j + 4) & 63u);
  } else {
    sc = float((DS_SB(j + 4) & 15u) | ((DS_SB(j - 4) >> 6) << 4));
    m = float((DS_SB(j + 4) >> 4) | ((DS_SB(j) >> 6) << 4));
  }
#undef DS_SB
  dl = DS_F16_BITS(dm & 0xffffu) * sc;
  ml = DS_F16_BITS(dm >> 16) * m;
}

DS_FN void ds_raw16_decode(int qt, DS_THR const ds_raw16& r, uint32_t u, uint32_t hf, DS_THR float* out) {
  if (qt == DS_Q8_0) {
    const float d = DS_F16_BITS(r.s0);
    ds_q8_8(r.w, d, out);
    ds_q8_8(r.w + 4, d, out + 8);
  } else if (qt == DS_Q2_K) {
    float dl, ml;
    ds_q2k_dm(r.s0, r.s1, dl, ml);
    ds_k_8(r.w, 2u * (u & 3u), 0x03030303u, dl, ml, out);
    ds_k_8(r.w + 2, 2u * (u & 3u), 0x03030303u, dl, ml, out + 8);
  } else if (qt == DS_Q4_K) {
    float dl, ml;
    ds_q4k_dm(r.s0, r.w + 4, u & 7u, dl, ml);
    ds_k_8(r.w, 4u * (u & 1u), 0x0F0F0F0Fu, dl, ml, out);
    ds_k_8(r.w + 2, 4u * (u & 1u), 0x0F0F0F0Fu, dl, ml, out + 8);
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

// mm's CUDA path: the 4 lanes c of a weight row share each 128-weight K step st (units 4st .. 4st + 3), a lane
// holding 32 of its weights as 4 groups q of 8 consecutive ones (ds_step_load: their words; ds_step_group_h:
// group q as 4 words of f16 pairs, each rounded once). IQ2_XXS, Q8_0, F16, BF16 and F32 give lane c unit
// 4st + c (group q: its weights 8q ..); Q2_K and Q4_K, whose units share bytes (2-bit and 4-bit planes), give
// lane c weights 8c .. 8c + 7 of every unit (group q: unit 4st + q), so a lane reads only the bytes it decodes.
// ds_step_chunk: where group q lies in the step, in 8-weight chunks.
DS_FN bool ds_unit_lanes(int qt) { return qt != DS_Q2_K && qt != DS_Q4_K; }
DS_FN uint32_t ds_step_chunk(int qt, uint32_t c, uint32_t q) { return ds_unit_lanes(qt) ? 4 * c + q : 4 * q + c; }
// Whether lane c's share of step st lies within the row's n_units units (K-quants: whole 256-weight blocks).
DS_FN bool ds_step_has(int qt, uint32_t st, uint32_t c, uint32_t n_units) {
  return (ds_unit_lanes(qt) ? 4 * st + c : 4 * st) < n_units;
}

struct ds_step_w {
  uint32_t w[16];
  uint32_t s0;
  const uint8_t* p;
};

DS_FN ds_step_w ds_step_load(int qt, const uint8_t* row, uint32_t st, uint32_t c) {
  ds_step_w r;
  r.s0 = 0u;
  r.p = row;
  const uint32_t u = 4 * st + c;
  if (qt == DS_IQ2_XXS) {  // d, the unit's grid indices and its signs/scale word
    const uint8_t* b = row + 66u * (u >> 3);
    r.w[0] = ds_ld32_a2(b + 2 + 8 * (u & 7u));
    r.w[1] = ds_ld32_a2(b + 6 + 8 * (u & 7u));
    r.s0 = ds_ld16(b);
  } else if (qt == DS_Q2_K) {  // bytes 8c .. of the step's 2-bit planes, its 8 scale bytes, (d, dmin)
    const uint8_t* b = row + 84u * (st >> 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      r.w[i] = ds_ld32(b + 16 + 32 * (st & 1u) + 8 * c + 4 * i);
      r.w[2 + i] = ds_ld32(b + 8 * (st & 1u) + 4 * i);
    }
    r.s0 = ds_ld32(b + 80);
  } else if (qt == DS_Q4_K) {  // bytes 8c .. of the step's two nibble planes, the 12 scale bytes, (d, dmin)
    const uint8_t* b = row + 144u * (st >> 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = ds_ld32(b + 16 + 64 * (st & 1u) + 32 * (i >> 1) + 8 * c + 4 * (i & 1));
#pragma unroll
    for (int i = 0; i < 3; ++i) r.w[4 + i] = ds_ld32(b + 4 + 4 * i);
    r.s0 = ds_ld32(b);
  } else if (qt == DS_Q8_0) {  // d, then 32 int8 as 16 halfwords
    const uint8_t* b = row + 34u * u;
    r.s0 = ds_ld16(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) r.w[i] = ds_ld16(b + 2 + 2 * i);
  } else if (qt == DS_F16 || qt == DS_BF16) {
#pragma unroll
    for (int i = 0; i < 16; ++i) r.w[i] = ds_ld32(row + 64u * u + 4 * i);
  } else {
    r.p = row + 128u * u;
  }
  return r;
}

// IQ2_XXS in f16x2 arithmetic, ~3 instructions a weight against ~6 in f32: a PRMT makes two grid bytes g into
// the f16 values 1024 + g, one FMA gives (1024 + g)·s − 1024·s = g·s with s = 2ls + 1 (exact: the fused product
// is exact and g·s ≤ 1333 fits f16's integers), and the product by d is the one rounding, of 8·w (DS_MM_A_SCALE
// takes the 8 back). F16 as stored. Other types: decoded exactly in f32, then rounded (Q2_K's min term would
// cancel in f16: dl·q − ml, both rounded, is off by many ulps).
// Once a step's words have arrived, before its groups: IQ2_XXS's three f16 pairs of the unit (s, −1024·s, d).
DS_FN void ds_step_prep(int qt, ds_step_w& r) {
  if (qt == DS_IQ2_XXS) {
    const float sf = ds_u2f(2u * (r.w[1] >> 28) + 1u);
    r.w[2] = ds_h2_splat(sf);
    r.w[3] = ds_h2_splat(-1024.0f * sf);
    r.s0 = (r.s0 & 0xffffu) * 0x10001u;
  }
}

DS_FN void ds_step_group_h(int qt, const ds_step_w& r, uint32_t st, uint32_t c, uint32_t q, uint32_t* out) {
  if (qt == DS_IQ2_XXS) {  // after ds_step_prep
    const uint32_t A = r.w[0], B = r.w[1], s = r.w[2], k = r.w[3], d = r.s0;
    const uint32_t gi = (A >> (8 * q)) & 255u, sg = ds_iq2_signs((B >> (7 * q)) & 127u);
    const uint32_t g[2] = {ds_iq2_grid[2 * gi], ds_iq2_grid[2 * gi + 1]};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t h = __byte_perm(g[i >> 1], 0x64646464u, (i & 1) ? 0x4342u : 0x4140u);  // 0x64gg: 1024 + g
      out[i] = ds_h2_mul(ds_h2_fma(h, s, k), d) ^ ds_iq2_sign_pair(sg, i);
    }
    return;
  }
  if (qt == DS_F16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = r.w[4 * q + i];
    return;
  }
  float v[8], dl, ml;
  if (qt == DS_Q8_0) {
    ds_q8_8(r.w + 4 * q, DS_F16_BITS(r.s0), v);
  } else if (qt == DS_Q2_K) {  // unit 4(st % 2) + q of the block, its half c / 2: scale byte 2q + c / 2
    ds_q2k_dm(r.s0, (r.w[2 + (q >> 1)] >> (16 * (q & 1u) + 8 * (c >> 1))) & 255u, dl, ml);
    ds_k_8(r.w, 2 * q, 0x03030303u, dl, ml, v);
  } else if (qt == DS_Q4_K) {  // unit 4(st % 2) + q of the block: plane q / 2, nibble q % 2
    ds_q4k_dm(r.s0, r.w + 4, 4 * (st & 1u) + q, dl, ml);
    ds_k_8(r.w + 2 * (q >> 1), 4 * (q & 1u), 0x0F0F0F0Fu, dl, ml, v);
  } else if (qt == DS_BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = DS_U32_AS_F(r.w[4 * q + i] << 16);
      v[2 * i + 1] = DS_U32_AS_F(r.w[4 * q + i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ((const float*)r.p)[8 * q + i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = ds_half2_bits(v[2 * i], v[2 * i + 1]);
}

// 16 bytes from device to threadgroup memory, or zeros (!ok), by cp.async (through L2 only): in flight until
// ds_cp_wait.
#if defined(DS_SIM)
DS_FN void ds_cp16(void* dst, const void* src, bool ok) { ok ? (void)memcpy(dst, src, 16) : (void)memset(dst, 0, 16); }
#define ds_cp_wait()
#else
DS_FN void ds_cp16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(ok ? 16 : 0));
}
#define ds_cp_wait() asm volatile("cp.async.wait_all;\n" ::)
#endif

// d += A·B on the tensor cores (PTX mma.m16n8k16, f16 inputs, f32 accumulation), in PTX's fragment layout: lane
// (g, t) = (lane / 4, lane % 4) holds A's rows g, g + 8 at K positions 2t, 2t + 1 (a0: row g, a1: row g + 8) and
// 2t + 8, 2t + 9 (a2, a3), B's column g at the same K positions (b0, b1), d's rows g, g + 8 at columns 2t, 2t + 1.
// ds_mma16816_bf16: the same with bf16 inputs.
#if defined(DS_SIM)
DS_FN void ds_mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  ds_sim_mma16816(d, a0, a1, a2, a3, b0, b1, false);
}
DS_FN void ds_mma16816_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  ds_sim_mma16816(d, a0, a1, a2, a3, b0, b1, true);
}
#else
#define DS_MMA16816(name, ab)                                                                                   \
  DS_FN void name(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {    \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ab "." ab ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
                 "{%8, %9}, {%0, %1, %2, %3};"                                                                  \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                               \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                       \
  }
DS_MMA16816(ds_mma16816, "f16")
DS_MMA16816(ds_mma16816_bf16, "bf16")
#endif

// Four 8x8 16-bit matrices from threadgroup memory into mma registers (PTX ldmatrix.m8n8.x4): lane 8 i + r gives
// the address of row r of matrix i (16 bytes, 16-byte aligned); r[i] gets matrix i's two values at row lane / 4,
// columns 2 (lane % 4), +1 (as an A fragment's row or a B fragment's column holds them), or with _t (.trans) the
// two at rows 2 (lane % 4), +1 of column lane / 4 (a B fragment of a matrix stored by rows of N).
#if defined(DS_SIM)
DS_FN void ds_ldsm_x4(uint32_t* r, const void* p) { ds_sim_ldmatrix_x4(r, p, false); }
DS_FN void ds_ldsm_x4_t(uint32_t* r, const void* p) { ds_sim_ldmatrix_x4(r, p, true); }
#else
#define DS_LDSM_X4(name, trans)                                                             \
  DS_FN void name(uint32_t* r, const void* p) {                                             \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" trans ".shared.b16 {%0, %1, %2, %3}, [%4];" \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                           \
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));                             \
  }
DS_LDSM_X4(ds_ldsm_x4, "")
DS_LDSM_X4(ds_ldsm_x4_t, ".trans")
#endif
#endif
