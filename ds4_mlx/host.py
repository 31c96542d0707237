"""numpy for the big products of a prefill chunk on the CPU backend.

MLX's CPU backend in the Linux wheels multiplies f32 matrices without a tuned BLAS: a ``[2048, 256] @ [256, 512]``
product takes ~200 ms there against ~7 ms in numpy on the same two cores (and elementwise ops are ~5x slower).
On the CPU the graph's prefill products therefore run in numpy (:func:`wanted` says when); everything else, and
every GPU path, stays in MLX. The numpy path evaluates its inputs where it is called, which is why it is used only
for chunks (never inside a compiled decode step) and why it takes :data:`EVAL_LOCK` like every other evaluation
that may run beside a decode worker.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

#: Held by every evaluation of the package's that may run while a decode step is being built on another thread:
#: the :class:`~ds4_mlx.session.StepEncoder`'s worker holds it to queue a step,
#: :meth:`~ds4_mlx.weights.QuantWeight.derived` to make a weight's derived form on first use, this module to
#: read its inputs. MLX's encoders are not thread-safe: two evaluating at once crashed MLX-CUDA (double free).
EVAL_LOCK = threading.Lock()

#: Tokens from which a chunk's products run in numpy. A decode step (one token) stays one lazy MLX graph: it is
#: compiled, and a compiled function cannot evaluate. Short chunks stay in MLX too, in decode's summation order:
#: under the ``ds4`` profile another order can flip an FP8 row rounding (a short prompt all in numpy moved the tiny
#: model's logits by up to 1.8e-3 from the decode steps', 0 in MLX).
MIN_TOKENS = 64


def wanted(tokens: int) -> bool:
    """Whether a product over a chunk of ``tokens`` tokens runs in numpy: on the CPU, for chunks."""
    return tokens >= MIN_TOKENS and mx.default_device() == mx.cpu


def to_numpy(*arrays: mx.array) -> list[np.ndarray]:
    """The arrays as numpy arrays, floats as float32 (evaluated together under :data:`EVAL_LOCK`)."""
    arrays = [a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a for a in arrays]  # no bf16 in numpy
    with EVAL_LOCK:
        mx.eval(*arrays)
    return [np.asarray(a) for a in arrays]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function without overflow warnings for large negative x."""
    return 0.5 * (np.tanh(0.5 * x) + 1.0)
