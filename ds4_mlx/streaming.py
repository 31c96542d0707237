"""Expert streaming: the routed experts stay in the GGUF file and are read on demand into a device-resident cache
whose size in bytes is fixed at start and never exceeded.

A routed expert of one layer (its gate, up and down matrices, ~7 MB at V4 Flash's width in q2) is the cache's
unit. The cache holds three pools, ``[slots, out, row_bytes]`` each (every MoE layer has the same expert shapes
and types), allocated once: their size is the cap. A MoE call asks for the experts its tokens chose
(:meth:`ExpertCache.fetch`); the ones not resident are read from the file by a pool of reader threads
(``os.pread``: a file cut short is an error, not a crash) into the slots of the least used experts (decayed use,
the experts of the last decode steps kept: :data:`DEFAULT_HALF_LIFE`), and the call runs the same kernels as the
resident model on the pools, with its expert ids mapped to slots. Each pair's product reads the same bytes in the
same order, so the results equal the resident model's.

The host has to know the chosen experts before it reads them, so a streamed MoE waits for its router: a decode
step runs each layer up to its router as one compiled function, then the experts once they are resident, and
reads do not overlap the device's work. A chunk whose tokens choose more experts than the cache holds runs in parts
that fit (:meth:`ExpertCache.spans`, :meth:`ExpertCache.groups`); a decode-sized call cut into parts runs each part
as the whole call, so its launches keep the resident model's shapes.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from .weights import QuantWeight

#: The three matrices of a routed expert, in the order the pools and :meth:`ExpertCache.fetch` use.
EXPERT_KINDS = ("gate", "up", "down")
_ROUTED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


#: Decode steps after which a use of an expert counts half when the cache picks what to evict (ExpertCache). On
#: synthetic traffic (benchmarks/RESULTS.md, Expert streaming) decayed use with the last steps' experts kept hits
#: as often as least-recently-used where routing is uniform and more often where it is skewed; 256 steps did a
#: little better than 64.
DEFAULT_HALF_LIFE = 256.0
#: Rounds of calls (decode steps) whose experts are evicted last, whatever their score: tokens repeat the experts
#: of the tokens just before them, which a score built over hundreds of steps would not protect.
PROTECTED_ROUNDS = 2
#: The first field of an expert use profile (``--ssd-streaming-profile``).
PROFILE_FORMAT = "ds4-mlx expert uses 1"
#: Fetches between two writes of the use profile (about 95 decode steps at 43 layers).
PROFILE_EVERY = 4096


def is_routed_expert(name: str) -> bool:
    """Whether GGUF tensor ``name`` holds a layer's routed experts."""
    return _ROUTED.fullmatch(name) is not None


@dataclass(frozen=True)
class StreamedTensor:
    """A routed-expert tensor ``[n_expert, out, in]`` left in the file: its type, shape and where its bytes are.
    Holds no memory (``nbytes`` 0); :class:`ExpertCache` reads one expert's matrix at a time."""

    name: str
    qtype: QT
    shape: tuple[int, int, int]
    path: Path
    offset: int  # of expert 0's first byte in the file

    nbytes = 0

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """One expert's bytes as :class:`QuantWeight` stores them."""
        return QuantWeight.storage_shape(self.qtype, self.shape[1:])

    @property
    def expert_bytes(self) -> int:
        """One expert's matrix in the file."""
        return math.prod(self.storage_shape) * np.dtype(storage_dtypes(self.qtype)[0]).itemsize


def storage_dtypes(qtype: QT) -> tuple[type, mx.Dtype]:
    """How a matrix of ``qtype`` is stored: (numpy dtype of the file's bytes, MLX dtype); block types as uint8."""
    plain = {QT.F32: (np.float32, mx.float32), QT.F16: (np.float16, mx.float16), QT.BF16: (np.uint16, mx.bfloat16)}
    return plain.get(qtype, (np.uint8, mx.uint8))


def expert_unit_bytes(tensors: dict) -> int:
    """Bytes of one expert (gate, up and down of one layer) from a GGUF's bound tensors (``TensorInfo``)."""
    return sum(tensors[f"blk.0.ffn_{k}_exps.weight"].nbytes // tensors[f"blk.0.ffn_{k}_exps.weight"].shape[0]
               for k in EXPERT_KINDS)  # fmt: skip


