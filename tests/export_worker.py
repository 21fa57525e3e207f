"""Multi-rank generations for the export tests, made under a real ``torchrun`` (gloo on CPU) by
``tests/test_export_sharded.py``.

``python -m torch.distributed.run --nproc_per_node 2 tests/export_worker.py OUT fsdp_generations``

Three models train two updates each and are saved by a multi-rank ``CheckpointManager``: under FSDP2, a GPT-style model
with a tied embedding, odd sizes (uneven shards) and integer and bool buffers, and a tiny Hugging Face GPT-2
(its parameters by name and shape; its config is the run's contract, and the test loads the export with
``from_pretrained``, no download); and the GPT-style model again under DDP, whose state-dict names carry
``module.`` where DCP's keys do not. Rank 0 also writes each model's full
weights (gathered) with safetensors as the reference the test saves from a single process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import trainstate as ts


class TiedLM(torch.nn.Module):
    """GPT-2's tie (the output projection is the token embedding), odd sizes, integer and bool buffers."""

    def __init__(self, vocab: int = 51, dim: int = 13):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(3))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("position_ids", torch.arange(7, dtype=torch.int64))
        self.register_buffer("mask", torch.tril(torch.ones(7, 7, dtype=torch.bool)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = torch.relu(block(x)) + x
        return self.lm_head(self.ln_f(x))


GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 61, "n_positions": 16,
               "n_embd": 24, "n_layer": 2, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0,
               "tie_word_embeddings": True}


class _Conv1D(torch.nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(i, o) * 0.02)  # [in, out], as transformers' Conv1D
        self.bias = torch.nn.Parameter(torch.zeros(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        self.attn.c_attn, self.attn.c_proj = _Conv1D(d, 3 * d), _Conv1D(d, d)
        self.mlp.c_fc, self.mlp.c_proj = _Conv1D(d, 4 * d), _Conv1D(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.c_proj(self.attn.c_attn(self.ln_1(x))[..., :x.shape[-1]])
        return x + self.mlp.c_proj(torch.relu(self.mlp.c_fc(self.ln_2(x))))


class GPT2Shaped(torch.nn.Module):
    """The parameters of a Hugging Face ``GPT2LMHeadModel`` of ``GPT2_CONFIG``, by name and shape, without
    importing transformers in every rank: the export does not depend on the model's class, and the test
    loads the result with ``from_pretrained``. Its forward is a simple function of every parameter, enough
    to train them."""

    def __init__(self, c: dict = GPT2_CONFIG):
        super().__init__()
        d, v = c["n_embd"], c["vocab_size"]
        self.transformer = torch.nn.Module()
        self.transformer.wte = torch.nn.Embedding(v, d)
        self.transformer.wpe = torch.nn.Embedding(c["n_positions"], d)
        self.transformer.h = torch.nn.ModuleList(_Block(d) for _ in range(c["n_layer"]))
        self.transformer.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, v, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def _train(name: str, model: torch.nn.Module, run: Path, contract: dict, out: Path) -> None:
    if name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)  # names gain "module.": DCP's keys do not
    elif name == "gpt2":
        for block in model.transformer.h:
            fully_shard(block)
    else:
        for block in model.blocks:
            fully_shard(block)
    if name != "ddp":
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ts.TrainState(model=model, optimizer=opt, contract=contract)
    g = torch.Generator().manual_seed(5)
    with ts.CheckpointManager(run, collective_timeout_s=60) as ckpt:
        for _ in range(2):
            ids = torch.randint(0, 51, (2, 7), generator=g)
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            state.next_update += 1
            state.tokens_seen += ids.numel() * dist.get_world_size()
        ckpt.save(state)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous()
            for k, v in get_model_state_dict(model).items()}
    if dist.get_rank() == 0:
        save_file(full, str(out / f"{name}-reference.safetensors"))


def fsdp_generations(out: Path) -> dict:
    torch.manual_seed(0)
    _train("tied", TiedLM(), out / "tied-run", {"config": {"kind": "tied"}}, out)
    torch.manual_seed(0)
    _train("gpt2", GPT2Shaped(), out / "gpt2-run", {"config": GPT2_CONFIG}, out)
    torch.manual_seed(0)
    _train("ddp", TiedLM(), out / "ddp-run", {"config": {"kind": "ddp"}}, out)
    return {}


def main() -> int:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    status = 0
    for name in names:
        where = out / name
        where.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        try:
            result = {"ok": True, **globals()[name](where)}
        except Exception as exc:  # reported to the test, which shows it
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            status = 1
        (where / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # past the interpreter's teardown of torch: see dist_worker.exit_now
