"""Run the real torchtitan trainer (llama3 debugmodel, CPU, gloo) under ``torchrun`` from tests.

``tests/titan_launch.py`` is what each rank runs (the CPU patches, the loss
record); this module builds what torchtitan loads (a tiny tokenizer and a
``c4_test``-style dataset, never fetched), the CLI arguments, and starts,
waits for or SIGKILLs a launch (torchrun and every rank, via
``distlaunch.kill_launch``).

    assets = build_assets(tmp_root)
    run = launch_titan(out, titan_args(out, assets, steps=8, extra=checkpoint_flags(interval=2)))
    run.ok()
    losses(out)  # [(1, "0x1.e3c...p+2"), (2, ...), ...]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from distlaunch import _MARKER, free_port, kill_launch

LAUNCHER = Path(__file__).resolve().parent / "titan_launch.py"

ASSETS_VERSION = "titan-assets-v1"
VOCAB_SIZE = 1024  # <= the debug model's 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DOCUMENTS = 4000  # ~60 tokens each: 2-4 ranks x 64 tokens x batch 2 x 30+ steps never loop the data

SEQ_LEN = 64
LOCAL_BATCH = 2

_WORDS = (
    "the a an one two three some every each this that these those my your our their his her its "
    "cat dog bird fish horse cow sheep goat mouse rabbit fox wolf bear lion tiger deer owl frog snake bee "
    "tree river mountain field forest lake sea road house city village garden bridge tower castle market "
    "school library kitchen window door table chair book letter story song picture map clock lamp stone "
    "runs walks jumps sleeps eats drinks sings reads writes sees finds makes takes gives keeps holds builds "
    "opens closes carries follows watches hears loves likes wants needs knows thinks says tells asks "
    "big small old young new red green blue yellow white black quiet loud fast slow happy sad bright dark "
    "warm cold tall short heavy light soft hard clean early late near far high low "
    "in on under over near behind beside across through into from with without after before during "
    "and but or so because when while if then yet also still again always never often sometimes today "
    "morning evening night day week year spring summer autumn winter rain snow wind sun moon star cloud"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
    return " ".join(words).capitalize() + rng.choice(".!?.")


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(1, 5))) for _ in range(count)]


def _build_tokenizer(directory: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert tokenizer.get_vocab_size() <= 2048, tokenizer.get_vocab_size()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def _warm_dataset_cache(data: Path, cache: Path) -> None:
    """Prepare ``datasets``' cache once, so ranks (sharing the cache) only read it."""
    try:
        from datasets import load_dataset
    except ImportError:
        return
    load_dataset(str(data), split="train", cache_dir=str(cache))


def build_assets(root: Path) -> tuple[Path, Path]:
    """``(tokenizer_dir, dataset_dir)`` under ``root``: built once, deterministic, then reused.

    The tokenizer is a byte-level BPE (vocab 1024, BOS/EOS special tokens) trained
    on the dataset's text; the dataset is ``DOCUMENTS`` short generated
    documents (``{"text": ...}`` per line of ``data.jsonl``), loaded by
    torchtitan's ``c4_test`` loader (``load_dataset(path, split="train")``).
    Built in a staging folder and renamed into place, so concurrent builders
    and an interrupted build leave either nothing or a whole set.
    """
    root = Path(root)
    final = root / ASSETS_VERSION
    tokenizer_dir, data_dir = final / "tokenizer", final / "c4_test"
    if not (final / "done").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".{ASSETS_VERSION}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        texts = _documents(DOCUMENTS)
        _build_tokenizer(staging / "tokenizer", texts)
        (staging / "c4_test").mkdir()
        with open(staging / "c4_test" / "data.jsonl", "w") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        (staging / "done").write_text("ok\n")
        try:
            os.rename(staging, final)
        except OSError:  # another builder won (same contents)
            shutil.rmtree(staging, ignore_errors=True)
        if not (final / "done").exists():
            raise RuntimeError(f"titan assets not built at {final}")
    cache = dataset_cache(data_dir)
    if not (cache / ".warm").exists():
        _warm_dataset_cache(data_dir, cache)
        (cache).mkdir(parents=True, exist_ok=True)
        (cache / ".warm").write_text("ok\n")
    return tokenizer_dir, data_dir


def dataset_cache(data_dir: Path) -> Path:
    """The ``HF_DATASETS_CACHE`` the launches of these assets share."""
    return Path(data_dir).parent / "hf_cache"


def checkpoint_flags(folder: Path | str = "checkpoint", *, interval: int = 2, keep_latest_k: int = 0) -> list[str]:
    """torchtitan's stock checkpointer (DCP): every ``interval`` steps and the last, full state.

    ``folder`` is relative to the dump folder unless absolute; ``keep_latest_k=0`` keeps all.
    """
    return ["--checkpoint.enable", "--checkpoint.folder", str(folder), "--checkpoint.interval", str(interval),
            "--checkpoint.keep_latest_k", str(keep_latest_k), "--checkpoint.no-last_save_model_only"]


