"""A hostile run directory: pickle payloads, digest-consistent forgeries and malicious safetensors headers.

The payload is a pickle whose unpickling creates a marker file. It replaces
each file of a generation (and the ``latest`` pointer) one at a time and all at
once, is embedded in otherwise valid files, and is sealed in with recomputed
digests the way an attacker who can write the directory would. Restore and
every CLI command (in process and as real processes) must never create the
marker, and each must end in a fallback or a clear error: a
:class:`TrainStateError` in Python, exit status 1 and no traceback on the
command line. A second group proves the unpickling entry points are never
called at all, and a third throws malformed safetensors headers at the strict
reader under a memory limit.
"""

from __future__ import annotations

import _pickle
import builtins
import contextlib
import copy
import io
import json
import pathlib
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import trainer
import trainstate as ts
from trainstate import cli
from trainstate.format import tensorfile
from trainstate.format.digest import digest_bytes, new_hasher

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

G1, G2, G3 = (f"gen-{u:012d}" for u in (1, 2, 3))
MANIFEST, STATE, TENSORS, POINTER = "manifest.json", "state.json", "tensors.safetensors", "latest"
GEN_FILES = (MANIFEST, STATE, TENSORS)
CONSOLE_SCRIPT = Path(sys.executable).with_name("trainstate")
TRAINSTATE = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "trainstate"]


# --- the payload -------------------------------------------------------------------------------


class _TouchMarker:
    """Pickles to a call of ``pathlib.Path.touch(marker)``: stdlib only, so it runs in any process."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def payload(marker: Path, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    return pickle.dumps(_TouchMarker(marker), protocol=protocol)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_payload_is_live(tmp_path, protocol):
    """Negative control: unpickling the payload does create the marker, so its absence below means something."""
    marker = tmp_path / "MARKER"
    pickle.loads(payload(marker, protocol))
    assert marker.exists()


# --- the directory -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("pristine") / "run"
    state = trainer.build(seed=0)
    saved = {}
    with ts.CheckpointManager(root, keep_last=5) as ckpt:
        for _ in range(3):
            trainer.step(state)
            ckpt.save(state)
            saved[f"gen-{state.next_update:012d}"] = copy.deepcopy(trainer.full_state(state))
    return root, saved


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(pristine[0], root, symlinks=True)
    return root


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "the pickle payload ran"


def reseal(run: Path, generation: str) -> None:
    """Recompute the generation's manifest records and the pointer, as an attacker with write access would."""
    gen = run / generation
    manifest = json.loads((gen / MANIFEST).read_bytes())
    algorithm = manifest["digest_algorithm"]
    for record in manifest["files"]:
        data = (gen / record["name"]).read_bytes()
        hasher = new_hasher(algorithm)
        hasher.update(data)
        record.update(size=len(data), digest=hasher.hexdigest())
        if hasattr(hasher, "chunks"):  # a chunked digest: the chunk digests too: each is checked on its own
            record["chunks"] = list(hasher.chunks)
    # the self-digest too, so the edit reaches the layers behind the manifest
    body = {k: v for k, v in manifest.items() if k not in ("self_digest", "signature")}
    manifest["self_digest"] = digest_bytes(algorithm, json.dumps(body, indent=1, sort_keys=True).encode())
    data = json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
    (gen / MANIFEST).write_bytes(data)
    seal_pointer(run, generation)


def seal_pointer(run: Path, generation: str) -> None:
    pointer = json.loads((run / POINTER).read_bytes())
    if pointer["generation"] == generation:
        data = (run / generation / MANIFEST).read_bytes()
        pointer.update(manifest_digest=digest_bytes(pointer["digest_algorithm"], data), manifest_size=len(data))
        (run / POINTER).write_bytes(json.dumps(pointer).encode())


def restore_outcome(run: Path, state: ts.TrainState | None = None) -> ts.RestoreInfo | ts.TrainStateError:
    """What restore did: the RestoreInfo of a fallback, or the TrainStateError it raised (anything else escapes)."""
    state = state or trainer.build(seed=777)
    try:
        with ts.CheckpointManager(run) as ckpt:
            return ckpt.restore(state)
    except ts.TrainStateError as exc:
        return exc


