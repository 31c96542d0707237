// rounding.h: ds4's storage rounding simulations (numerics.py) for the fused kernels that make cached rows
// (qkv_rows, index_q, comp_pool); appended after fused.h for those kernels only (fused.KernelSpec.header),
// so the others carry no extra source.

// Exact power-of-two helpers (numerics.py): 2^e from exponent bits, floor/ceil of log2 of a positive normal.
DS_FN float ds_pow2i(int e) { return DS_U32_AS_F((uint32_t)(e + 127) << 23); }
DS_FN int ds_exponent(float t) { return (int)((DS_F_AS_U32(t) >> 23) & 0xFFu) - 127; }
DS_FN int ds_ceil_log2(float t) { return ds_exponent(t) + ((DS_F_AS_U32(t) & 0x7FFFFFu) == 0u ? 0 : 1); }
// Nearest FP8-E4M3FN value of |v| <= 448, ties to the even code (numerics.fp8_e4m3_round).
DS_FN float ds_fp8_e4m3(float v) {
  const float a = DS_FABS(v);
  int e = ds_exponent(dsf_max(a, 0.015625f));
  e = e < -6 ? -6 : e;
  const float quantum = ds_pow2i(e - 3);
  const float r = DS_RINT(a / quantum) * quantum;
  return v < 0.0f ? -r : r;
}

// The FP8 KV round trip of a row held one element per thread (numerics.fp8_e4m3_round_trip): blocks of 64
// dims = two simdgroups, scale = 2^ceil(log2(max(amax, 1e-4) / 448)), v' = e4m3(clamp(v / scale)) * scale on
// the first `nope` dims (the rest pass). Every thread calls it (barriers); `part` holds one float per
// simdgroup and is free on entry (callers put a barrier after their own last read of it).
DS_FN float ds_fp8_row(float v, uint32_t j, uint32_t nope, uint32_t simd, uint32_t lane, DS_TG float* part) {
  const float m = dsf_simd_max(DS_FABS(v));
  if (lane == 0) part[simd] = m;
  DS_TG_BARRIER();
  if (j >= nope) return v;
  const float amax = dsf_max(dsf_max(part[simd & ~1u], part[simd | 1u]), 1.0e-4f);
  const float scale = ds_pow2i(ds_ceil_log2(amax / 448.0f));
  float s = v / scale;
  s = s > 448.0f ? 448.0f : (s < -448.0f ? -448.0f : s);
  return ds_fp8_e4m3(s) * scale;
}
// The indexer QAT of a 128-dim row held one element per thread of a 128-thread threadgroup
// (numerics.indexer_qat): the normalized Sylvester Hadamard transform, out[i] = sum_k (-1)^popcount(i & k)
// v[k] / sqrt(128), as 7 butterfly stages through h [2][128], then the FP4-E2M1 round trip in blocks of 32
// (one simdgroup): scale = 2^ceil(log2(max(amax, 7.05e-38) / 6)). Every thread calls it (barriers); h[128..]
// must be free on entry, h[..128] is written after the first barrier.
DS_FN float ds_qat_row(float v, uint32_t j, DS_TG float* h) {  // h: [2][128], flat
  uint32_t cur = 128u;
  h[128u + j] = v;
  DS_TG_BARRIER();
  for (uint32_t s = 1u; s < 128u; s <<= 1) {
    const float a = h[cur + j], b = h[cur + (j ^ s)];
    h[(cur ^ 128u) + j] = (j & s) ? b - a : a + b;
    cur ^= 128u;
    DS_TG_BARRIER();
  }
  v = h[cur + j] * 0.08838834764831845f;  // 1 / sqrt(128)
  const float amax = dsf_max(dsf_simd_max(DS_FABS(v)), 7.052966104933725e-38f);
  const float scale = ds_pow2i(ds_ceil_log2(amax / 6.0f));
  float s = v / scale;
  s = s > 6.0f ? 6.0f : (s < -6.0f ? -6.0f : s);
  const float a = DS_FABS(s);
  const float quantum = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float r = DS_RINT(a / quantum) * quantum;
  return (s < 0.0f ? -r : r) * scale;
}
