"""Why does comp_write take 19 µs for a 512 KB frontier? Run under ncu (gpu__time_duration)."""
import mlx.core as mx
from ds4_mlx.kernels.fused import compressor_write, resident
R, W = 128, 512
fr = mx.random.normal((2, R, W)); mx.eval(fr)
kv = mx.random.normal((1, W)); sc = mx.random.normal((1, W)); ape = mx.random.normal((1, W))
at = resident(mx.array([5], dtype=mx.int32)); mx.eval(kv, sc, ape, at)
try:
    print("dlpack device fr", fr.__dlpack_device__(), flush=True)
except Exception as e:
    print("dlpack", e)
for i in range(5):
    fr = compressor_write(fr, kv, sc, ape, at); mx.eval(fr)
print("dlpack device after", fr.__dlpack_device__() if hasattr(fr, "__dlpack_device__") else None, flush=True)
g = fr
for i in range(5):
    g = g * 1.0001; mx.eval(g)
copy4 = mx.fast.cuda_kernel(name="probe_copy4", input_names=["x"], output_names=["y"], source="""
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 32768u) reinterpret_cast<float4*>(y)[i] = reinterpret_cast<const float4*>(x)[i];""")
h = fr
for i in range(5):
    h = copy4(inputs=[h], grid=(2 * R * W // 4, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(2, R, W)],
              output_dtypes=[mx.float32])[0]; mx.eval(h)
copy1 = mx.fast.cuda_kernel(name="probe_copy1", input_names=["x"], output_names=["y"], source="""
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 131072u) y[i] = x[i];""")
for i in range(5):
    h = copy1(inputs=[h], grid=(2 * R * W, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(2, R, W)],
              output_dtypes=[mx.float32])[0]; mx.eval(h)
print("ok", float(h.sum()), float(g.sum()), flush=True)
