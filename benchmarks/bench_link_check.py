"""What proving a part before every link costs (issue 48): a frozen base's parts read at page-cache speed.

A frozen base of ``--base`` bytes (float32 ``Linear(4096, 4096)`` layers) and a
small trainable head, saved into a local incremental run until the base's
part files are linked. Then, with the page cache warm:

- ``proof``: :func:`trainstate.lifecycle.incremental.intact` over every part the
  next save links (each part's header chunk by digest, every tensor by its
  XXH3 fingerprint), which every steady save now pays;
- ``pass``: the fingerprint pass over the same tensors in memory (what a
  steady save paid already, for comparison);
- ``steady save``: one head update and a blocking save that links the parts.

    python benchmarks/bench_link_check.py --base 256M --reps 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import trainstate as ts
from trainstate.lifecycle import incremental
from trainstate.state import changes
from trainstate.storage.verify import read_manifest


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="256M", help="frozen base size, a multiple of 64M (default 256M)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    layers = max(1, int(args.base.rstrip("Mm")) // 64)
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)))
    base.requires_grad_(False)
    head = torch.nn.Linear(4096, 8)
    state = ts.TrainState(model=torch.nn.ModuleDict({"base": base, "head": head}),
                          optimizer=torch.optim.SGD(head.parameters(), lr=0.1))

    def save() -> None:
        with torch.no_grad():
            head.weight.add_(0.01)
        state.next_update += 1
        ckpt.save(state)

    with tempfile.TemporaryDirectory() as tmp, ts.CheckpointManager(Path(tmp) / "run", keep_last=3,
                                                                    full_every=1000) as ckpt:
        for _ in range(3):  # the second lays the base out in parts, the third links them
            save()
        manifest = read_manifest(ckpt.store, ckpt.latest(), None, None)[0]
        parts = [f.name for f in manifest.files if f.name.startswith("part-")]
        proof = _timed(lambda: all(incremental.intact(ckpt.store, manifest, p) for p in parts), args.reps)
        weights = dict(base.state_dict())
        fingerprint = _timed(lambda: changes.fingerprints(weights), args.reps)
        steady = _timed(save, args.reps)
    size = sum(manifest.file(p).size for p in parts)
    ms = lambda times: [round(statistics.median(times) * 1e3, 1), round(min(times) * 1e3, 1)]  # noqa: E731
    print(json.dumps({"part_bytes": size, "proof_ms": ms(proof), "pass_ms": ms(fingerprint),
                      "steady_save_ms": ms(steady), "proof_GB_per_s": round(size / statistics.median(proof) / 1e9, 1)}))


if __name__ == "__main__":
    main()
