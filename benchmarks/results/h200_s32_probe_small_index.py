"""comp_write's erratic 7-28 µs: is it its int32[1] `at` (an allocation under 8 bytes: MLX-CUDA's small pool)?"""
import mlx.core as mx
import numpy as np
from ds4_mlx.kernels import fused as F

R, W = 128, 512
fr = mx.random.normal((2, R, W)); kv = mx.random.normal((1, W)); sc = mx.random.normal((1, W)); ape = mx.random.normal((1, W))
mx.eval(fr, kv, sc, ape)
k = F.get_fused_kernel("comp_write", "cuda")
params = F.resident(F._params(R, W, 0, 0))
def mark(tag):
    m = mx.fast.cuda_kernel(name="mark_" + tag, input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    mx.eval(m(inputs=[mx.ones((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
variants = {
    "at1_resident": F.resident(mx.array([5], dtype=mx.int32)),
    "at8_resident": F.resident(mx.array([5] + [0] * 7, dtype=mx.int32)),
    "at2_resident": F.resident(mx.array([5, 0], dtype=mx.int32)),
    "at1_host": mx.array([5], dtype=mx.int32),
    "at8_host": mx.array([5] + [0] * 7, dtype=mx.int32),
}
mx.eval(list(variants.values()))
for rnd in range(2):
    for tag, at in variants.items():
        mark(f"{tag}_{rnd}")
        for i in range(6):
            fr = k(inputs=[fr, kv, sc, ape, at, params], grid=(R * W, 1, 1), threadgroup=(256, 1, 1),
                   output_shapes=[(2, R, W)], output_dtypes=[mx.float32])[0]
            mx.eval(fr)
print("done", flush=True)
