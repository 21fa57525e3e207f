"""Multi-rank checkpoints on ``torch.distributed.checkpoint``, under a real ``torchrun`` with 2 gloo ranks on CPU.

Scenarios run in ``tests/dist_worker.py``; several share one launch (each
launch costs seconds). The round trips chain three launches: saved at world
size 2, restored at 1 (and saved there), restored at 2.
"""

from __future__ import annotations

import pytest
import torch

from distlaunch import launch

pytestmark = pytest.mark.slow

MAIN = ["roundtrip_save_ddp", "roundtrip_save_fsdp", "exact_resume", "bit_flip", "missing_file", "no_pickle", "replica_divergence",
        "existing_generation", "raised_faults", "background", "one_rank_refuses", "one_rank_refuses_control",
        "collectives", "groups_released", "preemption_agreed", "fsdp1_refusal"]
FAULTS = ["kill_rank1_write", "kill_rank0_rename", "hang_rank1_write"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    two = launch(root / "two", MAIN)
    one = launch(root / "one", ["roundtrip_load_ddp", "roundtrip_load_fsdp", "roundtrip_save_ddp",
                                "roundtrip_save_fsdp"], ranks=1, env={"TRAINSTATE_TEST_SOURCE": str(root / "two")})
    back = launch(root / "back", ["roundtrip_load_ddp", "roundtrip_load_fsdp"],
                  env={"TRAINSTATE_TEST_SOURCE": str(root / "one")})
    return {"two": two, "one": one, "back": back}


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    launched = {kind: launch(root / kind, ["fault"], env={"TRAINSTATE_TEST_FAULT": kind,
                                                          "TRAINSTATE_TEST_TIMEOUT": "6"}, monitor=5)
                for kind in FAULTS}
    followup = launch(root / "followup", ["fault_followup"], env={"TRAINSTATE_TEST_SOURCE": str(root)})
    return launched, followup


# 1. round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_round_trip_at_the_same_world_size_is_bitwise(runs, mode):
    for result in runs["two"].ok(f"roundtrip_save_{mode}"):
        assert result["differs"] == [] and result["identical"], result


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_resharding_to_another_world_size_is_exact_for_model_and_optimizer(runs, mode, direction):
    launched, ranks = (runs["one"], 1) if direction == "2->1" else (runs["back"], 2)
    for result in launched.ok(f"roundtrip_load_{mode}", ranks):
        assert result["refused_without_allow"] == ["world_size"], result  # ContractMismatch naming world_size
        assert result["differs"] == [], result  # full tensors, moments and step counts bitwise equal
        assert not result["identical"] and any("per-rank RNG" in w for w in result["warnings"]), result


def test_the_loader_continues_the_same_global_order_after_resharding(runs):
    # saved after 5 batches of 4 on each of 2 ranks: the 40 first samples of the epoch's global order are consumed
    assert runs["one"].ok("roundtrip_load_fsdp", 1)[0]["loader"] == [0, 0, 40]


def test_collectives_carry_small_and_large_values_exactly(runs):
    """One round when every value fits the room, a second when one (on one rank only) does not."""
    for result in runs["two"].ok("collectives"):
        assert all(result[k] for k in ("broadcast", "gather_small", "gather_mixed", "gather_edge", "to_rank0",
                                       "from_rank0", "failures", "sum", "bytes")), result


def test_close_destroys_the_managers_groups_with_or_without_an_exception(runs):
    """Three gloo groups per manager, destroyed by close (normal, or with SystemExit propagating on every rank,
    which runs no collective); control: a close that keeps them leaves three more."""
    for result in runs["two"].ok("groups_released"):
        assert result["counts"] == [0, 0, 0, 0] and result["control"] == 2, result
        assert result["threads"] == [0, 0, 0] and result["control_threads"], result  # joined, not just unnamed
        assert "CheckpointManager is closed" in result["closed"], result


def test_a_rank_that_refuses_before_fsdp1s_collectives_ends_every_rank_at_once(runs):
    """Rank 1's pending gradients under FSDP1: every rank raises within a second or two (rank 1 its own
    PendingGradients, rank 0 CheckpointFailed naming it); the control waits out FSDP's group timeout."""
    results = runs["two"].ok("fsdp1_refusal")
    assert [r["agreed"]["raised"] for r in results] == ["CheckpointFailed", "PendingGradients"], results
    assert all(r["agreed"]["seconds"] < 3.0 for r in results), results
    assert max(r["control"]["seconds"] for r in results) > 4.5, results  # the hang the agreement prevents


def test_a_preemption_signal_on_one_rank_saves_on_every_rank_at_the_same_boundary(runs):
    results = runs["two"].ok("preemption_agreed")
    assert [r["agreed"]["saved"] for r in results] == [4, 4] and not any(r["agreed"]["raised"] for r in results)
    assert all(r["restored"] == "gen-000000000004" for r in results), results
    control = [r["control"] for r in results]  # each rank's own flag: the ranks split and fail on timeouts
    assert control[1]["saved"] is None and all(c["raised"] for c in control), control


# 2. exact resume, with a negative control -------------------------------------------------------------------------
def test_exact_resume_at_world_size_2_and_each_ranks_streams(runs):
    for result in runs["two"].ok("exact_resume"):
        assert result["identical"] and result["full_differs"] == [], result
        assert result["rank_differs"] == [], result  # this rank's generator, global RNG, loader position, next ids


def test_a_restore_holds_its_share_and_a_lost_file_of_any_rank_is_found_before_loading(runs):
    """Each rank holds open its share of the files (and what it reads): not another rank's own files, where it
    held every file of the generation before (O(files) opens a rank, O(files x N) over the job). A shard gone
    from the newest generation, whichever rank's, is still found by the rank whose share it is, before anything
    loads: every rank falls back to the one before, bitwise, and the state is usable (its save works)."""
    for rank, result in enumerate(runs["two"].ok("missing_file")):
        for lost in range(2):
            assert result[f"whole-{lost}"] == [], result
            assert result[f"others-{lost}"] == [], (rank, result)  # no other rank's own file opened
            assert result[f"generation-{lost}"] == "gen-000000000003", result
            assert result[f"rejected-{lost}"] == ["gen-000000000005"], result
            assert result[f"differs-{lost}"] == [] and result[f"usable-{lost}"], result


def test_swapped_rank_rng_is_caught_where_a_model_only_comparison_is_not(runs):
    for result in runs["two"].ok("exact_resume"):
        assert result["control_model_only_equal"], result  # right after the restore, the models agree
        assert "noise" in result["control_rank_differs"] and result["control_full_differs"], result


# 5. a bit flip -------------------------------------------------------------------------------------------------
def test_a_bit_flip_in_the_newest_shard_makes_every_rank_fall_back_together(runs):
    for result in runs["two"].ok("bit_flip"):
        assert result["generation"] == "gen-000000000003" and result["rejected"] == ["gen-000000000005"], result
        assert result["differs"] == [], result
        assert result["none_valid"] == ["gen-000000000005", "gen-000000000003"], result
        # one pass: the damage is found while loading, after verified chunks reached live tensors on some rank;
        # the state says so on every rank and no save publishes it
        assert result["unusable"] is True and result["save_refused"] is True, result
        assert result["untouched_differs"], result
        # in_place=False verifies every shard first: nothing verified, not one live tensor changed
        assert result["two_pass"] == ["gen-000000000005", "gen-000000000003"], result
        assert result["two_pass_unusable"] is False and result["two_pass_differs"] == [], result


# 6. no pickle ----------------------------------------------------------------------------------------------------
def test_restore_never_unpickles_and_a_crafted_metadata_file_is_just_corrupt(runs):
    for result in runs["two"].ok("no_pickle"):
        assert result["differs"] == [] and result["tripped_by_ours"] == [], result
        assert all("dcp-metadata.json" in reason for reason in result["crafted"]), result
        assert result["tripped_by_crafted"] == [], result


def test_control_the_stock_dcp_reader_trips_the_same_guard(runs):
    for result in runs["two"].ok("no_pickle"):
        assert result["tripped_by_stock"] and result["stock"].startswith("CheckpointException"), result


# 7. replicas and existing generations --------------------------------------------------------------------------
def test_a_diverged_ddp_replica_is_refused_on_every_rank(runs):
    for result in runs["two"].ok("replica_divergence"):
        assert result["outcome"].startswith("StateMismatch: replicated tensors differ between ranks: model.0.weight")
        assert result["latest"] == "gen-000000000002" and result["leftovers"] == [], result


def test_a_changed_state_at_an_existing_update_is_a_revision_on_every_rank(runs):
    """Issue 22 item 5: refused before (GenerationExists on rank 0, CheckpointFailed on rank 1); now every
    rank publishes the same superseding revision."""
    outcomes = [r["outcome"] for r in runs["two"].ok("existing_generation")]
    assert outcomes == ["saved gen-000000000002-r005"] * 2, outcomes
    for result in runs["two"].ok("existing_generation"):
        assert result["noop_same"] and result["leftovers"] == [] and result["latest"] == "gen-000000000002-r005"


def test_a_change_of_tensors_only_at_the_same_update_is_never_dropped_on_any_rank(runs):
    """Issue 29 item 1 across ranks: weights, an optimizer moment, one rank's RNG or loader position changed
    at the same update each become a revision (rank 0 compares every rank's staged digests before the commit);
    the same bytes again write nothing; a fresh restore of the last one is bitwise."""
    for result in runs["two"].ok("existing_generation"):
        assert result["names"] == {"weights": "gen-000000000002-r001", "moment": "gen-000000000002-r002",
                                   "rng on rank 1": "gen-000000000002-r003",
                                   "position on rank 1": "gen-000000000002-r004",
                                   "same again": "gen-000000000002-r004"}, result
        assert result["full_differs"] == [] and result["rank_differs"] == [], result


# 4. faults --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["write-rank0", "write-rank1", "finish-rank0"])
def test_a_raised_failure_in_any_phase_publishes_nothing(runs, fault):
    for result in runs["two"].ok("raised_faults"):
        entry = result[fault]
        assert entry["outcome"] in ("CheckpointFailed", "GenerationExists"), entry  # typed, on every rank
        assert entry["pointer_unchanged"] and entry["generations"] == ["gen-000000000002"], entry
        assert entry["restored"] == "gen-000000000002" and entry["latest"] == "gen-000000000003", entry
        assert entry["after_next_save"] == [], entry


def test_a_refusal_on_one_rank_raises_on_every_rank_at_once_and_the_next_save_works(runs):
    rank0, rank1 = runs["two"].ok("one_rank_refuses")
    assert rank1["outcome"] == "UnsupportedValue" and "facts.handle" in rank1["message"], rank1
    assert rank0["outcome"] == "CheckpointFailed" and "rank 1" in rank0["message"], rank0
    assert "UnsupportedValue" in rank0["message"], rank0  # the other rank hears what the failing one raised
    for result in (rank0, rank1):
        assert result["seconds_to_raise"] < 3.0, result
        assert result["generations"] == ["gen-000000000002"], result  # nothing published
        assert sorted(result["after_fix"]) == ["gen-000000000002", "gen-000000000003"], result


def test_control_a_refusal_outside_the_round_leaves_the_other_rank_waiting_out_the_timeout(runs):
    rank0, rank1 = runs["two"].ok("one_rank_refuses_control")
    assert rank1["outcome"] == "UnsupportedValue" and rank1["seconds_to_raise"] < 3.0, rank1
    assert rank0["outcome"] == "CheckpointFailed" and rank0["seconds_to_raise"] >= 4.5, rank0


@pytest.mark.parametrize("kind", FAULTS)
def test_a_killed_or_hung_rank_makes_the_survivor_raise_and_exit_non_zero(faults, kind):
    launched, _ = faults
    run = launched[kind]
    assert run.returncode != 0, run.log[-3000:]
    survivor = 0 if "rank1" in kind else 1
    result = run.result("fault", survivor)
    assert result["outcome"].startswith("CheckpointFailed"), result
    limit = 6 + 5 if kind.startswith("hang") else 5  # the collective timeout, or at once
    assert result["seconds_to_raise"] < limit, result


@pytest.mark.parametrize("kind", FAULTS)
def test_after_a_fault_the_next_run_restores_and_its_next_save_cleans_up(faults, kind):
    _, followup = faults
    entry = followup.ok("fault_followup")[0][kind]
    assert entry["generations_before"] == ["gen-000000000002"], entry  # no new generation, no pointer move
    assert entry["restored"] == "gen-000000000002" and entry["latest"] == "gen-000000000003", entry
    assert entry["leftovers_after"] == [], entry


# 8. background saves ---------------------------------------------------------------------------------------------
def test_background_saves_on_the_dedicated_group_while_ddp_trains(runs):
    for result in runs["two"].ok("background"):
        assert result["latest"] == "gen-000000000008", result
        assert all(d == [] for d in result["restored_differs"].values()), result  # each the state at its call


def test_preallocate_fills_every_ranks_buffers_without_touching_the_live_state(runs):
    for result in runs["two"].ok("background"):
        assert result["preallocated"] > 0 and result["fsdp_preallocated"] > 0, result
        assert result["preallocate_changed"] == [], result  # the buffers are owned copies, 0-d DTensors too
        assert result["fsdp_background_differs"] == [], result  # saved from the preallocated buffers, bitwise
        assert result["scalar_background_differs"] == [], result  # a 0-d DTensor copied, not the live one


@pytest.mark.parametrize("where", ["save", "wait", "close"])
def test_a_background_failure_surfaces_at_the_next_call(runs, where):
    for result in runs["two"].ok("background"):
        assert result["surfaced"][where] == "AsyncSaveFailed from CheckpointFailed" or \
            result["surfaced"][where].startswith("AsyncSaveFailed"), result


class _Extra(torch.nn.Linear):
    def get_extra_state(self):
        return {"note": 1}

    def set_extra_state(self, state):
        pass


def test_in_place_detection_accepts_only_the_modules_own_tensors_whole():
    """The multi-rank load skips set_model_state_dict only where DCP wrote the live tensors themselves: a copy, a
    narrower view or a non-tensor entry (extra state) sends it through set_model_state_dict (the control: each
    of those would otherwise leave the module unloaded, which the bitwise round trips above would catch)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainstate.distributed.capture import loaded_in_place
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert loaded_in_place(module, get_model_state_dict(module))
    for change in (lambda t: t.clone(), lambda t: t[:1], lambda t: t.to(torch.float64)):
        loaded = get_model_state_dict(module)
        loaded["0.weight"] = change(loaded["0.weight"])
        assert not loaded_in_place(module, loaded)
    extra = _Extra(2, 2)
    assert "_extra_state" in get_model_state_dict(extra)
    assert not loaded_in_place(extra, get_model_state_dict(extra))