def cli_run(capsys, *argv: str) -> tuple[int, str]:
    """Run the CLI in process; it must return an exit status, never raise."""
    capsys.readouterr()
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- pickle in place of each file --------------------------------------------------------------


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("target", GEN_FILES + (POINTER,))
def test_pickle_in_place_of_one_file(run, pristine, marker, capsys, target, protocol):
    (run / POINTER if target == POINTER else run / G3 / target).write_bytes(payload(marker, protocol))
    state = trainer.build(seed=777)
    info = restore_outcome(run, state)
    assert isinstance(info, ts.RestoreInfo), info
    if target == POINTER:
        assert info.generation.name == G3 and [r.generation for r in info.rejected] == [POINTER]
    else:
        assert info.generation.name == G2 and [r.generation for r in info.rejected] == [G3]
        assert target in info.rejected[0].reason
    trainer.assert_same(pristine[1][info.generation.name], trainer.full_state(state))

    rc, out = cli_run(capsys, "ls", str(run))
    assert rc == 0 and ("INVALID" in out)
    rc, out = cli_run(capsys, "verify", str(run))
    assert rc == 1 and "FAILED" in out
    rc, out = cli_run(capsys, "inspect", str(run / G3))
    assert rc == (0 if target == POINTER else 1)
    rc, out = cli_run(capsys, "inspect", str(run), "--json")
    assert rc == (0 if target == POINTER else 1) and json.loads(out)


def _replace_everything(run: Path, marker: Path, generations: tuple[str, ...]) -> None:
    for generation in generations:
        for name in GEN_FILES:
            (run / generation / name).write_bytes(payload(marker))
    (run / POINTER).write_bytes(payload(marker))


@pytest.mark.parametrize("generations", [(G3,), (G3, G2, G1)], ids=["latest", "all"])
def test_pickle_in_place_of_everything(run, marker, capsys, generations):
    _replace_everything(run, marker, generations)
    state = trainer.build(seed=777)
    before = params_of(state["model"])
    outcome = restore_outcome(run, state)
    if len(generations) == 1:
        assert isinstance(outcome, ts.RestoreInfo) and outcome.generation.name == G2
        assert [r.generation for r in outcome.rejected] == [POINTER, G3]
    else:
        assert isinstance(outcome, ts.NoValidGeneration)
        assert [r.generation for r in outcome.rejections] == [POINTER, G3, G2, G1]
        trainer.assert_same(before, params_of(state["model"]))  # nothing was loaded
    for argv, expected in ((["ls", str(run)], 0), (["ls", "--full", str(run)], 0), (["verify", str(run)], 1),
                           (["inspect", str(run / G3)], 1), (["inspect", str(run)], 1),
                           (["inspect", "--json", str(run / G3)], 1)):
        rc, out = cli_run(capsys, *argv)
        assert rc == expected, (argv, out)


RESTORE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[2])
import trainer, trainstate as ts
try:
    with ts.CheckpointManager(sys.argv[1]) as ckpt:
        info = ckpt.restore(trainer.build(seed=777))
    print("restored", info.generation.name)
except ts.TrainStateError as exc:
    print("error", type(exc).__name__)
    sys.exit(1)
