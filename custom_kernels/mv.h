// mv.h: helpers of the decode matvec (mv.body), after ds_quant.h in its `header`.

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


// Octet lanes (the types of the hot decode launches: Q8_0, Q2_K, IQ2_XXS). Lane L of a span takes the
// 8-weight octets L, L+32, L+64, L+96 (unit o/4, its octet o%4) instead of unit L: its activations are then 32
// bytes in every 1 KB that the warp reads together, 8 cache lines a load instead of 32 (a lane per unit reads
// 128 B of its own, a line per lane), and the lanes of one pass read the weight bytes of one or two blocks.
DS_FN constexpr bool ds_octet_lanes(int qt) { return qt == DS_Q8_0 || qt == DS_Q2_K || qt == DS_IQ2_XXS; }

// Dot of octet o of `row` (staged bytes; `grid` = the IQ2 grid there) with x[0..7] in registers.
DS_FN float ds_dot8(int qt, const DS_TG uint8_t* row, uint32_t o, const DS_THR float* x, const DS_TG uint32_t* grid) {
  const uint32_t u = o >> 2, k = o & 3u;
  float s = 0.0f;
  if (qt == DS_Q8_0) {
    const DS_TG uint8_t* b = row + 34u * u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q = ds_tld16(b + 2 + 8 * k + 2 * i);
      s = DS_FMA(ds_s8f(q & 255u), x[2 * i], s);
      s = DS_FMA(ds_s8f(q >> 8), x[2 * i + 1], s);
    }
    return ds_tf16(b) * s;
  } else if (qt == DS_Q2_K) {  // octet k of unit r: bytes 8k.. of its 32 (group k/2 of 16 weights), plane r%4
    const DS_TG uint8_t* b = row + 84u * (u >> 3);
    const uint32_t r = u & 7u, sh = 2u * (r & 3u);
    const DS_TG uint8_t* q = b + 16 + 32 * (r >> 2) + 8 * k;
    const uint32_t w0 = ds_tld32(q) >> sh, w1 = ds_tld32(q + 4) >> sh;
    float xs = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s = DS_FMA(ds_u2f((w0 >> (8 * j)) & 3u), x[j], s);
      s = DS_FMA(ds_u2f((w1 >> (8 * j)) & 3u), x[4 + j], s);
      xs += x[j] + x[4 + j];
    }
    const uint32_t sc = b[2 * r + (k >> 1)];
    return ds_tf16(b + 80) * float(sc & 15u) * s - ds_tf16(b + 82) * float(sc >> 4) * xs;
  } else {  // DS_IQ2_XXS: grid index = byte k of the unit's first word, signs = bits 7k.. of the second
    const DS_TG uint8_t* b = row + 66u * (u >> 3);
    const DS_TG uint8_t* g = b + 2 + 8 * (u & 7u);
    const uint32_t gi = g[k], B = ds_tld32_a2(g + 4);
    const uint32_t sg = ds_iq2_signs((B >> (7 * k)) & 127u);
    const uint32_t lo = grid[2 * gi], hi = grid[2 * gi + 1];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = ds_byte_f(j < 4 ? lo : hi, j & 3);
      s = DS_FMA(DS_U32_AS_F(DS_F_AS_U32(v) ^ (((sg >> j) & 1u) << 31)), x[j], s);  // sign by bit flip
    }
    return ds_tf16(b) * (0.5f + float(B >> 28)) * 0.25f * s;
  }
}

