"""Do kernel inputs made from host data (params blocks, weights' views) slow the kernels that read them?"""
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
import ds4_mlx.kernels as K
from ds4_mlx.kernels import fused as F
from ds4_mlx.random_model import random_quant_weight
from ds4_mlx.weights import _kernels, kernel_backend

R, W = 128, 512
host = lambda a: mx.array(np.array(a))  # noqa: E731
fr = mx.random.normal((2, R, W)); kv = mx.random.normal((1, W)); sc = mx.random.normal((1, W))
at = F.resident(mx.array([5], dtype=mx.int32)); ape_dev = mx.random.normal((1, W)); mx.eval(fr, kv, sc, ape_dev, at)
ape_host = host(ape_dev); mx.eval(ape_host)
orig_p, orig_f = F._params, F._f32
res_p = lambda *v: F.resident(orig_p(*v))  # noqa: E731
def mark(tag):
    k = mx.fast.cuda_kernel(name="mark_" + tag, input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    mx.eval(k(inputs=[mx.ones((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
for tag, p, ape in (("host_params_host_ape", orig_p, ape_host), ("dev_params_host_ape", res_p, ape_host),
                    ("host_params_dev_ape", orig_p, ape_dev), ("dev_params_dev_ape", res_p, ape_dev)):
    F._params = p
    mark(tag)
    for i in range(5):
        fr = F.compressor_write(fr, kv, sc, ape, at); mx.eval(fr)
F._params = orig_p
Kk, backend = _kernels(), kernel_backend()
for label, qt, shape in (("q_b", QT.Q8_0, (32768, 1024)), ("out_b", QT.Q8_0, (4096, 8192))):
    w = random_quant_weight(qt, shape, 0.02); x = mx.random.normal((1, shape[1])); mx.eval(w.data, x)
    for tag, p in (("host", orig_p), ("dev", res_p)):
        Kk._params = p
        mark(label + "_" + tag)
        for i in range(5):
            mx.eval(Kk.mv(w, x, backend))
    Kk._params = orig_p
print("done", flush=True)