"""


def test_pickle_everywhere_in_real_processes(run, marker):
    """Fresh interpreters, the real entry points: exit status 1 and a message, never a traceback or the marker."""
    _replace_everything(run, marker, (G3, G2, G1))
    commands = {
        "restore": ([sys.executable, "-c", RESTORE_SCRIPT, str(run), str(Path(__file__).parent)], 1),
        "ls": (TRAINSTATE + ["ls", str(run)], 0),
        "verify": (TRAINSTATE + ["verify", str(run)], 1),
        "inspect-gen": (TRAINSTATE + ["inspect", str(run / G3)], 1),
        "inspect-dir": ([sys.executable, "-m", "trainstate", "inspect", "--json", str(run)], 1),
    }
    procs = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run.parent)
             for name, (argv, _) in commands.items()}
    outputs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        outputs[name] = out + err
        assert proc.returncode == commands[name][1], (name, out, err)
        assert "Traceback" not in out + err, (name, err)
    assert "error NoValidGeneration" in outputs["restore"]
    assert "INVALID" in outputs["ls"] and f"FAILED  {G1}" in outputs["verify"]
    assert G3 in outputs["inspect-gen"] and json.loads(outputs["inspect-dir"])["type"] == "CorruptGeneration"


# --- pickle inside otherwise valid files -------------------------------------------------------


class Blob:
    """A component whose state carries the payload as tensor bytes, as bytes, and as text."""

    def __init__(self, data: bytes = b""):
        self.data = data

    def state_dict(self) -> dict:
        return {"tensor": torch.frombuffer(bytearray(self.data), dtype=torch.uint8),
                "bytes": self.data, "text": self.data.decode("latin-1")}

    def load_state_dict(self, saved: dict) -> None:
        assert saved["tensor"].numpy().tobytes() == saved["bytes"] == saved["text"].encode("latin-1")
        self.data = saved["bytes"]


def _blob_state(data: bytes, contract_note: str) -> ts.TrainState:
    model = torch.nn.Linear(3, 2)
    return ts.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()), blob=Blob(data),
                         contract={"note": contract_note})


def test_pickle_embedded_in_valid_generation(tmp_path, marker, capsys):
    data = payload(marker)
    state = _blob_state(data, data.decode("latin-1"))
    state.facts["note"] = data.decode("latin-1")
    state.next_update = 1
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.save(state)
    generation = tmp_path / "run" / "gen-000000000001"
    assert data in (generation / TENSORS).read_bytes(), "the payload should sit raw in the tensor data"
    fresh = _blob_state(b"", data.decode("latin-1"))
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        info = ckpt.restore(fresh)
    assert info.generation.name == generation.name
    assert fresh["blob"].data == data and fresh.facts["note"] == data.decode("latin-1")
    for argv in (["ls", "--full", str(generation.parent)], ["verify", str(generation.parent)],
                 ["inspect", str(generation)], ["inspect", "--json", str(generation)]):
        rc, out = cli_run(capsys, *argv)
        assert rc == 0, (argv, out)


@pytest.mark.parametrize("target", GEN_FILES)
def test_pickle_sealed_in_with_valid_digests(run, marker, capsys, target):
    """An attacker who recomputes the digests: restore falls back or raises a clear error, nothing is loaded."""
    (run / G3 / target).write_bytes(payload(marker))
    if target == MANIFEST:
        seal_pointer(run, G3)
    else:
        reseal(run, G3)
    state = trainer.build(seed=777)
    before = params_of(state["model"])
    outcome = restore_outcome(run, state)
    if isinstance(outcome, ts.RestoreInfo):
        assert outcome.generation.name == G2
    else:
        assert isinstance(outcome, ts.CorruptGeneration) and G3 in str(outcome)
        trainer.assert_same(before, params_of(state["model"]))
    rc, out = cli_run(capsys, "inspect", str(run / G3))
    assert rc == 1 and G3 in out
    for argv in (["ls", str(run)], ["verify", str(run)]):
        rc, out = cli_run(capsys, *argv)
        assert rc in (0, 1), out


# --- the unpickling entry points are never called ----------------------------------------------


FORBIDDEN = [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (pickle, "_loads"), (pickle, "_load"),
             (pickle, "_Unpickler"), (_pickle, "loads"), (_pickle, "load"), (_pickle, "Unpickler"),
             (torch, "load"), (torch.serialization, "load"), (builtins, "eval")]


def test_no_unpickling_or_eval_on_the_happy_path(run, pristine, capsys, monkeypatch):
    calls: list[str] = []

    def forbidden(name):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called")
        return refuse

    for module, attr in FORBIDDEN:
        monkeypatch.setattr(module, attr, forbidden(f"{module.__name__}.{attr}"))
    state = trainer.build(seed=777)
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state)
    assert info.generation.name == G3 and info.rejected == ()
    trainer.assert_same(pristine[1][G3], trainer.full_state(state))
    for argv in (["ls", str(run)], ["ls", "--full", "--json", str(run)], ["verify", str(run)],
                 ["verify", "--json", str(run / G2)], ["inspect", str(run / G3)], ["inspect", "--json", str(run)]):
        rc, out = cli_run(capsys, *argv)
        assert rc == 0, (argv, out)
    assert calls == []


def test_forbidden_patch_is_effective(monkeypatch, tmp_path):
    """Negative control: with the same patch, an unpickling load is caught."""
    monkeypatch.setattr(torch.serialization, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("load")))
    monkeypatch.setattr(torch, "load", torch.serialization.load)
    torch.save({"x": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(AssertionError):
        torch.load(tmp_path / "x.pt")


# --- hostile safetensors headers ---------------------------------------------------------------

HEADROOM = 1 << 30  # address space allowed beyond what the process already maps
TRACED_LIMIT = 256 << 20  # Python-level peak; metadata reads allocate their 64 MiB cap up front


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


@contextlib.contextmanager
def bounded_memory():
    """Fail any allocation beyond HEADROOM of address space; afterwards check the traced Python peak."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + HEADROOM
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the address-space hard limit is too low for this check")
    tracemalloc.start()
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < TRACED_LIMIT, f"peak Python allocation {peak:,} bytes"


