// fused.h: small helpers of the fused hyper-connection and compressor kernels (hc_pre, hc_post, comp_pool).
// Appended after ds_prelude.h by custom_kernels/fused.py; uses only the prelude's DS_* macros plus the
// two math wrappers below (guarded so a later prelude may define them instead).

#ifndef DS_SQRT
#if defined(DS_METAL)
#define DS_SQRT(x) sqrt(x)
#else
#define DS_SQRT(x) sqrtf(x)
#endif
#endif

#ifndef DS_SHFL_XOR
#error "fused.h needs DS_SHFL_XOR from ds_prelude.h"
#endif

DS_FN float dsf_max(float a, float b) { return a > b ? a : b; }
// ds4 evaluates the HC gates as 1/(1+expf(-z)) (MODEL.md §4.3).
DS_FN float dsf_sigmoid(float z) { return 1.0f / (1.0f + DS_EXP(-z)); }