// ds_dot8 with x quantized (ds_xq_load: q, d, s): integer dots of 4 bytes (ds_dp4a) with q and with the
// remainder, one f32 scale an octet.
DS_FN float ds_dot8q(int qt, const DS_TG uint8_t* row, uint32_t o, const DS_THR uint32_t* q, float d, float s,
                     const DS_TG uint32_t* grid) {
  const uint32_t u = o >> 2, k = o & 3u;
  uint32_t lo, hi;  // the octet's weights as signed bytes (Q8_0, IQ2_XXS) or 0..3 (Q2_K)
  float scale;
  if (qt == DS_Q8_0) {
    const DS_TG uint8_t* b = row + 34u * u;
    lo = ds_tld32_a2(b + 2 + 8 * k);
    hi = ds_tld32_a2(b + 6 + 8 * k);
    scale = ds_tf16(b);
  } else if (qt == DS_Q2_K) {
    const DS_TG uint8_t* b = row + 84u * (u >> 3);
    const uint32_t r = u & 7u, sh = 2u * (r & 3u);
    const DS_TG uint8_t* p = b + 16 + 32 * (r >> 2) + 8 * k;
    lo = (ds_tld32(p) >> sh) & 0x03030303u;
    hi = (ds_tld32(p + 4) >> sh) & 0x03030303u;
    const uint32_t sc = b[2 * r + (k >> 1)];
    scale = ds_tf16(b + 80) * float(sc & 15u);
    s *= ds_tf16(b + 82) * float(sc >> 4);  // the min term
  } else {  // DS_IQ2_XXS: magnitudes (8, 25 or 43) as bytes, negated where the sign bit is set: (g ^ m) + (m & 1)
    const DS_TG uint8_t* b = row + 66u * (u >> 3);
    const DS_TG uint8_t* g = b + 2 + 8 * (u & 7u);
    const uint32_t gi = g[k], B = ds_tld32_a2(g + 4);
    const uint32_t sg = ds_iq2_signs((B >> (7 * k)) & 127u);
    // sign bit j (and 4 + j) to bit 0 of byte j: bit j lands at 8j (the products' bits never overlap)
    const uint32_t one_lo = ((sg & 15u) * 0x00204081u) & 0x01010101u, one_hi = ((sg >> 4) * 0x00204081u) & 0x01010101u;
    lo = (grid[2 * gi] ^ (one_lo * 255u)) + one_lo;
    hi = (grid[2 * gi + 1] ^ (one_hi * 255u)) + one_hi;
    scale = ds_tf16(b) * (0.5f + float(B >> 28)) * 0.25f;
  }
  const int dq = ds_dp4a(lo, q[0], ds_dp4a(hi, q[1], 0)), dr = ds_dp4a(lo, q[2], ds_dp4a(hi, q[3], 0));
  const float dot = scale * d * ((float)dq + (float)dr * (1.0f / 128.0f));
  return qt == DS_Q2_K ? dot - s : dot;
}

