// mv_reg.h: helpers of the decode matvecs that read weights straight into registers (mv_reg.body), after
// ds_quant.h in its `header`.

// Unit u (32 weights) of a row, read straight from device memory into DS_REG_RAW words:
//   IQ2_XXS {scale bits, grid-index word, sign word};
//   Q8_0 (x quantized; with x in f32 a thread reads a quarter unit, ds_reg_rows_q8) {scale bits, the 32 weights
//     as 8 words}: read as the 9 aligned words that hold the unit, shifted into place (17 two-byte loads
//     otherwise; blocks are only 2-byte aligned). Where the unit starts 4-byte aligned that reads 2 bytes past
//     it, which the next unit holds when the row bytes are a multiple of 4 (kernels.mv asks K % 64 == 0);
//   F16, BF16 {the 32 weights as 16 words}: 64 aligned bytes (row bytes 2K, a multiple of 128).
// (Q2_K rows are read a plane group a thread: ds_reg_rows_q2k.)
#define DS_REG_RAW(qt) (qt == DS_Q8_0 ? 9 : qt == DS_F16 || qt == DS_BF16 ? 16 : 3)
DS_FN void ds_reg_unit_load(int qt, const DS_DEV uint8_t* row, uint32_t u, DS_THR uint32_t* raw) {
  if (qt == DS_Q8_0) {
    const DS_DEV uint8_t* p = row + 34u * u;
    const uint32_t mis = (uint32_t)((uint64_t)p & 2u);  // 0 or 2
    const DS_DEV uint32_t* a = (const DS_DEV uint32_t*)(p - mis);
    uint32_t w[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) w[i] = a[i];
    raw[0] = (w[0] >> (8 * mis)) & 0xffffu;
    const uint32_t sh = mis ? 32u : 16u;  // the weights start 2 + mis bytes into w
#pragma unroll
    for (int i = 0; i < 8; ++i) raw[1 + i] = (uint32_t)((((uint64_t)w[i + 1] << 32) | w[i]) >> sh);
  } else if (qt == DS_F16 || qt == DS_BF16) {
    const DS_DEV uint4* p = (const DS_DEV uint4*)(row + 64u * u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = p[i];
      raw[4 * i] = v.x; raw[4 * i + 1] = v.y; raw[4 * i + 2] = v.z; raw[4 * i + 3] = v.w;
    }
  } else {  // DS_IQ2_XXS
    const DS_DEV uint8_t* b = row + 66u * (u >> 3);
    const DS_DEV uint16_t* g = (const DS_DEV uint16_t*)(b + 2 + 8 * (u & 7u));
    raw[0] = *((const DS_DEV uint16_t*)b);
    raw[1] = (uint32_t)g[0] | ((uint32_t)g[1] << 16);
    raw[2] = (uint32_t)g[2] | ((uint32_t)g[3] << 16);
  }
}

// Dot of a loaded unit (IQ2_XXS, Q8_0) with x quantized (ds_xq_load's layout): q[0..7] the unit's q words,
// q[8..15] its remainder words, d[0..3] its octets' scales. tabs: the IQ2 grid (512 words), then the 128 sign
// bytes (ds_iq2_signs; 32 words, one a bank, so lanes never conflict); an octet's weights become signed bytes as
// (g ^ 255·n) + n, n its negative bytes as 0 or 1.
DS_FN float ds_reg_dot_q(int qt, const DS_THR uint32_t* raw, const DS_THR uint32_t* q, const DS_THR float* d,
                         const DS_TG uint32_t* tabs) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t lo = raw[1 + 2 * k], hi = raw[2 + 2 * k];
    if (qt != DS_Q8_0) {
      const uint32_t gi = (raw[1] >> (8 * k)) & 255u;
      const uint32_t sg = ((const DS_TG uint8_t*)(tabs + 512))[(raw[2] >> (7 * k)) & 127u];
      const uint32_t nlo = ((sg & 15u) * 0x00204081u) & 0x01010101u;  // bit j to byte j
      const uint32_t nhi = ((sg >> 4) * 0x00204081u) & 0x01010101u;
      lo = (tabs[2 * gi] ^ (nlo * 255u)) + nlo;
      hi = (tabs[2 * gi + 1] ^ (nhi * 255u)) + nhi;
    }
    const int dq = ds_dp4a(lo, q[2 * k], ds_dp4a(hi, q[2 * k + 1], 0));
    const int dr = ds_dp4a(lo, q[8 + 2 * k], ds_dp4a(hi, q[9 + 2 * k], 0));
    s = DS_FMA(d[k], (float)(128 * dq + dr), s);
  }
  const float scale = qt == DS_Q8_0 ? 1.0f : (0.5f + float(raw[2] >> 28)) * 0.25f;
  return DS_F16_BITS(raw[0]) * scale * (1.0f / 128.0f) * s;
}

