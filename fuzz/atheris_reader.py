"""Coverage-guided fuzzing of trainstate's untrusted-input parsers with atheris (libFuzzer).

Not part of CI (``tests/test_fuzz.py`` is the CI fuzzer). The first byte of
each input picks a target, the rest is what it reads:

====  ==========================================================================
0     ``tensorfile.parse_header`` over the bytes, then ``read_tensor`` per entry
1     ``manifest.parse_manifest``
2     ``manifest.parse_pointer``
3     ``codec.decode`` of the bytes as JSON (what ``state.json`` holds)
====  ==========================================================================

A :class:`~trainstate.TrainStateError` is the expected way to refuse an input;
any other exception escaping is a crash and libFuzzer saves the input. (For
target 3 a ``RecursionError`` is allowed: ``verify.load_verified`` converts it,
``decode`` itself does not.)

Run it::

    pip install atheris
    python fuzz/atheris_reader.py --make-corpus fuzz/corpus     # seeds from a tiny saved generation
    python fuzz/atheris_reader.py fuzz/corpus -max_len=65536 -timeout=10 -rss_limit_mb=2048

Replay saved crashes without atheris (prints the exception)::

    python fuzz/atheris_reader.py --replay crash-<sha1> ...

The module imports without atheris installed; ``check_one`` is plain Python.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

TARGETS = ("parse_header", "parse_manifest", "parse_pointer", "codec.decode")


def check_one(data: bytes) -> None:
    """Feed one input to the target its first byte names; let only refusals pass."""
    from trainstate import TrainStateError
    from trainstate.format import codec, manifest, tensorfile

    import torch

    if not data:
        return
    target, body = TARGETS[data[0] % len(TARGETS)], data[1:]
    try:
        if target == "parse_header":
            stream = io.BytesIO(body)
            layout = tensorfile.parse_header(stream, len(body), "fuzz")
            for entry in layout.entries:
                tensorfile.read_tensor(stream, layout, entry, "fuzz")
        elif target == "parse_manifest":
            manifest.parse_manifest(body, "fuzz")
        elif target == "parse_pointer":
            manifest.parse_pointer(body, "fuzz")
        else:
            try:
                tree = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                return  # load_json refuses these before decode is reached
            tensors = {"t": torch.ones(2, 3), "u8": torch.zeros(4, dtype=torch.uint8)}
            try:
                codec.decode(tree, "fuzz", tensors)
            except RecursionError:
                pass
    except TrainStateError:
        pass


def make_corpus(directory: Path) -> list[Path]:
    """Write one seed per target from a freshly saved two-tensor generation."""
    import tempfile

    import torch

    import trainstate as ts

    directory.mkdir(parents=True, exist_ok=True)
    model = torch.nn.Linear(3, 2)
    state = ts.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()), capture_global_rngs=False)
    state.next_update = 1
    with tempfile.TemporaryDirectory() as tmp:
        with ts.CheckpointManager(tmp) as ckpt:
            ckpt.save(state)
        gen = Path(tmp) / "gen-000000000001"
        sources = [gen / "tensors.safetensors", gen / "manifest.json", Path(tmp) / "latest", gen / "state.json"]
        written = []
        for index, source in enumerate(sources):
            path = directory / f"seed-{TARGETS[index]}"
            path.write_bytes(bytes([index]) + source.read_bytes())
            written.append(path)
    return written


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--make-corpus"]:
        for path in make_corpus(Path(argv[2] if len(argv) > 2 else "fuzz/corpus")):
            print(path)
        return
    if argv[1:2] == ["--replay"]:
        for name in argv[2:]:
            print(name, end=": ")
            check_one(Path(name).read_bytes())
            print("refused or accepted cleanly")
        return
    try:
        import atheris
    except ImportError:
        raise SystemExit("atheris is not installed: pip install atheris (this harness is not part of CI)") from None
    with atheris.instrument_imports(include=["trainstate"]):
        import trainstate.format.codec  # noqa: F401  (instrumented before check_one imports them)
        import trainstate.format.manifest  # noqa: F401
        import trainstate.format.tensorfile  # noqa: F401
    atheris.Setup(argv, check_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
