// fused.h: small helpers of the fused hyper-connection and compressor kernels (hc_pre, hc_post, comp_pool).
// Appended after ds_prelude.h by custom_kernels/fused.py; uses only the prelude's DS_* macros.

#ifndef DS_SHFL_XOR
#error "fused.h needs DS_SHFL_XOR from ds_prelude.h"
#endif

DS_FN float dsf_max(float a, float b) { return a > b ? a : b; }
// ds4 evaluates the HC gates as 1/(1+expf(-z)) (docs/model.md §4.3).
DS_FN float dsf_sigmoid(float z) { return 1.0f / (1.0f + DS_EXP(-z)); }
DS_FN int min_i32(int a, int b) { return a < b ? a : b; }
// An f32 score as a u32 key with the same order (larger score, larger key); -0 counts as +0, as == does.
DS_FN uint32_t ds_score_key(float x) {
  const uint32_t u = DS_F_AS_U32(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

DS_FN float dsf_simd_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = dsf_max(v, DS_SHFL_XOR(v, m));
  return v;
}
// log1p(u) for u >= 0: log1pf on CUDA; Metal has no log1p, so the classic correction (Goldberg) keeps it
// accurate to a few ulps where 1 + u rounds.
#if defined(DS_METAL)
DS_FN float ds_log1p(float u) {
  const float w = 1.0f + u;
  return w == 1.0f ? u : metal::log(w) * (u / (w - 1.0f));
}
#else
DS_FN float ds_log1p(float u) { return log1pf(u); }
#endif
// ds4's router activation sqrt(softplus(x)), softplus(x) = x above 20, exp(x) below -20 (moe.sqrt_softplus).
DS_FN float ds_sqrt_softplus(float x) {
  const float sp = x > 20.0f ? x : (x < -20.0f ? DS_EXP(x) : ds_log1p(DS_EXP(x)));
  return DS_SQRT(sp);
}
// (value, index) arg-max step: the larger value, ties to the lower index.
DS_FN bool ds_beats(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }
// (value, index) arg-max across a simdgroup: every lane ends with the winner.
DS_FN void ds_simd_argmax(DS_THR float& v, DS_THR int& i) {
  for (int m = 16; m > 0; m >>= 1) {
    const float ov = DS_SHFL_XOR(v, m);
    const int oi = DS_SHFL_XOR(i, m);
    if (ds_beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}