// Dot of a loaded unit (F16, BF16) with x[0..31] in f32. (With x in f32, Q8_0 runs a quarter unit a thread,
// ds_reg_rows_q8, and Q2_K a plane group, ds_reg_rows_q2k.)
DS_FN float ds_reg_dot_f(int qt, const DS_THR uint32_t* raw, const DS_THR float* x) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t w = raw[i];
    const float w0 = qt == DS_F16 ? DS_F16_BITS(w & 0xffffu) : DS_U32_AS_F(w << 16);
    const float w1 = qt == DS_F16 ? DS_F16_BITS(w >> 16) : DS_U32_AS_F(w & 0xffff0000u);
    s = DS_FMA(w1, x[2 * i + 1], DS_FMA(w0, x[2 * i], s));
  }
  return s;
}

// Float4 i of x (xr): with RMS its squares go into ssq and it comes back times float4 i of the norm weight nw (the
// dots take x·nw; 1/rms scales the row sums afterwards).
template <bool RMS>
DS_FN float4 ds_reg_x4(const DS_DEV float* xr, const DS_DEV float* nw, uint32_t i, DS_THR float& ssq) {
  float4 t = ((const DS_DEV float4*)xr)[i];
  if (RMS) {
    const float4 n = ((const DS_DEV float4*)nw)[i];
    ssq = DS_FMA(t.w, t.w, DS_FMA(t.z, t.z, DS_FMA(t.y, t.y, DS_FMA(t.x, t.x, ssq))));
    t.x *= n.x; t.y *= n.y; t.z *= n.z; t.w *= n.w;
  }
  return t;
}

// Q8_0 rows with x in f32, a quarter unit (8 weights) a thread, quarters tid, tid + tpb, ...: a simdgroup's loads
// of a pass cover 8 whole units, 272 contiguous bytes of each row and 1 KB of x. (A whole unit a thread reads x
// 128 bytes apart from lane to lane, 32 cache lines a load.) The quarter's 8 bytes start 2-byte aligned: read as
// the aligned words that hold them (a third word only where they straddle it) and shifted into place.
template <int NR, int NW, bool RMS, int XB>
DS_FN void ds_reg_rows_q8(const DS_DEV uint8_t* wa, const DS_DEV uint8_t* wb, uint32_t rb, uint32_t r0,
                          uint32_t n_out, uint32_t n_in, uint32_t tid, uint32_t tpb, const DS_DEV float* xr,
                          uint32_t x_pitch, uint32_t nb, const DS_DEV float* nw, DS_THR float* acc,
                          DS_THR float* ssq) {
  for (uint32_t qi = tid; qi < n_in / 8; qi += tpb) {
    const uint32_t blk = 34u * (qi >> 2), off = blk + 2u + 8u * (qi & 3u);
    const uint32_t mis = off & 2u;  // rows start 4-byte aligned (row bytes a multiple of 68: K % 64 == 0)
    uint32_t lo[NW * NR], hi[NW * NR];
    float d[NW * NR];
#pragma unroll
    for (int r = 0; r < NW * NR; ++r) {
      const uint32_t row = r0 + (r % NR) < n_out ? r0 + (r % NR) : n_out - 1;
      const DS_DEV uint8_t* p = (r < NR ? wa : wb) + (uint64_t)row * rb;
      const DS_DEV uint32_t* a = (const DS_DEV uint32_t*)(p + off - mis);
      const uint32_t w0 = a[0], w1 = a[1], w2 = mis ? a[2] : 0u;
      lo[r] = mis ? (w0 >> 16) | (w1 << 16) : w0;
      hi[r] = mis ? (w1 >> 16) | (w2 << 16) : w1;
      d[r] = DS_F16_BITS(*((const DS_DEV uint16_t*)(p + blk)));
    }
#pragma unroll
    for (int b = 0; b < XB; ++b) {
      if ((uint32_t)b >= nb) break;
      const DS_DEV float* xb = xr + (uint64_t)b * x_pitch + 8u * qi;
      const float4 t0 = ds_reg_x4<RMS>(xb, nw + 8u * qi, 0u, ssq[b]);
      const float4 t1 = ds_reg_x4<RMS>(xb, nw + 8u * qi, 1u, ssq[b]);
      const float x[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
#pragma unroll
      for (int r = 0; r < NW * NR; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) s = DS_FMA(ds_s8x_f(lo[r] ^ 0x80808080u, j), x[j], s);
#pragma unroll
        for (int j = 0; j < 4; ++j) s = DS_FMA(ds_s8x_f(hi[r] ^ 0x80808080u, j), x[4 + j], s);
        acc[b * NW * NR + r] = DS_FMA(d[r], s, acc[b * NW * NR + r]);
      }
    }
  }
}

