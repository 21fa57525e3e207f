"""A small language-model training script written the way real ones are (issue 22), run as a subprocess.

Tied embedding/decoder weights, an LSTM hidden state carried across batches,
a hand-written SGD update (no optimizer), the learning rate annealed by hand
in ``facts``, ``best_val_loss``, epoch and batch in ``counters``, an
index-sliced loop that starts at the saved batch, and a save every 4 updates
plus one at each epoch end, which lands on the same update as a periodic one.

    python real_script_run.py RUN_DIR OUT_FILE [--kill-after-epoch-end-save]

With the flag it prints ``SAVED <generation>`` after the first epoch-end save
and waits to be SIGKILLed. Otherwise it trains to the end and writes the
final parameters, hidden state, facts and counters to ``OUT_FILE`` (safetensors
plus a JSON sidecar), and prints the generation it restored from, if any.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from safetensors.torch import save_file

import trainstate as ts

VOCAB, EMB, BPTT, BATCH, EPOCHS = 11, 8, 4, 3, 3


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, EMB)
        self.rnn = torch.nn.LSTM(EMB, EMB)
        self.drop = torch.nn.Dropout(0.2)  # draws the global torch RNG: captured by every save
        self.decoder = torch.nn.Linear(EMB, VOCAB)
        self.decoder.weight = self.encoder.weight  # tied, as the word-language-model example ties them

    def forward(self, data: torch.Tensor, hidden: tuple | None) -> tuple[torch.Tensor, tuple]:
        output, hidden = self.rnn(self.drop(self.encoder(data)), hidden)
        return self.decoder(self.drop(output)).view(-1, VOCAB), hidden


class Carried:
    """The hidden state carried across batches, as a tiny component."""

    hidden = None

    def state_dict(self) -> dict:
        return {"hidden": self.hidden}

    def load_state_dict(self, saved: dict) -> None:
        self.hidden = saved["hidden"]


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq], source[i + 1:i + 1 + seq].reshape(-1)


def build() -> tuple[ts.TrainState, TinyLM, Carried]:
    torch.manual_seed(1111)
    model, carried = TinyLM(), Carried()
    state = ts.TrainState(model=model, carried=carried,
                          contract={"config": {"model": "LSTM", "emsize": EMB, "bptt": BPTT, "seed": 1111}})
    state.facts.update(lr=2.0, best_val_loss=None)
    return state, model, carried


def main(directory: str, out: str, kill: bool) -> None:
    data = torch.Generator().manual_seed(7)
    train_data = torch.randint(VOCAB, (8 * BPTT + 1, BATCH), generator=data)  # 8 batches per epoch
    val_data = torch.randint(VOCAB, (2 * BPTT + 1, BATCH), generator=data)
    state, model, carried = build()
    criterion = torch.nn.CrossEntropyLoss()

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            output, _ = model(val_data[:-1], None)
            loss = float(criterion(output, val_data[1:].reshape(-1)))
        model.train()
        return loss

    with ts.CheckpointManager(directory, keep_last=3) as ckpt:
        info = ckpt.restore(state)
        print("RESTORED", info.generation.name if info else None, flush=True)
        while state.counters.get("epoch", 1) <= EPOCHS:
            epoch, start = state.counters.get("epoch", 1), state.counters.get("batch", 0)
            for batch, i in enumerate(range(start * BPTT, train_data.size(0) - 1, BPTT), start=start):
                x, targets = get_batch(train_data, i)
                model.zero_grad()
                output, hidden = model(x, carried.hidden)
                criterion(output, targets).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-state.facts["lr"])
                carried.hidden = tuple(h.detach() for h in hidden)
                state.next_update += 1
                state.counters.update(epoch=epoch, batch=batch + 1)
                if state.next_update % 4 == 0:
                    ckpt.save(state)
            val_loss = evaluate()
            if state.facts["best_val_loss"] is None or val_loss < state.facts["best_val_loss"]:
                state.facts["best_val_loss"] = val_loss
            state.facts["lr"] /= 4.0
            carried.hidden = None
            state.counters.update(epoch=epoch + 1, batch=0)
            saved = ckpt.save(state, metrics={"val_loss": val_loss})
            if kill:
                print("SAVED", saved.name, flush=True)
                time.sleep(600)  # the test SIGKILLs us here, right after the second save at this update
    tensors = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    save_file(tensors, out)
    with open(out + ".json", "w") as f:
        json.dump({"facts": state.facts, "counters": state.counters, "next_update": state.next_update,
                   "rng": torch.get_rng_state().tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--kill-after-epoch-end-save" in sys.argv[3:])
