"""One rank of the model-parallel tests (tests/test_distributed.py), started by ``mlx.launch``:
``pipeline_rank.py MODEL.gguf LAYERS|- PROFILES OUT.npz [pipeline|expert|tensor] [KV_DIR]`` (PROFILES:
``hf,ds4``). Rank 0 writes, for each profile, the full prefill's logits, a chunked prefill's and the decode steps'
logits, a snapshot's replay, the KV payload after the prefill, the steps after restoring ``KV_DIR/{profile}.kv``
(one rank's payload) and greedy generated ids; the other ranks follow rank 0."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.generate import stream_generate
from ds4_mlx.kvstore import session_payload, snapshot_from_payload
from ds4_mlx.loader import load
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.session import Session

PROMPT = [0] + np.random.default_rng(0).integers(2, 512, 44).tolist()
PREFILL, CHUNK, GENERATED = 30, 7, 12


def run(model, tokenizer, kv: bytes | None = None) -> dict[str, np.ndarray]:
    """What tests/test_distributed.py compares between one rank and several; ``kv``: one rank's payload after
    the prefill, to restore and step from."""
    full = np.array(model(PROMPT, 0, model.make_cache(), all_logits=True))
    s = Session(model, chunk_size=CHUNK)
    s.prefill(PROMPT[:PREFILL])
    chunked = np.array(s.logits)
    payload = np.frombuffer(session_payload(s), np.uint8)
    snap = s.snapshot()
    steps = np.stack([np.array(s.step(t)) for t in PROMPT[PREFILL:]])
    s.restore(snap)
    replay = np.stack([np.array(s.step(t)) for t in PROMPT[PREFILL:]])
    out = {"full": full, "chunked": chunked, "steps": steps, "replay": replay, "payload": payload}
    if kv is not None:
        s.restore(snapshot_from_payload(model, kv))
        out["restored"] = np.stack([np.array(s.step(t)) for t in PROMPT[PREFILL:]])
    greedy = SamplingParams(temperature=0.0)
    ids = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=GENERATED, sampling=greedy)
           if r.token is not None]
    return {**out, "ids": np.array(ids)}


def main(path: str, layers: str, profiles: str, out: str, parallel: str = "pipeline", kv_dir: str = "") -> None:
    group = mx.distributed.init()
    results = {}
    for profile in profiles.split(","):
        model, tokenizer = load(path, numerics=profile, group=group, layers=None if layers == "-" else layers,
                                parallel=parallel)  # fmt: skip
        kv = Path(kv_dir, f"{profile}.kv").read_bytes() if kv_dir else None
        if group.rank() > 0:
            model.run()
            continue
        with model:
            results.update({f"{profile}.{k}": v for k, v in run(model, tokenizer, kv).items()})
    if group.rank() == 0:
        np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
