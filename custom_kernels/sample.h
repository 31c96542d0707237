// sample.h: helpers of sample.body, after fused.h.

// NaN / finite by the bits: Metal compiles with fast math, where x != x may fold away.
DS_FN bool ds_is_nan(float x) { return (DS_F_AS_U32(x) & 0x7fffffffu) > 0x7f800000u; }
DS_FN bool ds_is_finite(float x) { return (DS_F_AS_U32(x) & 0x7f800000u) != 0x7f800000u; }
// A logit's sampling weight: exp((x - m) / T) if x is finite, 0 below min_p.
DS_FN float ds_sample_w(float x, float m, float T, float min_p) {
  const float w = ds_is_finite(x) ? DS_EXP((x - m) / T) : 0.0f;
  return w >= min_p ? w : 0.0f;
}
