"""A training run on a ResumableLoader over a ts.Mixture, for tests/test_mixture.py's SIGKILL test.

``python mixture_run.py DIR OUT.json TOTAL [EVERY]`` restores from DIR (if it
holds a generation), trains to TOTAL updates saving after every EVERY-th
(default 2; 0: never), printing ``update N`` after each, and writes every
update's sample ids (kept in the checkpoint, so a resumed run reports the
whole history) and the final weights.
"""

from __future__ import annotations

import json
import sys

import torch

import trainstate as ts


class Source(torch.utils.data.Dataset):
    """Rows with per-sample noise from ts.sample_generator (keyed by the source's own epoch)."""

    def __init__(self, n: int, base: int):
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        noise = torch.randn(3, generator=ts.sample_generator(index))
        return {"id": self.base + int(index), "x": noise + float(index) / self.n}


class Log:
    """The ids of every update so far, saved with the state."""

    def __init__(self, total: int, batch: int):
        self.ids = torch.full((total, batch), -1, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"ids": self.ids}

    def load_state_dict(self, saved: dict) -> None:
        self.ids.copy_(saved["ids"])


def main(directory: str, out: str, total: int, every: int = 2) -> None:
    torch.manual_seed(0)
    mix = ts.Mixture([(Source(50, 0), 0.6), (Source(7, 1000), 0.3), (Source(500, 5000), 0.1)], length=40)
    loader = ts.ResumableLoader(mix, batch_size=4, seed=77, num_workers=2, persistent_workers=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = Log(total, 4)
    state = ts.TrainState(model=model, optimizer=opt, data=loader, log=log)
    with ts.CheckpointManager(directory) as ckpt:
        info = ckpt.restore(state)
        while state.next_update < total:
            for batch in loader:
                loss = (model(batch["x"]).squeeze(1) - batch["id"].float() / 1000).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.ids[state.next_update] = batch["id"]
                state.next_update += 1
                if every and state.next_update % every == 0:
                    ckpt.save(state)
                print("update", state.next_update, flush=True)
                if state.next_update == total:
                    break
    result = {"restored": info is not None, "ids": log.ids.tolist(),
              "weights": [p.detach().flatten().tolist() for p in model.parameters()]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:]))