// The span loop of one pair of mv.body, for weights of type QX: rows at wa + off (and, NW == 2, the second
// weight's at wb + off_b), rb bytes apart, staged SPAN bytes apart; acc[NR·NW] gathers each row's dot with
// x = xr (EPI 3: x·nw, its Σx² into ssq). A function of the type, so one launch can read two types (the
// routed experts and the shared expert, mv.body SH). XQ (octet types): x comes quantized (ds_xq_load) and
// every row dots it in integers (ds_dot8q).
template <int QX, int NR, int NW, int KS, int EPI, int SPAN, bool XQ>
DS_FN void ds_mv_spans(DS_TG uint8_t* stage, const DS_DEV uint8_t* wa, const DS_DEV uint8_t* wb, uint64_t off,
                       uint64_t off_b, uint32_t rb, uint32_t nrows, uint32_t n_units, uint32_t kpart, uint32_t lane,
                       const DS_DEV float* xr, const DS_DEV float* nw, DS_THR float* acc, DS_THR float& ssq,
                       const DS_TG uint32_t* grid) {
  constexpr int NRW = NR * NW;
// Copy span u (units u .. u+31, fewer at the end of K) of the rows of each weight into stage buffer b.
#define DS_MV_STAGE(u, b)                                                                                        \
  {                                                                                                              \
    const uint32_t nb_ = ds_span_bytes(QX, n_units - (u) < 32u ? n_units - (u) : 32u);                          \
    ds_stage_span(stage + (b) * NRW * SPAN, SPAN, wa, off + ds_span_bytes(QX, (u)), rb, nrows, nb_, lane);       \
    if (NW == 2)                                                                                                 \
      ds_stage_span(stage + ((b) * NRW + NR) * SPAN, SPAN, wb, off_b + ds_span_bytes(QX, (u)), rb, nrows, nb_, lane); \
  }
  uint32_t u0 = 32 * kpart, buf = 0;
  if (u0 < n_units) DS_MV_STAGE(u0, 0u);
  DS_ASYNC_COMMIT();
  for (; u0 < n_units; u0 += 32 * KS) {
    const uint32_t nu = n_units - u0 < 32u ? n_units - u0 : 32u;
    const uint32_t un = u0 + 32 * KS;  // this simdgroup's next span
    float xv[32];
    constexpr bool OCT = ds_octet_lanes(QX);
    constexpr bool Q = XQ && OCT && EPI != 3;
    if (!Q && (OCT || lane < nu)) {  // issued before the wait: in flight with the staged copy
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        // lane's unit: floats 32·lane + 4i; octet lanes: octet lane + 32·(i/2), its half i%2
        const uint32_t e = OCT ? 8 * (lane + 32 * (i >> 1)) + 4 * (i & 1) : 32 * lane + 4 * i;
        if (OCT && e >= 32u * nu) {  // past K (a short last span)
          xv[4 * i] = xv[4 * i + 1] = xv[4 * i + 2] = xv[4 * i + 3] = 0.0f;
          continue;
        }
        float4 t = *((const DS_DEV float4*)(xr + 32 * u0 + e));
        if (EPI == 3) {  // x^2 summed, x scaled by the norm weight (16-byte loads); 1/rms scales the row sums
          const float4 n = *((const DS_DEV float4*)(nw + 32 * u0 + e));
          ssq = DS_FMA(t.w, t.w, DS_FMA(t.z, t.z, DS_FMA(t.y, t.y, DS_FMA(t.x, t.x, ssq))));
          t.x *= n.x; t.y *= n.y; t.z *= n.z; t.w *= n.w;
        }
        xv[4 * i] = t.x; xv[4 * i + 1] = t.y; xv[4 * i + 2] = t.z; xv[4 * i + 3] = t.w;
      }
    }
    uint32_t xq[Q ? 16 : 1];
    float xd[Q ? 4 : 1], xsum[Q ? 4 : 1];
    if (Q) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t o = lane + 32 * p;
        if (o < 4 * nu) ds_xq_load(xr, 32 * n_units, 4 * u0 + o, xq + 4 * p, xd[p], xsum[p]);
      }
    }
    if (DS_ASYNC_COPIES && un < n_units) DS_MV_STAGE(un, buf ^ 1u);  // into the other buffer, during this span
    DS_ASYNC_COMMIT();
    DS_ASYNC_WAIT_PREV();  // this span's copy has landed (the next one may still be in flight)
    DS_SIMD_BARRIER_TG();
    if (OCT) {
      const DS_TG uint8_t* cur = stage + buf * NRW * SPAN;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const uint32_t o = lane + 32 * p;
        if (o >= 4 * nu) break;  // octets past K (uniform per p but for the last span's partial pass)
#pragma unroll
        for (int r = 0; r < NRW; ++r) {
          if ((uint32_t)(r % NR) < nrows)
            acc[r] += Q ? ds_dot8q(QX, cur + r * SPAN, o, xq + 4 * p, xd[p], xsum[p], grid)
                        : ds_dot8(QX, cur + r * SPAN, o, xv + 8 * p, grid);
        }
      }
    } else if (lane < nu) {
      const DS_TG uint8_t* cur = stage + buf * NRW * SPAN;
      float xs[2] = {0.0f, 0.0f};
      if (QX == DS_Q2_K || QX == DS_Q4_K) {
#pragma unroll
        for (int i = 0; i < 16; ++i) { xs[0] += xv[i]; xs[1] += xv[16 + i]; }
      }
#pragma unroll
      for (int r = 0; r < NRW; ++r) {
        if ((uint32_t)(r % NR) < nrows) acc[r] += ds_dot32(QX, cur + r * SPAN, lane, xv, xs, grid);
      }
    }
    DS_SIMD_BARRIER_TG();  // before this buffer is refilled
    if (DS_ASYNC_COPIES) {
      buf ^= 1u;
    } else if (un < n_units) {
      DS_MV_STAGE(un, 0u);  // synchronous copies: refill the one buffer after computing
      DS_SIMD_BARRIER_TG();
    }
  }
#undef DS_MV_STAGE
  DS_ASYNC_WAIT_ALL();
  DS_SIMD_BARRIER_TG();  // the next pair's first copy reuses buffer 0
}