def test_memory_bound_catches_huge_allocations():
    """Negative control for bounded_memory."""
    with pytest.raises((MemoryError, RuntimeError)):
        with bounded_memory():
            torch.empty(4 << 30, dtype=torch.uint8).fill_(1)
    with pytest.raises(AssertionError, match="peak Python allocation"):
        with bounded_memory():
            bytearray(TRACED_LIMIT + 1)


def st_bytes(header: object, data: bytes = b"", *, length: int | None = None, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def one(dtype: str, shape: list, offsets: list, **extra) -> dict:
    return {"x": {"dtype": dtype, "shape": shape, "data_offsets": offsets, **extra}}


HOSTILE_HEADERS = {
    "length-2**63": st_bytes(one("U8", [4], [0, 4]), b"abcd", length=2**63),
    "length-all-ones (negative as int64)": st_bytes(one("U8", [4], [0, 4]), b"abcd", length=2**64 - 1),
    "length-just-past-end": st_bytes(one("U8", [4], [0, 4]), b"abcd", length=1000),
    "shorter-than-length-prefix": b"\x08\x00\x00",
    "header-not-json": st_bytes(None, b"abcd", raw=b"\x80\x05not json at all"),
    "header-not-utf8": st_bytes(None, b"abcd", raw=b'{"\xff\xfe": 1}'),
    "header-json-list": st_bytes([1, 2, 3]),
    "header-deeply-nested": st_bytes(None, raw=b"[" * 100_000 + b"]" * 100_000),
    "header-huge-int-literal": st_bytes(None, b"abcd", raw=b'{"x": {"dtype": "U8", "shape": [' + b"9" * 5000
                                        + b'], "data_offsets": [0, 4]}}'),
    "offsets-overlapping": st_bytes({**one("U8", [8], [0, 8]), "y": {"dtype": "U8", "shape": [8],
                                                                      "data_offsets": [4, 12]}}, b"\0" * 12),
    "offsets-gap": st_bytes({**one("U8", [4], [0, 4]), "y": {"dtype": "U8", "shape": [4],
                                                             "data_offsets": [8, 12]}}, b"\0" * 12),
    "offsets-past-end": st_bytes(one("U8", [1024], [0, 1024]), b"abcd"),
    "offsets-reversed": st_bytes(one("U8", [0], [4, 0]), b"abcd"),
    "offsets-negative": st_bytes(one("U8", [4], [-4, 0]), b"abcd"),
    "offsets-huge": st_bytes(one("U8", [2**62], [0, 2**62]), b"abcd"),
    "shape-absurd": st_bytes(one("F32", [2**40, 2**40], [0, 4]), b"abcd"),
    "shape-absurd-consistent-offsets": st_bytes(one("U8", [2**30, 2**30], [0, 2**60]), b"abcd"),
    "shape-negative": st_bytes(one("U8", [-1, -4], [0, 4]), b"abcd"),
    "shape-float": st_bytes(one("U8", [4.0], [0, 4]), b"abcd"),
    "shape-not-list": st_bytes(one("U8", 4, [0, 4]), b"abcd"),
    "dtype-unknown": st_bytes(one("F128", [1], [0, 16]), b"\0" * 16),
    "dtype-torch-name": st_bytes(one("torch.float32", [1], [0, 4]), b"abcd"),
    "dtype-null": st_bytes(one(None, [4], [0, 4]), b"abcd"),
    "entry-extra-key": st_bytes(one("U8", [4], [0, 4], exec="print(1)"), b"abcd"),
    "entry-not-object": st_bytes({"x": [0, 4]}, b"abcd"),
    "metadata-not-object": st_bytes({"__metadata__": ["pt"], **one("U8", [4], [0, 4])}, b"abcd"),
    "metadata-raw-dtype-not-a-dtype": st_bytes(
        {"__metadata__": {"trainstate.raw_dtypes": json.dumps({"x": ["load", [4]]})}, **one("U8", [4], [0, 4])},
        b"abcd"),
    "metadata-raw-dtype-size-mismatch": st_bytes(
        {"__metadata__": {"trainstate.raw_dtypes": json.dumps({"x": ["float64", [2**40]]})},
         **one("U8", [8], [0, 8])}, b"\0" * 8),
    "metadata-raw-dtypes-not-json": st_bytes(
        {"__metadata__": {"trainstate.raw_dtypes": "\x80\x05pickle"}, **one("U8", [4], [0, 4])}, b"abcd"),
}


@pytest.mark.parametrize("data", HOSTILE_HEADERS.values(), ids=HOSTILE_HEADERS.keys())
def test_hostile_header_is_corrupt_generation(data):
    with bounded_memory():
        with pytest.raises(ts.CorruptGeneration):
            tensorfile.parse_header(io.BytesIO(data), len(data), "hostile.safetensors")


@pytest.mark.parametrize("declared_size", [2**62, 8, 0])
def test_header_checked_against_declared_size(declared_size):
    """``inspect`` reads headers with the size an unverified manifest declares: a lie must not matter."""
    data = st_bytes(one("U8", [4], [0, 4]), b"abcd")
    with bounded_memory():
        with pytest.raises(ts.CorruptGeneration):
            tensorfile.parse_header(io.BytesIO(data), declared_size, "hostile.safetensors")


def test_hostile_header_with_very_long_shape_is_rejected_quickly():
    data = st_bytes(one("U8", [2**61] * 30_000, [0, 4]), b"abcd")
    start = time.perf_counter()
    with pytest.raises(ts.CorruptGeneration):
        tensorfile.parse_header(io.BytesIO(data), len(data), "hostile.safetensors")
    assert time.perf_counter() - start < 1.0


def _rewrite_header(path: Path, mutate) -> None:
    data = path.read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:start])
    names = [k for k in header if k != "__metadata__"]
    mutate(header, names)
    path.write_bytes(st_bytes(header) + data[start:])


