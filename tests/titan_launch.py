"""Run the real torchtitan trainer on CPU (gloo): the script ``torchrun`` starts on each rank.

    python -m torch.distributed.run --nproc_per_node=N ... tests/titan_launch.py <torchtitan CLI args>

torchtitan 0.3.0 assumes an accelerator; this launcher patches the few places
that need one, then calls ``torchtitan.train.main()`` with the arguments given.
Patches (each applied before torchtitan builds anything):

1. device type: torchtitan picks "cuda" when no accelerator is found; force
   "cpu" (``torch._utils._get_available_device_type`` before torchtitan is
   imported, then the ``device_type``/``device_module`` names its modules bound).
2. metrics: give ``torch.cpu`` the memory functions the device memory monitor
   calls (only where missing); torchtitan's modules see a view of ``torch.cpu``
   whose ``current_device()`` is 0 (the barrier in ``set_pg_timeouts`` wants an
   int device id; ``torch.cpu.current_device()`` says "cpu").
3. attention: FlexAttention has no CPU backward; run the BlockMask's
   ``mask_mod`` as a dense boolean mask through ``F.scaled_dot_product_attention``
   (and build BlockMasks eagerly, not with a compiled ``create_block_mask``).
   ``TITAN_DROPOUT`` (default 0.0) is the attention dropout while training, so
   that training draws from the CPU generator.
4. FSDP: gloo has no PREMUL_SUM; where torchtitan sets the gradient divide
   factor to 1.0, force sum reductions too (exact for a factor of 1).
5. ``torch.distributed.set_timeout`` (absent from this torch): alias
   ``distributed_c10d._set_pg_timeout``.
6. triton must import (checked up front, so a missing one fails clearly).
7. time: rank 0 sleeps 2 s after the last step "for other ranks to complete";
   every rank here ends in ``os._exit`` after torchtitan returns, so the sleep
   is skipped (``torchtitan.trainer`` sees a ``time`` whose ``sleep`` returns
   at once; ``perf_counter`` is the real one). Saves 2 s per launch.

Test hooks: ``TITAN_PICKLE_AUDIT`` counts pickle and ``torch.load`` calls made
while a checkpointer loads; ``TITAN_SAVE_AFTER_LOAD`` saves what trainstate's
checkpointer loaded into a second run directory; ``TITAN_RESEED_AFTER_LOAD``
seeds torch again after a restore (the doctor's control); ``TITAN_TIMINGS``
records how long training waits for the checkpointer (see each function).

Loss record: with ``TITAN_RECORD`` set, each rank appends one JSON line per
logged step to ``$TITAN_RECORD/losses-rank{rank}.jsonl``:
``{"step": int, "loss": float.hex(global_avg_loss), "max_loss": ..., "grad_norm": ...,
"pid": ...}``, flushed and fsynced. ``loss`` is the *global* average loss, the
value torchtitan logs (``MetricsProcessor.log``), identical on every rank; it is
recorded for every step only with ``--metrics.log_freq 1``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _patch_device_type() -> None:
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # patch 1, before torchtitan's import reads it

    # patch 2: what DeviceMemoryMonitor calls, only where torch.cpu lacks it
    class _Props:
        total_memory = 64 * 1024**3
        name = "cpu"

    fillers = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: _Props(),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda device=None: {},
        "current_device": lambda: 0,
    }
    for name, fn in fillers.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


class _CpuModule:
    """``torch.cpu`` as torchtitan sees it: ``current_device()`` is an index (0)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


def _patch_torchtitan_device() -> None:
    import importlib

    module = _CpuModule()
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiler",
                 "torchtitan.models.common.token_dispatcher"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module


def _patch_attention() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

    import torchtitan.models.common.attention as attention

    dropout = float(os.environ.get("TITAN_DROPOUT", "0") or 0)

    # BlockMasks built eagerly: the compiled create_block_mask would run inductor on CPU for nothing.
    attention._compiled_create_block_mask = create_block_mask

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        assert isinstance(attention_masks, BlockMask), type(attention_masks)
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("titan_launch's CPU attention supports neither score_mod nor out_transform")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        q_len, kv_len = attention_masks.seq_lengths
        # heads broadcast (H=1): the llama3 masks (causal, packed documents) ignore the head index
        mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q_len, kv_len, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout if self.training else 0.0,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    attention.FlexAttention.forward = forward


def _patch_fsdp() -> None:
    import torchtitan.distributed.fsdp as tfsdp
    from torch.distributed._composable.fsdp import FSDPModule

    original = tfsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model):
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # no PREMUL_SUM in gloo; factor 1 makes it exact

    tfsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _patch_set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout, group=None):
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout


