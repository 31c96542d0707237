"""``QuantWeight``: one GGUF matrix (any ds4 type) kept as its raw bytes, with matmul and expert-gathered matmul.

The bytes are never requantized. ``matmul`` / ``gather_matmul`` run on one of three backends:
custom Metal kernels (Apple GPU), custom CUDA kernels (NVIDIA), or the pure-MLX fallback of
:mod:`ds4_mlx.quants` (dequantize + ``mx.matmul``; the CPU path and the tests' oracle).
The backend is chosen at call time (:func:`ds4_mlx.backend.kernel_backend`: ``DS4_MLX_KERNELS`` or
:func:`set_kernel_backend` override the automatic choice).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from ds4_mlx import host, quants
from ds4_mlx.backend import kernel_backend, set_kernel_backend  # noqa: F401 (set_kernel_backend: public here too)

EVAL_LOCK = host.EVAL_LOCK  # see ds4_mlx.host

# Largest f32 weight slab (elements) the fallback dequantizes at once: 2**26 floats = 256 MiB.
FALLBACK_MAX_ELEMS = 1 << 26
# The numpy path (ds4_mlx.host) keeps a weight's f32 form after first use up to this size (2**24 floats =
# 64 MiB): every weight of the demo model, none of the real model's big ones.
HOST_CACHE_ELEMS = 1 << 24


@functools.cache
def _kernels():
    """``custom_kernels/`` as ``ds4_mlx.kernels`` (imported lazily: the CPU path never needs it)."""
    from ds4_mlx import kernels

    return kernels


class QuantWeight:
    """A GGUF weight of shape ``(out, in)`` or ``(E, out, in)`` stored as the file stores it.

    Block types (Q8_0, Q2_K, Q4_K, IQ2_XXS) hold ``data`` as uint8 ``(*shape[:-1], row_bytes)``;
    plain types hold float32 / float16 / bfloat16 arrays of ``shape``.
    """

    def __init__(self, data: mx.array, qtype: QT, shape: Sequence[int]):
        self.qtype = QT(qtype)
        self.shape = tuple(int(s) for s in shape)
        self.data = data
        self._cache: dict = {}  # backend-specific derived forms (e.g. a lossless affine repack)
        if self.qtype not in quants.SUPPORTED_TYPES:
            raise NotImplementedError(f"QuantWeight: unsupported type {self.qtype.name}")
        if len(self.shape) not in (2, 3):
            raise ValueError(f"QuantWeight: expected a 2-D or 3-D shape, got {self.shape}")
        want = self.storage_shape(self.qtype, self.shape)
        if tuple(data.shape) != want:
            raise ValueError(f"QuantWeight {self.qtype.name}{self.shape}: storage {data.shape}, expected {want}")

    @staticmethod
    def storage_shape(qtype: QT, shape: Sequence[int]) -> tuple[int, ...]:
        if QT(qtype) in quants.PLAIN_TYPES:
            return tuple(shape)
        return (*shape[:-1], quants.row_bytes(qtype, shape[-1]))

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: QT, shape: Sequence[int]) -> "QuantWeight":
        """Wrap a tensor as ``gguf.GGUFReader`` gives it (uint8 rows for block types, element arrays otherwise)."""
        qtype, shape = QT(qtype), tuple(int(s) for s in shape)
        a = np.ascontiguousarray(data)
        if qtype == QT.F32:
            arr = mx.array(a.view(np.float32).reshape(shape))
        elif qtype == QT.F16:
            arr = mx.array(a.view(np.float16).reshape(shape))
        elif qtype == QT.BF16:  # numpy has no bfloat16: carry the bits as uint16
            arr = mx.array(a.view(np.uint16).reshape(shape)).view(mx.bfloat16)
        else:
            arr = mx.array(a.view(np.uint8).reshape(cls.storage_shape(qtype, shape)))
        return cls(arr, qtype, shape)

    @classmethod
    def stack_rows(cls, weights: Sequence["QuantWeight"]) -> "QuantWeight":
        """One 2-D weight holding the rows of ``weights`` in order (same type and input width).

        Rows of a GGUF matrix are independent (each is its own run of blocks), so the stacked weight has the
        same values, still in their file encoding. Projections that share an input then run as one matvec,
        one launch instead of several in the host-bound decode step.
        """
        first = weights[0]
        for w in weights:
            if len(w.shape) != 2 or w.qtype != first.qtype or w.in_features != first.in_features:
                raise ValueError(f"stack_rows: {w!r} does not stack with {first!r}")
        out = sum(w.out_features for w in weights)
        data = mx.concatenate([w.data for w in weights])
        mx.eval(data)  # materialized now: a compiled step must see a weight, not a concatenation to redo
        return cls(data, first.qtype, (out, first.in_features))

    def split_rows(self, sizes: Sequence[int]) -> list["QuantWeight"]:
        """The inverse of :meth:`stack_rows`: consecutive parts of ``sizes`` rows, each a view of this weight's
        rows (no copy), so the parts and the whole can serve different call sites."""
        if len(self.shape) != 2 or sum(sizes) != self.out_features:
            raise ValueError(f"split_rows: {list(sizes)} rows do not split {self!r}")
        starts = np.cumsum([0, *sizes])
        parts = [QuantWeight(self.data[a:b], self.qtype, (b - a, self.in_features)) for a, b in zip(starts, starts[1:])]
        mx.eval([w.data for w in parts])
        return parts

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """The form of this weight that ``make()`` returns (arrays, evaluated here), made once and kept under
        ``key``. Made under :data:`EVAL_LOCK`: a first use may come while a worker evaluates decode steps."""
        got = self._cache.get(key)
        if got is None:
            with EVAL_LOCK:
                got = make()
                mx.eval(got)
            self._cache[key] = got
        return got

    def forget_derived(self) -> None:
        """Drop every form made from ``data`` (:meth:`derived`, the kept float32 values): ``data`` changed."""
        self._cache.clear()

    # --- properties -------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype.name}, shape={self.shape})"

    # --- dequantization ---------------------------------------------------------------------------------

    def dequantize(self) -> mx.array:
        """float32 of ``shape``, exactly the GGUF values."""
        return quants.dequantize(self.data, self.qtype)

    def _values(self) -> mx.array:
        """The float32 values: the kept ones, else decoded now."""
        kept = self._cache.get("f32")
        return self.dequantize() if kept is None else kept

    def keep_dequantized(self) -> None:
        """Keep the float32 values from now on, so that the pure-MLX paths stop decoding the blocks at every call
        (the model decides when that is worth the memory: :meth:`ds4_mlx.model.model.Model.keep_dequantized`)."""
        if "f32" not in self._cache:
            self._cache["f32"] = self.dequantize()
            mx.eval(self._cache["f32"])

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` of a 2-D weight as float32 ``[*ids.shape, in]`` (the embedding lookup)."""
        if len(self.shape) != 2:
            raise ValueError("rows() needs a 2-D weight")
        return quants.dequantize(self.data[ids], self.qtype)

    # --- products ---------------------------------------------------------------------------------------

    def matmul(self, x, scaled_out: bool = False):
        """``y = x @ W.T``: x ``[..., in]`` → float32 ``[..., out]`` for a 2-D weight; or one token's columns of a
        wider row (:class:`ds4_mlx.kernels.Cols`), which the GPU backends read in place. ``x`` may be a
        :class:`ds4_mlx.kernels.Scaled16`; with ``scaled_out`` the result may be one (where the dense prefill
        product ran, :func:`ds4_mlx.kernels.matmul`)."""
        if len(self.shape) != 2:
            raise ValueError(f"matmul needs a 2-D weight, this one is {self.shape}")
        if isinstance(x, mx.array) and x.shape[-1] != self.in_features:
            raise ValueError(f"matmul: x has {x.shape[-1]} features, weight expects {self.in_features}")
        backend = kernel_backend()
        if backend != "fallback":
            return _kernels().matmul(self, x, backend, scaled_out)  # takes Cols and Scaled16 too
        if not isinstance(x, mx.array):  # Cols or Scaled16, made where the kernels were imported
            x = x.values() if isinstance(x, _kernels().Scaled16) else _kernels().cols(x, self.in_features)
        return self._fallback_matmul(x)

    def matmul_rms(self, x, norm: mx.array, eps: float, scaled_out: bool = False):
        """``rms_norm(x, norm, eps) @ W.T``: on the GPU backends the norm is the matvec's prologue (one launch).
        ``x [..., in]``, or one token's columns of a wider row (:class:`ds4_mlx.kernels.Cols`); ``scaled_out``
        as in :meth:`matmul`."""
        backend = kernel_backend()
        on_kernels = backend != "fallback" and len(self.shape) == 2
        if not isinstance(x, mx.array) and not on_kernels:  # Cols (made by decode, which imported the kernels)
            x = _kernels().cols(x, self.in_features)
        if on_kernels and (not isinstance(x, mx.array) or x.shape[-1] == self.in_features):
            return _kernels().matmul_rms(self, x, norm, eps, backend, scaled_out)  # takes Cols too
        return self.matmul(mx.fast.rms_norm(x, norm, eps), scaled_out)

    def gather_matmul(self, x: mx.array, ids: mx.array, out_shape: tuple[int, ...] | None = None) -> mx.array:
        """Expert-gathered product for a 3-D ``(E, out, in)`` weight.

        ``x``: ``[N, in]`` (one input shared by all k slots) or ``[N, k, in]`` (one input per slot; any shape of
        that size, in that order); ``ids``: int32 ``[N, k]`` expert ids. Returns float32 ``[N, k, out]`` (or
        ``out_shape``, same size) with ``y[n, s] = W[ids[n, s]] @ x[n(, s)]``. Experts that are not selected
        are never read. The decode kernels read x and write y flat, so the shapes cost no reshape nodes.
        """
        if len(self.shape) != 3:
            raise ValueError(f"gather_matmul needs a 3-D (E, out, in) weight, this one is {self.shape}")
        if ids.ndim != 2:
            raise ValueError(f"gather_matmul: ids must be [N, k], got {ids.shape}")
        N, k = ids.shape
        n_in, n_out = self.in_features, self.out_features
        if x.shape != (N, n_in) and x.size != N * k * n_in:
            raise ValueError(f"gather_matmul: x {x.shape} does not fit ids {ids.shape} and in={n_in}")
        if out_shape is not None and int(np.prod(out_shape)) != N * k * n_out:
            raise ValueError(f"gather_matmul: out_shape {out_shape} does not hold [{N}, {k}, {n_out}]")
        backend = kernel_backend()
        if backend != "fallback":
            return _kernels().gather_matmul(self, x, ids, backend, out_shape)
        return self._fallback_gather_matmul(x, ids, out_shape)

    def batched_matmul(self, x, scaled_out: bool = False):
        """``x [G, T, in]`` times each matrix of a 3-D ``(G, out, in)`` weight: ``[G, T, out]``, ``y[g] = x[g] @ W[g].T``.

        MLX's batched matmul: for prefill chunks, where a grouped product has many tokens per matrix (the
        attention's grouped output projection). On the GPU backends the weight is decoded to f16 by a kernel and the
        product runs as the dense prefill products do (``f16_product``); elsewhere in f32. ``x`` may be a
        :class:`ds4_mlx.kernels.Scaled16`; with ``scaled_out`` the result is one where the f16 product ran."""
        xa = x if isinstance(x, mx.array) else x.a
        if len(self.shape) != 3 or xa.ndim != 3 or xa.shape[0] != self.shape[0] or xa.shape[2] != self.in_features:
            raise ValueError(f"batched_matmul: x {xa.shape} does not fit {self!r}")
        backend = kernel_backend()
        if backend != "fallback" and _kernels().supports(self):
            w16_t = _kernels().dequantize(self, backend, f16=True).swapaxes(1, 2)
            return _kernels().f16_product(x, w16_t, scaled_out)
        x = x if isinstance(x, mx.array) else x.values()
        if host.wanted(x.shape[1]):
            xn = host.to_numpy(x)[0]
            return mx.array(np.stack([xn[g] @ self.host_f32(g, g + 1)[0].T for g in range(x.shape[0])]))
        return x.astype(mx.float32) @ self._values().swapaxes(1, 2)

    # --- pure-MLX fallback, numpy for chunks on the CPU (ds4_mlx.host) ------------------------------------

    def host_f32(self, i0: int = 0, i1: int | None = None) -> np.ndarray:
        """Rows ``i0:i1`` along the first axis (matrices, for a 3-D weight) as a float32 numpy array, exactly the
        GGUF values. The whole weight is kept after first use when it has at most HOST_CACHE_ELEMS values."""
        whole = self._cache.get("host_f32")
        if whole is None and int(np.prod(self.shape)) <= HOST_CACHE_ELEMS:
            whole = self._cache["host_f32"] = host.to_numpy(self._values())[0]
        if whole is not None:
            return whole[i0:i1]
        return host.to_numpy(quants.dequantize(self.data[i0:i1], self.qtype))[0]

    def _fallback_matmul(self, x: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        out, n_in = self.shape
        step = max(1, FALLBACK_MAX_ELEMS // n_in)  # dequantize at most ~256 MiB of rows at a time
        if host.wanted(x.size // n_in):
            xn = host.to_numpy(x)[0].reshape(-1, n_in)
            y = np.concatenate([xn @ self.host_f32(r0, r0 + step).T for r0 in range(0, out, step)], axis=1)
            return mx.array(y).reshape(*x.shape[:-1], out)
        if "f32" in self._cache:
            return x @ self._cache["f32"].T
        parts = []
        for r0 in range(0, out, step):
            w = quants.dequantize(self.data[r0 : r0 + step], self.qtype)  # (rows, in) f32
            parts.append(x @ w.T)  # [..., rows]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _fallback_gather_matmul(self, x: mx.array, ids: mx.array, out_shape: tuple[int, ...] | None = None) -> mx.array:
        """:meth:`gather_matmul` in MLX ops (same x and ``out_shape`` conventions, no checks)."""
        E, out, n_in = self.shape
        N, k = ids.shape
        P = N * k
        out_shape = (N, k, out) if out_shape is None else out_shape
        x = x.astype(mx.float32)
        xp = mx.broadcast_to(x[:, None, :], (N, k, n_in)) if x.shape == (N, n_in) else x
        xp = xp.reshape(P, 1, n_in)  # one row per (token, slot) pair
        flat = ids.reshape(P).astype(mx.int32)

        if host.wanted(N):
            return mx.array(self.host_gather_matmul(*host.to_numpy(xp.reshape(P, n_in), ids))).reshape(out_shape)
        kept = self._cache.get("f32")

        def experts(picked: mx.array) -> mx.array:  # (len(picked), out, in) f32
            return kept[picked] if kept is not None else quants.dequantize(self.data[picked], self.qtype)

        if N == 1:  # a decode step (compiled: no host reads): the pairs' experts
            return (xp @ experts(flat).swapaxes(1, 2)).reshape(out_shape)
        # Each distinct expert dequantized once, each pair's product against its own.
        groups = expert_groups(np.array(flat), E)
        used = mx.array(np.array([e for e, _ in groups], np.int32))
        per_chunk = max(1, FALLBACK_MAX_ELEMS // (out * n_in))
        if len(groups) <= per_chunk:
            local = np.empty(P, np.int32)
            for j, (_, pairs) in enumerate(groups):
                local[pairs] = j
            return mx.gather_mm(xp, experts(used).swapaxes(1, 2), rhs_indices=mx.array(local)).reshape(out_shape)

        # Many experts: in memory-bounded chunks of experts, pairs grouped by expert.
        parts = []
        for c0 in range(0, len(groups), per_chunk):
            chunk = groups[c0 : c0 + per_chunk]
            sel = np.concatenate([pairs for _, pairs in chunk]).astype(np.int32)
            local = np.repeat(np.arange(len(chunk), dtype=np.int32), [len(pairs) for _, pairs in chunk])
            w = experts(used[c0 : c0 + per_chunk])  # (c, out, in)
            y = mx.gather_mm(xp[mx.array(sel)], w.swapaxes(1, 2), rhs_indices=mx.array(local))
            parts.append(y.reshape(-1, out))
            mx.eval(parts[-1])  # bound peak memory to one chunk
        order = np.concatenate([pairs for _, pairs in groups])
        inv = np.empty(P, dtype=np.int32)
        inv[order] = np.arange(P, dtype=np.int32)
        return mx.concatenate(parts, axis=0)[mx.array(inv)].reshape(out_shape)

    def host_gather_matmul(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """:meth:`gather_matmul` in numpy for ``x [P, in]`` (one row per pair) and ``ids`` (``P`` expert ids, any
        shape) -> ``[P, out]``: the pairs grouped by expert, one product per expert."""
        ids = ids.reshape(-1)
        y = np.empty((ids.size, self.out_features), np.float32)
        for e, pairs in expert_groups(ids, self.shape[0]):
            y[pairs] = x[pairs] @ self.host_f32(e, e + 1)[0].T
        return y


def cut_storage(data: Any, qtype: QT, shape: Sequence[int], axis: int, part: range) -> tuple[Any, tuple[int, ...]]:
    """A tensor's stored ``data`` (numpy or MLX, as :class:`QuantWeight` stores it, or a 1-D array) cut to the
    elements ``part`` along ``axis`` -> ``(data, shape)``. Along the rows the cut is a view; across a block type's
    columns it cuts whole blocks out of each row (ValueError where ``part`` does not fall on block edges)."""
    qtype, shape = QT(qtype), list(shape)
    lo, hi = part.start, part.stop
    if axis == len(shape) - 1 and qtype in quants.BLOCK_TYPES:
        bs = quants.block_size(qtype)
        if lo % bs or hi % bs:
            raise ValueError(f"{qtype.name}: columns {lo}..{hi} do not fall on its {bs}-weight blocks")
        lo, hi = quants.row_bytes(qtype, lo), quants.row_bytes(qtype, hi)
    shape[axis] = len(part)
    return data[(slice(None),) * axis + (slice(lo, hi),)], tuple(shape)


def expert_groups(ids: np.ndarray, n_expert: int) -> list[tuple[int, np.ndarray]]:
    """``(expert, indices of the ids that name it)`` for each expert in the flat ``ids``, in expert order."""
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise IndexError(f"gather_matmul: expert id out of range [0, {n_expert})")
    order = np.argsort(ids, kind="stable")
    experts, starts = np.unique(ids[order], return_index=True)
    return [(int(e), pairs) for e, pairs in zip(experts, np.split(order, starts[1:]))]
