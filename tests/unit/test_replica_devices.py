"""`meshrl up` spreads a pool role's `devices:` over its replicas, and rejects a list that does not split."""

import pytest
from typer.testing import CliRunner

from coordinator.cli.launcher import replica_devices


def test_two_gpus_over_two_replicas_put_one_replica_on_each():
    assert replica_devices("4,5", 2, "rollout") == ["4", "5"]


def test_gpus_split_into_contiguous_blocks_of_equal_size():
    assert replica_devices("0,1,2,3,4,5", 3, "rollout") == ["0,1", "2,3", "4,5"]
    assert replica_devices("4,5,6,7", 2, "reference") == ["4,5", "6,7"]


def test_one_replica_sees_every_listed_gpu():
    assert replica_devices("4,5,6", 1, "rollout") == ["4,5,6"]


def test_one_gpu_is_shared_by_every_replica():
    assert replica_devices("6", 3, "reward") == ["6", "6", "6"]


def test_empty_devices_leave_every_replica_to_inherit():
    assert replica_devices("", 2, "rollout") == ["", ""]
    assert replica_devices("  ", 1, "rollout") == [""]


def test_zero_replicas_get_no_placement():
    assert replica_devices("4,5", 0, "reference") == []


def test_spaces_around_entries_are_stripped():
    assert replica_devices(" 4 , 5 ", 2, "rollout") == ["4", "5"]


def test_gpu_and_mig_uuids_are_accepted():
    gpu = "GPU-8f3e2a1b-1c2d-4e5f-9a8b-7c6d5e4f3a2b"
    mig = "MIG-GPU-8f3e2a1b-1c2d-4e5f-9a8b-7c6d5e4f3a2b/1/0"
    assert replica_devices(f"{gpu},{mig}", 2, "rollout") == [gpu, mig]


def test_gpus_that_do_not_split_evenly_name_the_fields_and_the_counts():
    with pytest.raises(ValueError) as e:
        replica_devices("4,5,6", 2, "rollout")
    assert str(e.value) == ('rollout.devices: 3 GPUs ("4,5,6") do not split evenly over 2 replicas; '
                            "list one GPU (shared), or a multiple of rollout.replicas")


def test_fewer_gpus_than_replicas_is_an_error_unless_there_is_exactly_one():
    with pytest.raises(ValueError, match=r"^reference\.devices: 2 GPUs .* over 3 replicas"):
        replica_devices("6,7", 3, "reference")


@pytest.mark.parametrize("devices, problem", [
    ("4,,5", "an empty entry"),
    ("4,5,", "an empty entry"),
    ("cuda:4", "entry 'cuda:4'"),
    ("-1", "entry '-1'"),
    ("4;5", "entry '4;5'"),
    ("GPU-", "entry 'GPU-'"),
])
def test_a_malformed_entry_is_an_error_naming_the_field(devices, problem):
    with pytest.raises(ValueError) as e:
        replica_devices(devices, 1, "reward")
    assert str(e.value).startswith(f"reward.devices: {problem} in \"{devices}\"")


@pytest.mark.parametrize("devices, dup", [("4,5,4", "4"), ("4, 04", "4"), ("GPU-a1,GPU-a1", "GPU-a1")])
def test_a_gpu_listed_twice_is_an_error_naming_the_field(devices, dup):
    with pytest.raises(ValueError) as e:
        replica_devices(devices, 1, "rollout")
    assert str(e.value) == f"rollout.devices: GPU {dup} is listed twice in \"{devices}\""


@pytest.mark.parametrize("recipe, message", [
    ('rollout: {n: 2, max_tokens: 6, replicas: 2, devices: "4,5,6"}', 'rollout.devices: 3 GPUs ("4,5,6") do not split evenly over 2 replicas'),
    ('rollout: {n: 2, max_tokens: 6}\nactor: {dp_size: 2}\ntrainer: {nproc_per_node: 2, devices: "0"}',
     'trainer.devices: 1 GPU(s) ("0") for trainer.nproc_per_node=2 ranks; each rank needs its own GPU')],
    ids=["rollout-split", "trainer-fewer-gpus-than-ranks"])
def test_meshrl_up_with_devices_that_do_not_fit_exits_2_and_starts_nothing(tmp_path, monkeypatch, recipe, message):
    import coordinator.cli.launcher
    from coordinator.cli import app

    def refuse(*args, **kwargs):
        raise AssertionError("meshrl up launched a process after bad devices")

    monkeypatch.setattr(coordinator.cli.launcher, "Launcher", refuse)
    config = tmp_path / "run.yaml"
    config.write_text(recipe + "\n")
    result = CliRunner().invoke(app, ["up", str(config), "--run-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()