// Q2_K rows, a plane group a thread: 8 plane bytes of a half (positions 8p .. 8p + 7, p = g & 3, half (g >> 2) & 1
// of block g >> 3), which hold those positions of the half's four units (plane j: bits 2j). So a thread reads 8
// plane bytes, the half's 8 scale bytes and the block's (d, dmin) word for 32 weights, and x in four 8-float chunks
// 32 floats apart (XQ: x's octets 4 apart, dotted in integers); the 8 threads of a block cover its 84 bytes. (A
// quarter unit a thread, 8 weights for 4 loads, ran slower than mv.body on the H200.)
template <int NR, int NW, bool XQ, int XB>
DS_FN void ds_reg_rows_q2k(const DS_DEV uint8_t* wa, const DS_DEV uint8_t* wb, uint32_t rb, uint32_t r0,
                           uint32_t n_out, uint32_t n_in, uint32_t tid, uint32_t tpb, const DS_DEV float* xr,
                           uint32_t x_pitch, uint32_t nb, DS_THR float* acc) {
  for (uint32_t g = tid; g < n_in / 32; g += tpb) {
    const uint32_t h = (g >> 2) & 1u, p = g & 3u, blk = 84u * (g >> 3);
    uint32_t q[NW * NR][2], sc[NW * NR][2], dm[NW * NR];
#pragma unroll
    for (int k = 0; k < NW * NR; ++k) {
      const uint32_t row = r0 + (k % NR) < n_out ? r0 + (k % NR) : n_out - 1;
      const DS_DEV uint8_t* b = (k < NR ? wa : wb) + (uint64_t)row * rb + blk;
      const DS_DEV uint32_t* qw = (const DS_DEV uint32_t*)(b + 16u + 32u * h + 8u * p);
      const DS_DEV uint32_t* sw = (const DS_DEV uint32_t*)(b + 8u * h);
      q[k][0] = qw[0]; q[k][1] = qw[1];
      sc[k][0] = sw[0]; sc[k][1] = sw[1];
      dm[k] = *((const DS_DEV uint32_t*)(b + 80));
    }
#pragma unroll
    for (int b = 0; b < XB; ++b) {
      if ((uint32_t)b >= nb) break;
      const DS_DEV float* xrb = xr + (uint64_t)b * x_pitch;
      const DS_DEV float* xg = xrb + 256u * (g >> 3) + 128u * h + 8u * p;  // plane j's chunk: xg + 32j
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float x[8], xs, xd = 0.0f;  // XQ: x ≈ 128·xd·(q + r/128) over the octet
        uint32_t xw[4];             // XQ: the octet's q words, then its r words
        if (XQ) {  // x's octet of plane j
          ds_xq_load(xrb, n_in, 32u * (g >> 3) + 16u * h + 4u * j + p, xw, xd, xs);
          xd *= 1.0f / 128.0f;
        } else {
          const float4 t0 = ((const DS_DEV float4*)(xg + 32 * j))[0], t1 = ((const DS_DEV float4*)(xg + 32 * j))[1];
          x[0] = t0.x; x[1] = t0.y; x[2] = t0.z; x[3] = t0.w; x[4] = t1.x; x[5] = t1.y; x[6] = t1.z; x[7] = t1.w;
          xs = ((t0.x + t0.y) + (t0.z + t0.w)) + ((t1.x + t1.y) + (t1.z + t1.w));
        }
#pragma unroll
        for (int k = 0; k < NW * NR; ++k) {
          const uint32_t lo = (q[k][0] >> (2 * j)) & 0x03030303u, hi = (q[k][1] >> (2 * j)) & 0x03030303u;
          // scale 2j + p / 2 of the half
          const uint32_t s8 = (sc[k][j >> 1] >> (8 * (2 * (j & 1) + (p >> 1)))) & 255u;
          float s = 0.0f;
          if (XQ) {
            s = xd * (float)(128 * ds_dp4a(lo, xw[0], ds_dp4a(hi, xw[1], 0))
                             + ds_dp4a(lo, xw[2], ds_dp4a(hi, xw[3], 0)));
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) s = DS_FMA(ds_byte_f(lo, i), x[i], s);
#pragma unroll
            for (int i = 0; i < 4; ++i) s = DS_FMA(ds_byte_f(hi, i), x[4 + i], s);
          }
          acc[b * NW * NR + k] +=
              DS_F16_BITS(dm[k] & 0xffffu) * float(s8 & 15u) * s - DS_F16_BITS(dm[k] >> 16) * float(s8 >> 4) * xs;
        }
      }
    }
  }
}

