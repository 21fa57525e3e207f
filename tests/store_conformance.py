"""The storage contract: behaviour every :class:`trainstate.storage.base.Store` backend must show.

In the style of fsspec's abstract tests: the test classes here hold no
fixtures of their own. A backend's test module subclasses :class:`StoreConformance`
and supplies two fixtures:

- ``store``: a fresh, empty store at a new location;
- ``reopen``: a function returning a second, independent handle to the same
  location (another process's view, for the lock and for crash recovery).

Everything is checked through the protocol's own methods, so the same suite
runs against the local filesystem, an object store, and the multi-rank commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from trainstate.errors import DirectoryLocked, GenerationExists
from trainstate.format.digest import ALGORITHMS, digest_bytes
from trainstate.format.manifest import generation_name
from trainstate.storage.base import Store

Reopen = Callable[[Store], Store]


def publish(store: Store, name: str, files: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """Stage and commit a generation holding ``files``; returns them."""
    files = files if files is not None else {"a.bin": name.encode() * 3, "b.json": b'{"x": 1}'}
    staging = store.begin(name)
    for file, data in files.items():
        staging.write(file, [data])
    staging.commit()
    return files


def read(store: Store, generation: str, file: str) -> bytes:
    with store.open(generation, file) as stream:
        return stream.read()


class StoreConformance:
    """Subclass in a backend's test module and provide the ``store`` and ``reopen`` fixtures."""

    # writing and reading back ---------------------------------------------------
    def test_write_returns_size_and_digest_of_the_bytes(self, store: Store):
        staging = store.begin(generation_name(1))
        chunks = [b"abc", memoryview(b"defgh"), b"", bytes(range(256)) * 4]
        record = staging.write("data.bin", chunks)
        stable = staging.write("stable.bin", [b"x" * 5000], stable=True)
        staging.commit()
        whole = b"".join(bytes(c) for c in chunks)
        assert (record.name, record.size) == ("data.bin", len(whole))
        assert record.digest == digest_bytes(store.digest_algorithm, whole)
        assert stable.size == 5000 and stable.digest == digest_bytes(store.digest_algorithm, b"x" * 5000)
        assert read(store, generation_name(1), "data.bin") == whole
        assert store.files(generation_name(1)) == {"data.bin": len(whole), "stable.bin": 5000}

    def test_many_small_chunks_and_one_large_one(self, store: Store):
        chunks = [bytes([i % 251]) * (i % 7) for i in range(3000)] + [b"L" * (5 << 20)]
        staging = store.begin(generation_name(2))
        record = staging.write("t.bin", chunks)
        staging.commit()
        whole = b"".join(chunks)
        assert record.size == len(whole) and read(store, generation_name(2), "t.bin") == whole

    # staging is invisible ---------------------------------------------------------
    def test_a_linked_file_is_the_same_bytes_and_outlives_its_source(self, store: Store):
        """``link`` stages a committed file under a new generation without writing it (or declines with None,
        and the caller writes it); either way the new generation reads the same bytes, also after the source
        generation is removed, and aborting a staging area that linked a file leaves the source intact."""
        source = generation_name(1)
        staging = store.begin(source)
        record = staging.write("part.safetensors", [b"unchanged bytes " * 1000])
        staging.commit()
        aborted = store.begin(generation_name(2))
        linked_once = aborted.link("part.safetensors", source, record)
        aborted.abort()
        assert read(store, source, "part.safetensors") == b"unchanged bytes " * 1000
        staging = store.begin(generation_name(3))
        linked = staging.link("part.safetensors", source, record)
        assert linked in (None, record) and (linked is None) == (linked_once is None)
        if linked is None:
            linked = staging.write("part.safetensors", [b"unchanged bytes " * 1000])
        staging.commit()
        assert (linked.size, linked.digest) == (record.size, record.digest)
        store.remove(source)
        assert read(store, generation_name(3), "part.safetensors") == b"unchanged bytes " * 1000
        missing = store.begin(generation_name(4))
        assert missing.link("part.safetensors", source, record) is None  # a removed source: write it instead
        missing.abort()

    def test_staging_is_invisible_to_readers_until_commit(self, store: Store, reopen: Reopen):
        name = generation_name(5)
        staging = store.begin(name)
        staging.write("a.bin", [b"partial"])
        other = reopen(store)
        for view in (store, other):
            assert view.generations() == []
            assert name not in view.generations()
        staging.commit()
        assert store.generations() == [name] and other.generations() == [name]

    def test_abort_leaves_nothing_visible_and_no_leftover(self, store: Store):
        staging = store.begin(generation_name(3))
        staging.write("a.bin", [b"data"])
        staging.abort()
        staging.abort()  # safe to call twice
        assert store.generations() == [] and store.leftovers() == []

    def test_failed_write_then_abort_publishes_nothing(self, store: Store):
        def chunks():
            yield b"first"
            raise OSError(5, "injected")

        staging = store.begin(generation_name(4))
        with pytest.raises(OSError, match="injected"):
            staging.write("a.bin", chunks())
        staging.abort()
        assert store.generations() == []

    # commit -------------------------------------------------------------------------
    def test_commit_makes_every_file_visible_at_once(self, store: Store, reopen: Reopen):
        files = publish(store, generation_name(7), {f"f{i}.bin": bytes([i]) * (i + 1) for i in range(5)})
        view = reopen(store)
        assert view.files(generation_name(7)) == {n: len(d) for n, d in files.items()}
        for file, data in files.items():
            assert read(view, generation_name(7), file) == data

    def test_commit_never_overwrites_a_published_generation(self, store: Store):
        original = publish(store, generation_name(8))
        staging = store.begin(generation_name(8))
        staging.write("a.bin", [b"impostor"])
        with pytest.raises(GenerationExists):
            staging.commit()
        staging.abort()
        assert read(store, generation_name(8), "a.bin") == original["a.bin"]
        assert store.files(generation_name(8)) == {n: len(d) for n, d in original.items()}

    def test_interrupted_staging_is_a_leftover_for_the_next_handle(self, store: Store, reopen: Reopen):
        staging = store.begin(generation_name(9))
        staging.write("a.bin", [b"written before the crash"])
        # the writer dies here: no commit, no abort
        recovered = reopen(store)
        assert recovered.generations() == []
        names = recovered.leftovers()
        assert len(names) == 1
        assert recovered.clean_leftovers() == names
        assert recovered.leftovers() == [] and recovered.generations() == []

    def test_cleaning_leftovers_spares_generations_and_foreign_entries(self, store: Store, reopen: Reopen):
        publish(store, generation_name(10))
        store.begin(generation_name(11)).write("a.bin", [b"x"])
        store.write_pointer("latest", b"pointer bytes")
        view = reopen(store)
        removed = view.clean_leftovers()
        assert len(removed) == 1
        assert view.generations() == [generation_name(10)]
        assert view.read_pointer("latest") == b"pointer bytes"
        assert read(view, generation_name(10), "a.bin") == generation_name(10).encode() * 3

    def test_another_handle_joins_a_staging_area_and_one_commit_publishes_both(self, store: Store, reopen: Reopen):
        first = store.begin(generation_name(13))
        second = reopen(store).join(generation_name(13), first.name)
        second.write("rank-1.bin", [b"from the other rank"])
        first.write("rank-0.bin", [b"from rank 0"])
        assert store.generations() == []  # still staged: invisible
        first.commit()
        assert read(store, generation_name(13), "rank-1.bin") == b"from the other rank"
        assert store.files(generation_name(13)) == {"rank-0.bin": 11, "rank-1.bin": 19}

    def test_joining_a_staging_area_that_does_not_exist_fails(self, store: Store, reopen: Reopen):
        name = store.begin(generation_name(14)).name
        with pytest.raises((FileNotFoundError, ValueError)):
            reopen(store).join(generation_name(14), name.replace(name[-4:], "0000"))

    # pointers --------------------------------------------------------------------------
    def test_pointer_absent_then_replaced_whole(self, store: Store, reopen: Reopen):
        assert store.read_pointer("latest") is None
        store.write_pointer("latest", b"first")
        store.write_pointer("latest", b"second, longer than the first")
        assert store.read_pointer("latest") == b"second, longer than the first"
        store.write_pointer("latest", b"3")
        assert reopen(store).read_pointer("latest") == b"3"

    def test_pointers_are_independent_and_not_generations(self, store: Store):
        store.write_pointer("latest", b"full")
        store.write_pointer("latest-weights", b"weights")
        assert store.read_pointer("latest") == b"full"
        assert store.read_pointer("latest-weights") == b"weights"
        assert store.generations() == [] and store.leftovers() == []

    def test_pointer_writes_leave_no_leftover(self, store: Store):
        for i in range(5):
            store.write_pointer("latest", str(i).encode())
        assert store.leftovers() == []

    # removal and set-aside -------------------------------------------------------------
    def test_remove_makes_the_generation_invisible(self, store: Store, reopen: Reopen):
        for update in (1, 2, 3):
            publish(store, generation_name(update))
        store.remove(generation_name(2))
        assert store.generations() == [generation_name(3), generation_name(1)]
        assert reopen(store).generations() == [generation_name(3), generation_name(1)]
        assert store.leftovers() == []
        assert read(store, generation_name(3), "a.bin") == generation_name(3).encode() * 3

    def test_deferred_removal_is_invisible_at_once_and_joined(self, store: Store, reopen: Reopen):
        store.defer_removals()
        for update in (1, 2):
            publish(store, generation_name(update))
        store.remove(generation_name(1))
        assert store.generations() == [generation_name(2)]  # gone for readers before the files are
        assert reopen(store).generations() == [generation_name(2)]
        assert store.join_removals(timeout=60) is True
        assert store.leftovers() == [] and reopen(store).leftovers() == []
        assert store.join_removals() is True  # nothing pending: returns at once
        publish(store, generation_name(1))  # the name is free again once removed
        assert store.generations() == [generation_name(2), generation_name(1)]

    def test_set_aside_keeps_the_files_out_of_sight(self, store: Store):
        files = publish(store, generation_name(4))
        publish(store, generation_name(5))
        aside = store.set_aside(generation_name(4), "rejected")
        assert aside != generation_name(4) and generation_name(4) in aside and "rejected" in aside
        assert store.generations() == [generation_name(5)]
        assert aside not in store.leftovers()
        store.clean_leftovers()
        assert read(store, aside, "a.bin") == files["a.bin"]  # the evidence survives cleanup

    def test_set_aside_twice_gives_distinct_names(self, store: Store):
        publish(store, generation_name(6))
        first = store.set_aside(generation_name(6), "abandoned")
        publish(store, generation_name(6))
        second = store.set_aside(generation_name(6), "abandoned")
        assert first != second and store.generations() == []

    def test_set_aside_entries_are_listed_as_evidence(self, store: Store, reopen: Reopen):
        publish(store, generation_name(20))
        publish(store, generation_name(21, "weights"))
        first = store.set_aside(generation_name(20), "rejected")
        second = store.set_aside(generation_name(21, "weights"), "superseded")
        assert reopen(store).aside() == sorted([first, second])
        assert store.leftovers() == [] and store.generations() == []

    def test_reinstate_puts_a_generation_back_and_never_over_another(self, store: Store):
        files = publish(store, generation_name(22))
        aside = store.set_aside(generation_name(22), "superseded")
        publish(store, generation_name(22), {"a.bin": b"replacement"})
        with pytest.raises(GenerationExists):
            store.reinstate(aside, generation_name(22))
        assert read(store, generation_name(22), "a.bin") == b"replacement"
        store.remove(generation_name(22))
        store.reinstate(aside, generation_name(22))
        assert store.aside() == [] and read(store, generation_name(22), "a.bin") == files["a.bin"]

    def test_a_removed_name_can_be_published_again(self, store: Store):
        publish(store, generation_name(12), {"a.bin": b"old"})
        store.remove(generation_name(12))
        publish(store, generation_name(12), {"a.bin": b"new"})
        assert read(store, generation_name(12), "a.bin") == b"new"

    # listing ------------------------------------------------------------------------------
    def test_listing_is_newest_first_by_parsed_update_number(self, store: Store):
        updates = [9, 10, 100, 2, 99, 1000]
        for update in updates:
            publish(store, generation_name(update))
        publish(store, generation_name(100, "weights"))
        listed = store.generations()
        assert listed[0] == generation_name(1000)
        full = [n for n in listed if not n.endswith("-weights")]
        assert full == [generation_name(u) for u in sorted(updates, reverse=True)]
        assert generation_name(100, "weights") in listed

    def test_listing_ignores_names_that_are_not_generations(self, store: Store):
        publish(store, generation_name(1))
        for name in ("gen-12", "gen-000000000002-full", "notes", "GEN-000000000003"):
            publish(store, name, {"a.bin": b"x"})
        store.write_pointer("gen-000000000004", b"a file, not a generation")
        assert store.generations() == [generation_name(1)]

    # the lock -----------------------------------------------------------------------------
    def test_lock_excludes_a_second_writer_until_released(self, store: Store, reopen: Reopen):
        other = reopen(store)
        store.lock()
        store.lock()  # re-entrant for the holder
        with pytest.raises(DirectoryLocked):
            other.lock()
        store.unlock()
        other.lock()
        with pytest.raises(DirectoryLocked):
            store.lock()
        other.unlock()
        store.lock()
        store.unlock()

    def test_reading_needs_no_lock(self, store: Store, reopen: Reopen):
        publish(store, generation_name(1))
        store.lock()
        try:
            view = reopen(store)
            assert view.generations() == [generation_name(1)]
            assert read(view, generation_name(1), "b.json") == b'{"x": 1}'
        finally:
            store.unlock()

    def test_exclusive_is_a_mutex(self, store: Store, reopen: Reopen):
        other = reopen(store)
        events: list[str] = []
        entered = threading.Event()

        def second() -> None:
            with other.exclusive("pins"):
                events.append("second")

        with store.exclusive("pins"):
            worker = threading.Thread(target=second)
            worker.start()
            entered.wait(0.3)
            time.sleep(0.2)
            events.append("first done")
        worker.join(10)
        assert events == ["first done", "second"]

    # space ----------------------------------------------------------------------------------
    def test_free_bytes_is_unknown_or_a_plausible_count(self, store: Store):
        free = store.free_bytes()
        assert free is None or (type(free) is int and free >= 0)

    def test_location_and_digest_algorithm_are_named(self, store: Store):
        assert isinstance(store.location, str) and store.location
        assert store.digest_algorithm in ALGORITHMS