def titan_args(out: Path, assets: tuple, *, steps: int, module: str = "llama3", config: str = "llama3_debugmodel",
               extra: list[str] | tuple = (), seq_len: int = SEQ_LEN, local_batch: int = LOCAL_BATCH,
               seed: int = 0) -> list[str]:
    """The torchtitan CLI for a short, deterministic CPU run dumping to ``out/dump``.

    float32 throughout (FSDP's mixed-precision params would otherwise be
    bfloat16). Activation checkpointing, compile, CUDA graphs, validation, profiling,
    tensorboard/wandb, the flight recorder and structured trace logging are
    off; metrics log every step (the loss record needs it). ``extra`` (e.g.
    ``checkpoint_flags()``) comes after these, so it can override them.
    """
    tokenizer_dir, data_dir = assets
    args = [
        "--module", module, "--config", config,
        "--dump_folder", str(Path(out) / "dump"),
        "--hf_assets_path", str(tokenizer_dir),
        "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(data_dir),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local_batch), "--training.disable_cuda_graphs",
        "--training.mixed_precision_param", "float32",
        "--parallelism.spmd_backend", "partial_dtensor",
        "--compile.no-enable", "--validator.no-enable", "--profiler.no-enable_profiling",
        "--metrics.log_freq", "1", "--metrics.no-enable_tensorboard", "--metrics.no-enable_wandb",
        "--comm.trace_buf_size", "0", "--debug.no-enable_structured_logging",
        "--debug.seed", str(seed),
    ]
    return [*args, *extra, "activation-checkpoint:none"]  # tyro's subcommand goes last


@dataclass
class Launch:
    out: Path
    returncode: int
    log: str
    seconds: float

    def ok(self) -> "Launch":
        assert self.returncode == 0, f"torchtitan exited {self.returncode}:\n{self.log[-6000:]}"
        return self


def _environment(out: Path, args: list[str], env: dict | None, marker: str) -> dict:
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "PYTHONFAULTHANDLER": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
                   "HF_HUB_OFFLINE": "1", "TITAN_RECORD": str(Path(out) / "record")}
    for flag in ("--dataloader.dataset_path", "--dataloader.dataset-path"):
        if flag in args:
            environment["HF_DATASETS_CACHE"] = str(dataset_cache(Path(args[args.index(flag) + 1])))
    environment.update(env or {})
    environment.update(dict([marker.split("=", 1)]))
    return environment


def start_titan(out: Path, args: list[str], *, ranks: int = 2, env: dict | None = None,
                log_name: str = "torchrun.log") -> tuple[subprocess.Popen, str]:
    """Start torchrun on ``titan_launch.py`` in a session of its own; ``(proc, marker)``.

    Its output goes to ``out/<log_name>`` (appended). Stop it, torchrun and
    every rank, with ``kill_titan(proc, marker)`` (``distlaunch.kill_launch``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--monitor-interval=0.5",
               str(LAUNCHER), *args]
    marker = f"{_MARKER}=trainstate-titan-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    with open(out / log_name, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_environment(out, args, env, marker), start_new_session=True)
    proc.titan_log = out / log_name  # type: ignore[attr-defined]
    proc.titan_started = time.monotonic()  # type: ignore[attr-defined]
    return proc, marker


def titan_command(out: Path, args: list[str], *, ranks: int = 2, env: dict | None = None) -> list[str]:
    """The torchrun command line ``start_titan`` runs, as one self-contained command (``env K=V ... python -m
    torch.distributed.run ...``): for ``trainstate doctor --launch``, which runs it once per role."""
    environment = _environment(Path(out), args, env, f"{_MARKER}=trainstate-titan-doctor-{uuid.uuid4().hex[:12]}")
    settings = [f"{k}={v}" for k, v in environment.items() if os.environ.get(k) != v]
    return ["env", *settings, sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--monitor-interval=0.5",
            str(LAUNCHER), *args]


def kill_titan(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL torchrun and every rank (whatever session it is in), and reap torchrun."""
    kill_launch([proc], marker)
    proc.wait()


def read_log(proc: subprocess.Popen) -> str:
    return Path(proc.titan_log).read_text(errors="replace")  # type: ignore[attr-defined]


def wait_titan(proc: subprocess.Popen, marker: str, out: Path, timeout: float = 300) -> Launch:
    """Wait for a started launch; on timeout kill it all and fail with its log."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_titan(proc, marker)
        raise AssertionError(f"torchtitan did not finish in {timeout:.0f} s:\n{read_log(proc)[-6000:]}") from None
    finally:
        kill_launch([proc], marker)  # a rank torchrun left behind
        if proc.poll() is None:
            proc.wait()
    return Launch(Path(out), proc.returncode, read_log(proc), time.monotonic() - proc.titan_started)


def launch_titan(out: Path, args: list[str], *, ranks: int = 2, env: dict | None = None,
                 timeout: float = 300) -> Launch:
    """One torchrun of torchtitan to the end; ``Launch(out, returncode, log, seconds)``."""
    proc, marker = start_titan(out, args, ranks=ranks, env=env)
    try:
        return wait_titan(proc, marker, out, timeout)
    except BaseException:
        kill_launch([proc], marker)
        raise


def records(out: Path, rank: int = 0) -> list[dict]:
    """Every record line rank ``rank`` wrote, in order (across relaunches into the same ``out``)."""
    path = Path(out) / "record" / f"losses-rank{rank}.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by SIGKILL (fsynced whole lines otherwise)
            continue
    return rows


def losses(out: Path, rank: int = 0) -> list[tuple[int, str]]:
    """``[(step, float.hex(global avg loss)), ...]`` in record order; a resumed run repeats steps."""
    return [(row["step"], row["loss"]) for row in records(out, rank)]


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, *, timeout: float = 300, rank: int = 0,
                  since: int = 0) -> None:
    """Block until rank ``rank`` has recorded ``step`` (in records after the first ``since``); fail if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(row["step"] >= step for row in records(out, rank)[since:]):
            return
        if proc.poll() is not None:
            raise AssertionError(f"torchtitan exited {proc.returncode} before step {step}:\n{read_log(proc)[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout:.0f} s:\n{read_log(proc)[-6000:]}")


def checkpoint_steps(folder: Path) -> list[int]:
    """Steps with a complete DCP checkpoint (``step-N/.metadata``) in torchtitan's checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        if entry.name.startswith("step-") and (entry / ".metadata").exists():
            steps.append(int(entry.name.split("-", 1)[1]))
    return sorted(steps)