def _set(entry: str, **fields):
    return lambda header, names: header[names[0] if entry == "first" else names[-1]].update(fields)


END_TO_END = {
    "length-2**63": lambda p: p.write_bytes(struct.pack("<Q", 2**63) + p.read_bytes()[8:]),
    "length-all-ones": lambda p: p.write_bytes(b"\xff" * 8 + p.read_bytes()[8:]),
    "header-not-json": lambda p: p.write_bytes(p.read_bytes()[:8] + b"\x80" + p.read_bytes()[9:]),
    "offsets-overlapping": lambda p: _rewrite_header(
        p, lambda h, n: h[n[1]].update(data_offsets=h[n[0]]["data_offsets"], shape=h[n[0]]["shape"],
                                       dtype=h[n[0]]["dtype"])),
    "offsets-past-end": lambda p: _rewrite_header(
        p, lambda h, n: h[n[-1]].update(dtype="U8", shape=[h[n[-1]]["data_offsets"][1] + 4096
                                                           - h[n[-1]]["data_offsets"][0]],
                                        data_offsets=[h[n[-1]]["data_offsets"][0],
                                                      h[n[-1]]["data_offsets"][1] + 4096])),
    "shape-absurd": lambda p: _rewrite_header(p, _set("first", shape=[2**40, 2**40])),
    "dtype-unknown": lambda p: _rewrite_header(p, _set("first", dtype="F128")),
}