def check_cache_size(slots: int, need: int, unit_bytes: int) -> None:
    """ValueError when a cache of ``slots`` experts cannot hold the ``need`` experts of one token."""
    if slots < need:
        least = need * unit_bytes
        size = f"{least / 2**30:.2f} GB" if least >= 2**30 else f"{least / 2**20:.1f} MB"
        raise ValueError(f"the expert cache holds {slots} experts of {unit_bytes / 2**20:.1f} MiB; one token needs "
                         f"{need} at once: give at least {need} (or {size})")


def parse_cache_size(text: str, unit_bytes: int, n_units: int) -> int:
    """The cache's size in bytes from ``N`` (experts, an expert being one layer's gate, up and down), ``N%`` (of
    all routed experts) or ``NGB``; ValueError with the accepted forms otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|GB|G|GIB)?\s*", text.upper())
    if not m:
        raise ValueError(f"expert cache size {text!r}: expected a number of experts (e.g. 2048), a share (e.g. 50%) "
                         f"or a size (e.g. 40GB)")  # fmt: skip
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"expert cache size {text!r}: a share must be in (0, 100]%")
        return int(n_units * value / 100) * unit_bytes
    if unit:
        return int(value * (1 << 30))
    if value != int(value):
        raise ValueError(f"expert cache size {text!r}: a number of experts must be whole")
    return int(value) * unit_bytes


class ExpertCache:
    """The routed experts of every layer, streamed from the file into ``cap_bytes`` of device memory.

    Args:
        experts: ``{layer: (gate, up, down)}`` :class:`StreamedTensor` triples (same types and shapes in every layer).
        cap_bytes: the pools' size; it holds ``cap_bytes // unit_bytes`` experts and must hold ``min_slots``.
        min_slots: experts one call must be able to hold at once (a token's ``k``).
        readers: threads that read experts from the file.
        half_life: decode steps after which a use counts half in the eviction order (0: least recently used).
        profile: a JSON file of every expert's uses (:func:`read_profile`): read here, and written back with this
            run's uses added every :data:`PROFILE_EVERY` fetches, at :meth:`close` and at the interpreter's exit,
            so that a later start can :meth:`preload` the experts its traffic uses most.
    """

    @classmethod
    def from_weights(cls, weights: dict, size: str, *, min_slots: int = 1,
                     profile: str | os.PathLike | None = None) -> ExpertCache:  # fmt: skip
        """The cache of the :class:`StreamedTensor` values in ``weights``, sized by ``size``
        (:func:`parse_cache_size`)."""
        layers: dict[int, dict[str, StreamedTensor]] = {}
        for name, w in weights.items():
            m = _ROUTED.fullmatch(name)
            if m and isinstance(w, StreamedTensor):
                layers.setdefault(int(m.group(1)), {})[m.group(2)] = w
        experts = {il: tuple(d[k] for k in EXPERT_KINDS) for il, d in sorted(layers.items())}
        if not experts:
            raise ValueError("expert streaming: the model has no routed experts to stream")
        first = next(iter(experts.values()))
        unit = sum(t.expert_bytes for t in first)
        return cls(experts, parse_cache_size(size, unit, len(experts) * first[0].shape[0]), min_slots=min_slots,
                   profile=profile)

    def __init__(self, experts: dict[int, tuple[StreamedTensor, ...]], cap_bytes: int, *, min_slots: int = 1,
                 readers: int = 8, half_life: float = DEFAULT_HALF_LIFE,
                 profile: str | os.PathLike | None = None):  # fmt: skip
        if not experts:
            raise ValueError("expert streaming: the model has no routed experts to stream")
        self.experts = experts
        first = next(iter(experts.values()))
        for il, trio in experts.items():
            if [(t.qtype, t.shape) for t in trio] != [(t.qtype, t.shape) for t in first]:
                raise ValueError(f"expert streaming: layer {il}'s experts differ in type or shape from the first "
                                 "layer's")
        self.n_expert = first[0].shape[0]
        self.unit_bytes = sum(t.expert_bytes for t in first)
        self.n_units = len(experts) * self.n_expert
        self.slots = min(int(cap_bytes) // self.unit_bytes, self.n_units)
        check_cache_size(self.slots, max(min_slots, 1), self.unit_bytes)
        self.pools = [mx.zeros((self.slots, *t.storage_shape), dtype=storage_dtypes(t.qtype)[1]) for t in first]
        mx.eval(self.pools)
        # the pools as ``[slots, out, in]`` weights, made once: a decode step fetches 43 times
        self.weights = tuple(QuantWeight(pool, t.qtype, (self.slots, *t.shape[1:]))
                             for pool, t in zip(self.pools, first))  # fmt: skip
        # The reads land in the pools themselves (numpy views of their memory, no copy) where the host may write
        # that memory: on the CPU, and under MLX-CUDA, whose buffers are CUDA managed memory (the device's next
        # read moves the pages back). Elsewhere (Metal, not run here) MLX copies a read into its slot.
        in_place = mx.default_device() == mx.cpu or mx.cuda.is_available()
        self._views = [_host_view(p) for p in self.pools] if in_place else [None] * len(self.pools)
        self._pending: list[mx.array] = []  # outputs computed from the pools, not evaluated yet (see reading)
        self._slot_of: dict[tuple[int, int], int] = {}
        self._owner: list[tuple[int, int] | None] = [None] * self.slots
        # Eviction by decayed use: a slot's score adds ``_inc`` per call that uses it, and ``_inc`` grows by
        # ``2 ** (1 / half_life)`` per round of calls (one a layer: a decode step), so a use weighs half as much
        # after ``half_life`` steps. A miss takes the slots of lowest score (empty ones score 0), those the last
        # PROTECTED_ROUNDS rounds used last of all. half_life 0: the least recently used.
        self.half_life = half_life
        self._growth = 2.0 ** (1.0 / (half_life * len(experts))) if half_life > 0 else 1.0
        self._score = np.zeros(self.slots)
        self._inc = 1.0
        self._last = np.zeros(self.slots)  # the call that used each slot last (calls count from 1)
        self.profile = None if profile is None else Path(profile)
        self._rows = {il: i for i, il in enumerate(experts)}  # a layer's row in ``uses``
        self.uses = (np.zeros((len(experts), self.n_expert), np.int64) if self.profile is None
                     else read_profile(self.profile, list(experts), self.n_expert))  # fmt: skip
        if self.profile is not None:
            atexit.register(self.save_profile)  # a command's normal end (serve leaves by os._exit: its worker saves)
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="ds4-expert-read")
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = self.calls = self.preloaded = 0
        self.read_seconds = 0.0

    @property
    def nbytes(self) -> int:
        """The pools' bytes: all the device memory the cache takes."""
        return self.slots * self.unit_bytes

    def stats(self) -> dict:
        """Counters since start: hits and misses count experts asked for by MoE calls."""
        asked = self.hits + self.misses
        return {"slots": self.slots, "cap_bytes": self.nbytes, "expert_bytes": self.unit_bytes,
                "resident": sum(o is not None for o in self._owner), "experts_total": self.n_units,
                "calls": self.calls, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / asked, 4) if asked else None, "bytes_read": self.bytes_read,
                "read_s": round(self.read_seconds, 3), "preloaded": self.preloaded}  # fmt: skip

    def describe(self) -> str:
        """The counters in one line (what ``generate`` and ``bench`` print at the end)."""
        st = self.stats()
        return (f"streamed experts: cache {st['slots']} of {st['experts_total']} ({st['cap_bytes'] / 2**30:.2f} GiB), "
                f"{st['hits']} hits, {st['misses']} misses (hit rate {st['hit_rate']}), "
                f"{st['bytes_read'] / 2**30:.2f} GiB read in {st['read_s']} s")

    def spans(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """Token ranges ``[t0, t1)`` of ``ids [T, k]`` whose distinct experts each fit in the cache."""
        out, t0, seen = [], 0, set()
        for t in range(ids.shape[0]):
            row = set(ids[t].tolist())
            if len(seen | row) > self.slots:
                out.append((t0, t))
                t0, seen = t, set()
            seen |= row
        out.append((t0, ids.shape[0]))
        return out

    def groups(self, ids: np.ndarray) -> list[np.ndarray]:
        """The distinct experts of ``ids`` in groups that each fit in the cache (one group when all do)."""
        wanted = np.unique(ids)
        return [wanted[i : i + self.slots] for i in range(0, max(len(wanted), 1), self.slots)]

    def fetch(self, il: int, ids: np.ndarray) -> tuple[tuple[QuantWeight, ...], mx.array]:
        """Make the experts of ``ids`` (layer ``il``, any shape) resident -> ``((gate, up, down), slots)``: the
        three pools as ``[slots, out, in]`` weights and ``ids`` mapped to their slots (int32, same shape)."""
        if self._pending:  # see reading
            mx.eval(self._pending)
            self._pending.clear()
        wanted = np.unique(ids)
        if len(wanted) > self.slots:
            raise ValueError(f"expert streaming: a call needs {len(wanted)} experts at once, the cache holds "
                             f"{self.slots}")
        if wanted.size and (wanted[0] < 0 or wanted[-1] >= self.n_expert):
            raise IndexError(f"expert streaming: expert id out of range [0, {self.n_expert}) in layer {il}")
        with self._lock:
            self.calls += 1
            self.uses[self._rows[il], wanted] += 1
            slot_of = {}
            missing = []
            for e in wanted.tolist():
                s = self._slot_of.get((il, e))
                if s is None:
                    missing.append(e)
                else:
                    slot_of[e] = s
            self.hits += len(slot_of)
            self.misses += len(missing)
            if missing:
                for e, s in zip(missing, self._victims(len(missing), list(slot_of.values()))):
                    old = self._owner[s]
                    if old is not None:
                        del self._slot_of[old]
                    self._owner[s], self._slot_of[(il, e)], slot_of[e] = (il, e), s, s
                    self._score[s] = 0.0
                t0 = time.perf_counter()
                self._load(il, missing, [slot_of[e] for e in missing])
                self.bytes_read += len(missing) * self.unit_bytes
                self.read_seconds += time.perf_counter() - t0
            self._use(list(slot_of.values()))
            if self.calls % PROFILE_EVERY == 0:
                self.save_profile()
        table = np.zeros(self.n_expert, np.int32)
        table[wanted] = [slot_of[e] for e in wanted.tolist()]
        return self.weights, mx.array(table[ids])

    def _victims(self, n: int, keep: list[int]) -> np.ndarray:
        """The ``n`` slots of lowest score, none of ``keep``."""
        if self.half_life > 0:
            score = self._score.copy()
            score[self._last > self.calls - PROTECTED_ROUNDS * len(self.experts)] += score.max() + 1.0
        else:
            score = self._last.copy()
        score[keep] = np.inf
        return np.argpartition(score, n - 1)[:n] if n < self.slots else np.argsort(score)[:n]

    def _use(self, slots: list[int]) -> None:
        self._last[slots] = self.calls
        if self.half_life <= 0:
            return
        self._inc *= self._growth
        self._score[slots] += self._inc
        if self._inc > 1e200:  # rescaled long before float64 overflows: the order stays
            self._score /= self._inc
            self._inc = 1.0

    def reading(self, out: mx.array) -> mx.array:
        """``out``, computed from the pools: it is evaluated at the next fetch, before a read lands in a slot. A
        hash layer's router does not wait for the layer before it, so that layer's output could still be lazy:
        the CPU's reads in place (which MLX does not see) would change what it reads, and elsewhere a slice
        update would copy the whole pool to keep the version it reads."""
        self._pending.append(out)
        return out

    def preload(self, n: int | None = None, progress: Callable[[int, int], None] | None = None) -> int:
        """Read ``n`` experts into the empty cache (default: as many as it holds): the most used in :attr:`uses`,
        then in order, expert 0 of every layer, expert 1... -> how many. ``progress(done, total)`` in bytes. Their
        scores start below one use, so the traffic soon decides what stays."""
        if any(o is not None for o in self._owner):
            raise RuntimeError("expert streaming: preload fills an empty cache")
        n = self.slots if n is None else max(0, min(n, self.slots))
        by_use = np.argsort(-self.uses.T, axis=None, kind="stable")[:n]  # index e * layers + row
        rows, picked = by_use % len(self.experts), by_use // len(self.experts)
        weight = self.uses.T.ravel()[by_use] / max(int(self.uses.max()), 1)
        done, slot = 0, 0
        for il, row in self._rows.items():
            experts = picked[rows == row].tolist()
            slots = list(range(slot, slot + len(experts)))
            for e, s, w in zip(experts, slots, weight[rows == row].tolist()):
                self._owner[s], self._slot_of[(il, e)], self._score[s] = (il, e), s, w
            if experts:
                self._load(il, experts, slots)
            slot += len(experts)
            done += len(experts) * self.unit_bytes
            if progress is not None:
                progress(done, n * self.unit_bytes)
        self.preloaded += n
        return n

    def save_profile(self) -> None:
        """Write :attr:`uses` to the profile file, if there is one (whole or not at all). A write that fails is
        a warning, not an error: the model runs on without it."""
        if self.profile is None:
            return
        try:
            write_profile(self.profile, list(self.experts), self.uses)
        except OSError as e:
            warnings.warn(f"{self.profile}: the expert use profile could not be written ({e})", stacklevel=2)

    def _load(self, il: int, experts: list[int], slots: list[int]) -> None:
        """Read ``experts`` of layer ``il`` from the file into ``slots`` of the pools."""
        jobs = [(i, t, e, s) for i, t in enumerate(self.experts[il]) for e, s in zip(experts, slots)]
        for i, t, blob, slot in self._readers.map(lambda job: (*job[:2], self._read(*job), job[3]), jobs):
            if blob is not None:  # a slice update a slot, in place: the pools' buffers are their only references
                np_dtype, mx_dtype = storage_dtypes(t.qtype)
                self.pools[i][slot] = mx.array(np.frombuffer(blob, np_dtype).reshape(t.storage_shape)).view(mx_dtype)
        mx.eval(self.pools)
        for w in self.weights:  # what was made from the slots' old bytes (the CPU's kept float32 values)
            w.forget_derived()

    def _read(self, i: int, t: StreamedTensor, e: int, slot: int) -> bytes | None:
        """Expert ``e`` of ``t`` (pool ``i``): into its slot where the pool is host memory (None), else its bytes."""
        size, fd = t.expert_bytes, self._fd(t.path)
        off = t.offset + e * size
        view = self._views[i]
        if view is not None:
            got, data = os.preadv(fd, [memoryview(view[slot]).cast("B")], off), None
        else:
            data = os.pread(fd, size, off)
            got = len(data)
        if got != size:
            raise OSError(f"{t.path}: expert {e} of {t.name} needs bytes {off}..{off + size}, the file ends at "
                          f"{os.fstat(fd).st_size} (truncated or changed since it was loaded)")  # fmt: skip
        return data

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        self.save_profile()
        atexit.unregister(self.save_profile)
        self._readers.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_profile(path: Path, layers: list[int], n_expert: int) -> np.ndarray:
    """Every expert's uses ``[len(layers), n_expert]`` from a profile :class:`ExpertCache` wrote (zeros while the
    file does not exist yet); ValueError when the file is not one, or is another model's."""
    if not path.exists():
        return np.zeros((len(layers), n_expert), np.int64)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        uses = np.array(data["uses"], dtype=np.int64)
        ok = data["format"] == PROFILE_FORMAT
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an expert use profile ({e})") from None
    if not ok or data.get("layers") != layers or uses.shape != (len(layers), n_expert) or (uses < 0).any():
        raise ValueError(f"{path}: not an expert use profile of this model ({len(layers)} streamed layers of "
                         f"{n_expert} experts)")  # fmt: skip
    return uses


def write_profile(path: Path, layers: list[int], uses: np.ndarray) -> None:
    """Write a use profile :func:`read_profile` reads; a write cut short leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": PROFILE_FORMAT, "layers": layers, "uses": uses.tolist()}) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


def _host_view(pool: mx.array) -> np.ndarray | None:
    """A writable numpy view of a uint8 pool's own memory (contiguous, one byte a byte), or None."""
    if pool.dtype != mx.uint8:
        return None
    view = np.asarray(memoryview(pool))
    if view.flags.c_contiguous and view.flags.writeable:
        return view
    return None