def _patch_loss_record() -> None:
    record = os.environ.get("TITAN_RECORD")
    if not record:
        return
    from torchtitan.components.metrics import MetricsProcessor

    os.makedirs(record, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(record, f"losses-rank{rank}.jsonl")
    original = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        line = json.dumps({"step": int(step), "loss": float(global_avg_loss).hex(),
                           "max_loss": float(global_max_loss).hex(), "grad_norm": float(grad_norm).hex(),
                           "pid": os.getpid()})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    MetricsProcessor.log = log


def _patch_load_audit() -> None:
    """``TITAN_PICKLE_AUDIT=DIR``: count every ``pickle``/``torch.load`` call made while the checkpointer loads
    (stock or trainstate's), each let through, into ``DIR/audit-rank{r}.json`` with where the first few came from."""
    audit = os.environ.get("TITAN_PICKLE_AUDIT")
    if not audit:
        return
    import pickle
    import traceback as tb

    import torch
    from torchtitan.components.checkpointer import BaseCheckpointManager

    os.makedirs(audit, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    seen = {"calls": 0, "where": []}
    armed = [False]

    def counting(name, function):
        def wrapper(*args, **kwargs):
            if armed[0]:
                seen["calls"] += 1
                if len(seen["where"]) < 5:
                    seen["where"].append(f"{name} from " + " <- ".join(
                        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in tb.extract_stack(limit=4)[:-1]))
            return function(*args, **kwargs)
        return wrapper

    pickle.load = counting("pickle.load", pickle.load)
    pickle.loads = counting("pickle.loads", pickle.loads)
    torch.load = counting("torch.load", torch.load)

    class Unpickler(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            counting("pickle.Unpickler", lambda: None)()
            super().__init__(*args, **kwargs)

    pickle.Unpickler = Unpickler
    original = BaseCheckpointManager.load

    def load(self, step=-1):
        armed[0] = True
        try:
            return original(self, step)
        finally:
            armed[0] = False
            with open(os.path.join(audit, f"audit-rank{rank}.json"), "w") as f:
                json.dump(seen, f)

    BaseCheckpointManager.load = load


def _patch_save_after_load() -> None:
    """``TITAN_SAVE_AFTER_LOAD=DIR``: right after trainstate's checkpointer loads, save the loaded state into the
    run directory DIR too (a second manager), so a test can diff what was loaded against what was saved."""
    target = os.environ.get("TITAN_SAVE_AFTER_LOAD")
    if not target:
        return
    import trainstate as ts
    from trainstate.integrations.torchtitan import TrainStateCheckpointer

    original = TrainStateCheckpointer._load

    def _load(self, step=-1):
        loaded = original(self, step)
        with ts.CheckpointManager(target, full_every=None) as again:
            again.save(self.state)
        return loaded

    TrainStateCheckpointer._load = _load


def _patch_reseed_after_load() -> None:
    """``TITAN_RESEED_AFTER_LOAD=1``: after trainstate's checkpointer restored a generation, seed torch's CPU
    generator again (what a checkpointer that saves no RNG amounts to): the negative control of the doctor."""
    if not os.environ.get("TITAN_RESEED_AFTER_LOAD"):
        return
    import torch
    from trainstate.integrations.torchtitan import TrainStateCheckpointer

    original = TrainStateCheckpointer._load

    def _load(self, step=-1):
        loaded = original(self, step)
        if loaded:
            torch.manual_seed(12345)
        return loaded

    TrainStateCheckpointer._load = _load


def _patch_timings() -> None:
    """``TITAN_TIMINGS=DIR``: how long training waits for the checkpointer (stock or trainstate's), one JSON line
    per call into ``DIR/timings-rank{r}.jsonl``: ``load``; ``save`` (a call that saved, with its step; for an
    asynchronous save the part training waits for, including a wait for the previous one); ``staging`` (the
    wait before the optimizer step); ``close`` (the end: what is still in flight finishes)."""
    target = os.environ.get("TITAN_TIMINGS")
    if not target:
        return
    import time

    from torchtitan.components.checkpointer import BaseCheckpointManager

    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, f"timings-rank{os.environ.get('RANK', '0')}.jsonl")

    def note(**row):
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def timed(name, original, keep=lambda result: True):
        def wrapper(self, *args, **kwargs):
            began = time.perf_counter()
            result = original(self, *args, **kwargs)
            seconds = time.perf_counter() - began
            if keep(result):
                note(op=name, s=seconds, args=[a for a in args if isinstance(a, (int, bool))],
                     manager=type(self).__name__)
            return result
        return wrapper

    BaseCheckpointManager.load = timed("load", BaseCheckpointManager.load)
    BaseCheckpointManager.save = timed("save", BaseCheckpointManager.save, keep=bool)
    BaseCheckpointManager.maybe_wait_for_staging = timed("staging", BaseCheckpointManager.maybe_wait_for_staging)
    BaseCheckpointManager.close = timed("close", BaseCheckpointManager.close)


def _patch_end_sleep() -> None:
    import time
    import types

    import torchtitan.trainer

    quick = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    quick.sleep = lambda seconds: None  # patch 7: the only sleep in trainer.py is the 2 s at the end of train()
    torchtitan.trainer.time = quick


def apply_patches() -> None:
    import triton  # noqa: F401  (patch 6: inductor/flex imports need it; fail here, clearly, if missing)

    _patch_device_type()
    _patch_torchtitan_device()
    _patch_attention()
    _patch_fsdp()
    _patch_set_timeout()
    _patch_end_sleep()
    _patch_loss_record()
    _patch_load_audit()
    _patch_save_after_load()
    _patch_reseed_after_load()
    _patch_timings()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torchtitan seeds torch only; Python's and NumPy's streams start from OS entropy. Seeded here (per rank) so
    # that two uninterrupted runs end in identical RNG states and a test can compare whole generations.
    import random

    import numpy as np

    random.seed(int(os.environ.get("RANK", "0")))
    np.random.seed(int(os.environ.get("RANK", "0")))
    try:
        apply_patches()
        import torchtitan.train

        sys.argv = [sys.argv[0], *sys.argv[1:]]
        torchtitan.train.main()
    except SystemExit as exc:  # tyro's --help / a bad flag
        _flush()
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        os._exit(code)
    except BaseException:
        traceback.print_exc()
        _flush()
        os._exit(1)
    _flush()
    os._exit(0)  # teardown after destroy_process_group can abort under gloo; the run itself succeeded


if __name__ == "__main__":
    main()