@pytest.mark.parametrize("damage", END_TO_END.values(), ids=END_TO_END.keys())
def test_hostile_header_sealed_into_latest(run, capsys, damage):
    """Digest-consistent hostile headers reach the reader: a clear error or a fallback, nothing loaded."""
    damage(run / G3 / TENSORS)
    reseal(run, G3)
    state = trainer.build(seed=777)
    before = params_of(state["model"])
    with bounded_memory():
        outcome = restore_outcome(run, state)
        rc, out = cli_run(capsys, "inspect", str(run / G3))
    if isinstance(outcome, ts.RestoreInfo):
        assert outcome.generation.name == G2
    else:
        assert isinstance(outcome, ts.CorruptGeneration) and TENSORS in str(outcome)
        trainer.assert_same(before, params_of(state["model"]))
    assert rc == 1 and G3 in out


# --- hostile state.json with valid digests -----------------------------------------------------

def _facts(value):
    return lambda state: state.update(facts={"x": value})


def _drop(*keys):
    def mutate(state):
        for key in keys:
            del state[key]
    return mutate


def _facts_raw(text: str):
    """JSON text too hostile to build with json.dumps, spliced in after serialisation."""
    def mutate(state):
        state["facts"] = {"x": "@@RAW@@"}
        return text
    return mutate


HOSTILE_STATES = {
    "np-int-overflow": pytest.param(_facts({"$np": ["<i8", 2**70]})),
    "np-void-2GiB": pytest.param(_facts({"$np": ["V1", 2**31 - 1]})),
    "np-void-too-large": pytest.param(_facts({"$np": ["V1", 10**12]})),
    "int-too-many-digits": pytest.param(_facts({"$int": "9" * 5000})),
    "unknown-float": pytest.param(_facts({"$float": "__import__('os')"})),
    "dtype-not-a-dtype": pytest.param(_facts({"$dtype": "load"})),
    "bytes-not-base64": pytest.param(_facts({"$bytes": "\x80\x05"})),
    "dangling-tensor-reference": pytest.param(_facts({"$t": "no.such.tensor"})),
    "deeply-nested": pytest.param(_facts_raw("[" * 100_000 + "]" * 100_000)),
    "missing-sections": pytest.param(_drop("contract", "components", "clocks")),
    "contract-fields-a-list": pytest.param(lambda s: s.update(contract={"fields": []})),
}


@pytest.mark.parametrize("mutate", HOSTILE_STATES.values(), ids=HOSTILE_STATES.keys())
def test_hostile_state_json_sealed_into_latest(run, mutate):
    state_json = json.loads((run / G3 / STATE).read_bytes())
    raw = mutate(state_json)
    text = json.dumps(state_json)
    (run / G3 / STATE).write_bytes((text.replace('"@@RAW@@"', raw) if raw else text).encode())
    reseal(run, G3)
    live = trainer.build(seed=777)
    before = params_of(live["model"])
    with bounded_memory():
        outcome = restore_outcome(run, live)
    if isinstance(outcome, ts.RestoreInfo):
        assert outcome.generation.name == G2
    else:
        assert isinstance(outcome, ts.CorruptGeneration), repr(outcome)
        trainer.assert_same(before, params_of(live["model"]))




@pytest.mark.parametrize("content", [
    pytest.param({"format": "trainstate-state", "kind": "full"}, id="sections-missing"),
    pytest.param({"format": "trainstate-state", "kind": "full", "components": [1]}, id="components-a-list"),
    pytest.param({"format": "trainstate-state", "kind": "full", "contract": {"fields": []}},
                 id="contract-fields-a-list"),
    pytest.param({"format": "trainstate-state", "kind": "full", "components": {"m": {"state": {"$map": [[1]]}}}},
                 id="map-pair-malformed"),
])
def test_inspect_of_malformed_state_json_is_not_a_traceback(run, capsys, content):
    (run / G3 / STATE).write_bytes(json.dumps(content).encode())
    rc, _ = cli_run(capsys, "inspect", str(run / G3))
    assert rc in (0, 1)
    rc, out = cli_run(capsys, "inspect", "--json", str(run / G3))
    assert rc in (0, 1) and json.loads(out)