// One weight's rows against nb ≤ XB rows of x: acc[b·NW·NR + r] (r < NR: rows r0 + r of wa; then, NW == 2, of
// wb) += the row's dot with x row b (xr + b·x_pitch: quantized if XQ, else f32; RMS: times the norm weight nw,
// with Σx² into ssq[b]) over the units this thread takes (tid, tid + tpb, ...; Q8_0 with x in f32: quarter units,
// ds_reg_rows_q8; Q2_K: plane groups, ds_reg_rows_q2k). Each unit's bytes are loaded and decoded once for all nb
// rows of x. Rows past n_out read row n_out - 1 (unused).
template <int QX, int NR, int NW, bool XQ, bool RMS, int XB>
DS_FN void ds_reg_rows(const DS_DEV uint8_t* wa, const DS_DEV uint8_t* wb, uint32_t rb, uint32_t r0, uint32_t n_out,
                       uint32_t n_in, uint32_t tid, uint32_t tpb, const DS_DEV float* xr, uint32_t x_pitch,
                       uint32_t nb, const DS_DEV float* nw, const DS_TG uint32_t* tabs, DS_THR float* acc,
                       DS_THR float* ssq) {
  if (QX == DS_Q8_0 && !XQ) {
    ds_reg_rows_q8<NR, NW, RMS, XB>(wa, wb, rb, r0, n_out, n_in, tid, tpb, xr, x_pitch, nb, nw, acc, ssq);
    return;
  }
  if (QX == DS_Q2_K) {  // (MV_RMS takes no Q2_K)
    ds_reg_rows_q2k<NR, NW, XQ, XB>(wa, wb, rb, r0, n_out, n_in, tid, tpb, xr, x_pitch, nb, acc);
    return;
  }
  for (uint32_t u = tid; u < n_in / 32; u += tpb) {
    uint32_t raw[NW * NR][DS_REG_RAW(QX)];  // every row's bytes of unit u first: NW·NR loads in flight
#pragma unroll
    for (int r = 0; r < NW * NR; ++r) {
      const uint32_t row = r0 + (r % NR) < n_out ? r0 + (r % NR) : n_out - 1;
      ds_reg_unit_load(QX, (r < NR ? wa : wb) + (uint64_t)row * rb, u, raw[r]);
    }
#pragma unroll
    for (int b = 0; b < XB; ++b) {  // every x row against the loaded bytes
      if ((uint32_t)b >= nb) break;
      const DS_DEV float* xb = xr + (uint64_t)b * x_pitch;
      DS_THR float* ab = acc + b * NW * NR;
      if (XQ) {
        const uint4 qa = ((const DS_DEV uint4*)xb)[2 * u], qb = ((const DS_DEV uint4*)xb)[2 * u + 1];
        const DS_DEV uint4* xr4 = (const DS_DEV uint4*)(xb + n_in / 4);  // the remainder words
        const uint4 ra = xr4[2 * u], rc = xr4[2 * u + 1];
        const float4 xd = ((const DS_DEV float4*)(xb + n_in / 2))[u];
        const uint32_t q[16] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w,
                                ra.x, ra.y, ra.z, ra.w, rc.x, rc.y, rc.z, rc.w};
        const float d[4] = {xd.x, xd.y, xd.z, xd.w};
#pragma unroll
        for (int r = 0; r < NW * NR; ++r) ab[r] += ds_reg_dot_q(QX, raw[r], q, d, tabs);
      } else {
        float x[32];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 t = ds_reg_x4<RMS>(xb + 32 * u, nw + 32 * u, (uint32_t)i, ssq[b]);
          x[4 * i] = t.x; x[4 * i + 1] = t.y; x[4 * i + 2] = t.z; x[4 * i + 3] = t.w;
        }
#pragma unroll
        for (int r = 0; r < NW * NR; ++r) ab[r] += ds_reg_dot_f(QX, raw[r], x);
      }
    }
  }
}
