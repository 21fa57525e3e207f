"""LocalStore passes the storage conformance suite, and the suite fails broken backends."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from store_conformance import StoreConformance
from trainstate.storage.local import LocalStaging, LocalStore


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "run")

    @pytest.fixture
    def reopen(self):
        return lambda store: LocalStore(store.root)


# negative controls: each broken backend violates one clause, and the suite notices ---------------------
class LexicalOrder(LocalStore):
    def generations(self):
        return sorted((n for n in os.listdir(self.root) if n.startswith("gen-") and (self.root / n).is_dir()),
                      reverse=True)


class CreationOrder(LocalStore):
    """Newest first by time of creation, as a glob sorted by mtime would give."""

    def generations(self):
        names = [n for n in super().generations()]
        return sorted(names, key=lambda n: (self.root / n).stat().st_mtime_ns, reverse=True)


class VisibleStaging(LocalStaging):
    """Writes straight into the final directory: readers see a half-written generation."""

    def __init__(self, store, generation):
        self.generation, self._store, self._ops = generation, store, store.ops
        self.path = store.root / generation
        self._ops.mkdir(self.path)

    def commit(self):
        pass


class StagesInPlace(LocalStore):
    def begin(self, generation):
        return VisibleStaging(self, generation)


class OverwritingStaging(LocalStaging):
    def commit(self):
        final = self._store.root / self.generation
        shutil.rmtree(final, ignore_errors=True)
        os.rename(self.path, final)


class Overwrites(LocalStore):
    def begin(self, generation):
        return OverwritingStaging(self, generation)


class NoLock(LocalStore):
    def lock(self):
        pass


class SetAsideDeletes(LocalStore):
    def set_aside(self, generation, reason):
        self.remove(generation)
        return f"{generation}.{reason}-gone"


class BlindToLeftovers(LocalStore):
    def leftovers(self):
        return []


class HidesEvidence(LocalStore):
    def aside(self):
        return []


class ReinstatesOverAnother(LocalStore):
    def reinstate(self, aside, generation):
        shutil.rmtree(self.root / generation, ignore_errors=True)
        os.rename(self.root / aside, self.root / generation)


class JoinsAFreshArea(LocalStore):
    """Each rank stages apart: the files of the ranks that did not commit are never published."""

    def join(self, generation, staging):
        return self.begin(generation)


class PointerAppends(LocalStore):
    def write_pointer(self, name, data):
        with open(self.root / name, "ab") as f:
            f.write(data)


@pytest.mark.parametrize("broken, clause", [
    (CreationOrder, "test_listing_is_newest_first_by_parsed_update_number"),
    (LexicalOrder, "test_listing_ignores_names_that_are_not_generations"),
    (StagesInPlace, "test_staging_is_invisible_to_readers_until_commit"),
    (Overwrites, "test_commit_never_overwrites_a_published_generation"),
    (NoLock, "test_lock_excludes_a_second_writer_until_released"),
    (SetAsideDeletes, "test_set_aside_keeps_the_files_out_of_sight"),
    (BlindToLeftovers, "test_interrupted_staging_is_a_leftover_for_the_next_handle"),
    (PointerAppends, "test_pointer_absent_then_replaced_whole"),
    (HidesEvidence, "test_set_aside_entries_are_listed_as_evidence"),
    (JoinsAFreshArea, "test_another_handle_joins_a_staging_area_and_one_commit_publishes_both"),
    (ReinstatesOverAnother, "test_reinstate_puts_a_generation_back_and_never_over_another"),
])
def test_the_suite_fails_a_backend_that_breaks_the_contract(tmp_path, broken, clause):
    store = broken(tmp_path / "run")
    check = getattr(StoreConformance(), clause)
    with pytest.raises((AssertionError, pytest.fail.Exception, OSError, FileNotFoundError)):
        check(store, lambda s: broken(Path(s.root))) if "reopen" in check.__code__.co_varnames else check(store)
