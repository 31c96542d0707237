// ds_quant.h: block decoding shared by the quant kernels, after ds_prelude.h in their `header`; each
// kernel's own helpers follow in <kind>.h (mv.h, mm.h).
//
// The builder defines DS_IQ2_GRID_WORDS before this file: gguf-py's IQ2_XXS grid for IQ2_XXS launches, a
// single 0u (the table zero-filled) for every other type, whose code never reads the table. MLX hashes a
// kernel's whole source at each launch, so launches that do not need the 6.6 KB table do not carry it.

// GGML type ids (docs/quants.md §1.0).
#define DS_F32 0
#define DS_F16 1
#define DS_Q8_0 8
#define DS_Q2_K 10
#define DS_Q4_K 12
#define DS_IQ2_XXS 16
#define DS_BF16 30

// IQ2_XXS grid: 256 u64 words as (lo, hi) u32 pairs; byte j of word g = magnitude j of grid vector g.
DS_TABLE uint32_t ds_iq2_grid[512] = {DS_IQ2_GRID_WORDS};

// --- loads. IQ2_XXS and Q8_0 blocks are only 2-byte aligned: never read them as u32 (docs/quants.md §1.0) ----
DS_FN uint32_t ds_ld16(const DS_DEV uint8_t* p) { return (uint32_t)(*((const DS_DEV uint16_t*)p)); }
DS_FN uint32_t ds_ld32_a2(const DS_DEV uint8_t* p) { return ds_ld16(p) | (ds_ld16(p + 2) << 16); }
DS_FN uint32_t ds_ld32(const DS_DEV uint8_t* p) { return *((const DS_DEV uint32_t*)p); }  // 4-byte aligned only
DS_FN float ds_f16(const DS_DEV uint8_t* p) { return DS_F16_BITS(ds_ld16(p)); }
// The same from threadgroup memory (the matvec stages weight bytes there).
DS_FN uint32_t ds_tld16(const DS_TG uint8_t* p) { return (uint32_t)(*((const DS_TG uint16_t*)p)); }
DS_FN uint32_t ds_tld32_a2(const DS_TG uint8_t* p) { return ds_tld16(p) | (ds_tld16(p + 2) << 16); }
DS_FN uint32_t ds_tld32(const DS_TG uint8_t* p) { return *((const DS_TG uint32_t*)p); }
DS_FN float ds_tf16(const DS_TG uint8_t* p) { return DS_F16_BITS(ds_tld16(p)); }

// Small integers to f32 without an int→float conversion instruction (quarter rate on NVIDIA): 2^23 + v has
// v in its low mantissa bits, so one OR and one subtraction give v exactly (v < 2^23).
DS_FN float ds_u2f(uint32_t v) { return DS_U32_AS_F(0x4B000000u | v) - 8388608.0f; }
// Byte i (0..3) of w as f32, by the same trick (DS_BYTE_BITS puts the byte under the 2^23 exponent).
DS_FN float ds_byte_f(uint32_t w, uint32_t i) { return DS_U32_AS_F(DS_BYTE_BITS(w, i)) - 8388608.0f; }
// A raw int8 byte b (0..255) as its signed value: 2^23 + (b XOR 0x80) − (2^23 + 128).
DS_FN float ds_s8f(uint32_t b) { return DS_U32_AS_F(0x4B000000u | (b ^ 0x80u)) - 8388736.0f; }
// Int8 byte i of w, given wx = w XOR 0x80808080: one PRMT and one subtraction on CUDA.
DS_FN float ds_s8x_f(uint32_t wx, uint32_t i) { return DS_U32_AS_F(DS_BYTE_BITS(wx, i)) - 8388736.0f; }

// Q4_K 6-bit (scale, min) of sub-block j (docs/quants.md §1.3).
DS_FN void ds_q4k_scale_min(const DS_DEV uint8_t* s, uint32_t j, DS_THR float& sc, DS_THR float& m) {
  if (j < 4) {
    sc = float(s[j] & 63);
    m = float(s[j + 4] & 63);
  } else {
    sc = float((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    m = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// IQ2_XXS sign mask of sign index s: s | parity(s) << 7 (docs/quants.md §1.4).
DS_FN uint32_t ds_iq2_signs(uint32_t s) { return s | ((DS_POPC(s) & 1u) << 7); }

// c + the dot of a and b as four signed bytes each: one DP4A on CUDA (the quantized-x matvec, mv.h ds_dot8q).
DS_FN int ds_dp4a(uint32_t a, uint32_t b, int c) {
#if defined(DS_CUDA) && !defined(DS_SIM)
  return __dp4a((int)a, (int)b, c);
#else
#pragma unroll
  for (int i = 0; i < 32; i += 8) c += ((int)(a << (24 - i)) >> 24) * ((int)(b << (24 - i)) >> 24);
  return c;
#endif
}

// Quantized x (the matvecs' XQ; kernels.quantize_x writes it): a row of x holds q (int8 [in]), the remainder r
// (int8 [in]) and d (f32 [in/8]), x ≈ d·(q + r/128) per octet, d = max|x|/127: 1/32768 of max|x| at worst,
// against 1/254 with q alone (ds4-CUDA's Q8_K), which moves a tiny model's logits by ~7 %
// (docs/quants.md §8 ruling 4).
// Octet g of the row: q[0..1] its q words, q[2..3] its r words, d, and s = Σ x̂ (the Q2_K min term).
DS_FN void ds_xq_load(const DS_DEV float* xr, uint32_t n_in, uint32_t g, DS_THR uint32_t* q, DS_THR float& d,
                      DS_THR float& s) {
  const uint2 a = ((const DS_DEV uint2*)xr)[g], b = ((const DS_DEV uint2*)(xr + n_in / 4))[g];
  q[0] = a.x; q[1] = a.y; q[2] = b.x; q[3] = b.y;
  d = xr[n_in / 2 + g];
  const int sq = ds_dp4a(a.x, 0x01010101u, ds_dp4a(a.y, 0x01010101u, 0));
  const int sr = ds_dp4a(b.x, 0x01010101u, ds_dp4a(b.y, 0x01010101u, 0));
  s = d * ((float)sq + (float)sr * (1.0f / 128.0f));
}

// --- the 32-weight unit: unit u of a row is weights 32u .. 32u+31 -------------------------------------------
// Every supported type decodes in 32-weight units (one Q8_0 block, a Q4_K sub-block, an IQ2_XXS group,
// two Q2_K groups, 32 plain elements), so matvec lanes and matmul tiles step through K in units.
