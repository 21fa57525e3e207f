"""Jobs for tests/test_hf_trainer.py: a tiny GPT-2 trained by Hugging Face Trainer, killed at chosen moments.

``python hf_child.py jobs.json results.json``: imports transformers once, then
runs each job in its own forked process (see forkjobs.py). A job trains to
``TOTAL`` steps in ``dir``, resuming from what ``resume`` picks, and SIGKILLs
itself at its ``kill`` moment:

- ``["step", k]``: between updates, as update k+1 begins;
- ``["hf-save", k]``: inside Trainer's save at step k, after the model, optimizer
  and scheduler files, before the RNG and trainer-state files;
- ``["seal", k]``: inside the seal, every file fsynced, just before the seal's rename;
- ``["pointer", k]``: the seal committed, just before the seal pointer moves.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from forkjobs import run_jobs  # noqa: E402
from trainstate.format.seal import SEAL, SEAL_POINTER  # noqa: E402
from trainstate.integrations.hf import DurableCheckpoints, last_verified_checkpoint  # noqa: E402
from trainstate.storage.posix import PosixOps  # noqa: E402

TOTAL, EVERY = 12, 3


class Tokens(torch.utils.data.Dataset):
    """40 random sequences: 5 batches of 8, so 12 steps cross two epoch boundaries."""

    def __init__(self):
        self.ids = torch.randint(0, 97, (40, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            die()


def trainer_for(directory: str, kill: list | None, limit: int = 2) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # dropout on (0.1): the RNG streams matter
    args = TrainingArguments(
        output_dir=directory, max_steps=TOTAL, save_steps=EVERY, save_total_limit=limit, per_device_train_batch_size=8,
        learning_rate=1e-3, warmup_steps=2, seed=0, report_to="none", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, dataloader_num_workers=0)
    callbacks = [DurableCheckpoints()]
    if kill and kill[0] == "step":
        callbacks.append(KillAtStep(kill[1]))
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks)
    if kill and kill[0] == "hf-save":
        save_rng = trainer._save_rng_state

        def save_rng_then_maybe_die(output_dir):
            if trainer.state.global_step == kill[1]:
                die()
            save_rng(output_dir)

        trainer._save_rng_state = save_rng_then_maybe_die
    if kill and kill[0] in ("seal", "pointer"):
        target, replace = {"seal": SEAL, "pointer": SEAL_POINTER}[kill[0]], PosixOps.replace

        def replace_or_die(self, src, dst):
            if dst.name == target and trainer.state.global_step == kill[1]:
                die()
            replace(self, src, dst)

        PosixOps.replace = replace_or_die
    return trainer


def job(spec: dict) -> None:
    torch.set_num_threads(1)
    log = logging.getLogger("trainstate")
    log.addHandler(logging.StreamHandler())
    log.setLevel(logging.INFO)  # the seal and resume lines go to the job's log
    directory = spec["dir"]
    trainer = trainer_for(directory, spec.get("kill"), spec.get("save_total_limit", 2))
    choices = {"verified": last_verified_checkpoint(directory),
               "hf-last": get_last_checkpoint(directory) if os.path.isdir(directory) else None}
    resume = choices[spec.get("resume", "verified")]
    with open(spec["log"] + ".json", "w") as out:
        json.dump(choices, out)
    if resume is not None and resume.endswith(f"checkpoint-{TOTAL}"):
        return  # the run had finished (killed after its last seal): Trainer 5.25 would train a 13th step
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(run_jobs(sys.argv[1], sys.argv[2], job))
