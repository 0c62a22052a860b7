"""The device transports' staging (services/common/tensors/device_staging.py) against the per-tensor path it replaces
(each bucket packed from byte slices of `flat_bytes` of each tensor): the same bytes in every staging buffer and so
the same checksums a replica of today verifies, for mixed dtypes and shapes, tensors cut by bucket edges, pieces not
aligned to their dtype, a cast folded into the copy, and buffers taken in turn (nccl); the plan and the views are kept
while the layout stays and remade when it or the buffers change. On CPU here; tests/gpu/test_weight_sync.py runs the
same checks on CUDA, whose foreach copy takes another kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.tensors import device_staging
from services.common.tensors.device_staging import DeviceStaging, StagingCopy, cast_copies
from services.common.tensors.weight_transport import DevicePlan, device_checksum, flat_bytes
from services.common.tensors.weights import PayloadAssembler, build_manifest


def mixed_state(device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Every kind of tensor a push may hold: odd byte sizes (later offsets not aligned to their dtype), a scalar, an
    empty one, one that is not contiguous, integers and bools beside floats."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "a.lora_A.weight": torch.randn(4, 33, generator=g).bfloat16(),
        "a.lora_B.weight": torch.randn(33, 4, generator=g),
        "odd.bytes": torch.randint(-100, 100, (7,), generator=g, dtype=torch.int8),    # 7 bytes: what follows is odd
        "half.after.odd": torch.randn(5, 3, generator=g).half(),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 10, generator=g).t(),
        "ids": torch.randint(0, 2**40, (9,), generator=g, dtype=torch.int64),
        "mask": torch.rand(13, generator=g) > 0.5,
        "big": torch.randn(70, 9, generator=g).bfloat16(),
    }
    return {k: v.to(device) for k, v in state.items()}


def per_tensor(plan: DevicePlan, state, buffers, buckets=None) -> None:
    """The path before (DevicePlan.pack): a flat uint8 view (a copy where not contiguous) per tensor, and each bucket
    packed from byte slices of them."""
    flats = [flat_bytes(t) for t in state.values()]
    for k in (range(len(plan.buckets)) if buckets is None else buckets):
        dst = buffers[k % len(buffers)]
        for i, start, n, at in plan.buckets[k][2]:
            dst[at:at + n].copy_(flats[i][start:start + n])


def empty_buffers(plan: DevicePlan, device, fill: int) -> list[torch.Tensor]:
    return [torch.full((n,), fill, dtype=torch.uint8, device=device) for _, n, _ in plan.buckets]


def check_same_bytes_as_per_tensor(device, bucket_bytes: int) -> None:
    state = mixed_state(device)
    plan = DevicePlan.build(state, 1, bucket_bytes)
    want, got = empty_buffers(plan, device, 0), empty_buffers(plan, device, 255)
    per_tensor(plan, state, want)
    staging = DeviceStaging()
    assert staging.plan(state, 1, bucket_bytes) == plan
    sums = staging.stage(list(state.values()), got)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert sums == [int(device_checksum(b)) for b in want]


def check_cast_folded_into_the_copy(device) -> None:
    """Sources in float32 staged under a manifest of bfloat16 / float16: the bytes of casting each first."""
    sources = mixed_state(device)
    wire = {k: v.bfloat16() if k.startswith("a.") or k == "big" else v.half() if v.is_floating_point() else v
            for k, v in sources.items()}
    sources = {k: v.float() if v.is_floating_point() else v for k, v in sources.items()}
    plan = DevicePlan.build(wire, 1, 96)
    want, got = empty_buffers(plan, device, 0), empty_buffers(plan, device, 255)
    per_tensor(plan, wire, want)
    StagingCopy(plan, [t.dtype for t in sources.values()], got, range(len(plan.buckets)))(list(sources.values()))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def check_buffers_in_turn(device) -> None:
    """nccl: two buffers of bucket_bytes, bucket k packed into buffer k % 2 right before its broadcast."""
    state = mixed_state(device)
    plan = DevicePlan.build(state, 1, 64)
    staging = DeviceStaging()
    staging.plan(state, 1, 64)
    want = [torch.zeros(64, dtype=torch.uint8, device=device) for _ in range(2)]
    got = [torch.full((64,), 255, dtype=torch.uint8, device=device) for _ in range(2)]
    for k, (_, nbytes, _) in enumerate(plan.buckets):
        per_tensor(plan, state, want, [k])
        staging.pack(list(state.values()), got, (k,))
        assert torch.equal(want[k % 2][:nbytes], got[k % 2][:nbytes]), k


@pytest.mark.parametrize("bucket_bytes", [64, 100, 1 << 20])
def test_staging_writes_the_bytes_and_checksums_of_the_per_tensor_path(bucket_bytes):
    check_same_bytes_as_per_tensor("cpu", bucket_bytes)


def test_a_cast_folded_into_the_staging_copy_writes_the_bytes_of_casting_first():
    check_cast_folded_into_the_copy("cpu")


def test_buckets_packed_in_turn_into_two_buffers_match_the_per_tensor_path():
    check_buffers_in_turn("cpu")


def test_the_plan_and_views_are_kept_while_the_layout_stays_and_remade_when_it_changes(monkeypatch):
    built, made = [], []

    class Counting(StagingCopy):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    real_build = DevicePlan.build
    monkeypatch.setattr(DevicePlan, "build", classmethod(lambda cls, *a: built.append(1) or real_build(*a)))
    monkeypatch.setattr(device_staging, "StagingCopy", Counting)
    staging = DeviceStaging()

    def push(state, version, buffers=None):
        plan = staging.plan(state, version, 128)
        buffers = buffers or empty_buffers(plan, "cpu", 255)
        sums = staging.stage(list(state.values()), buffers)
        want = empty_buffers(plan, "cpu", 0)
        per_tensor(plan, state, want)
        assert all(torch.equal(w, g) for w, g in zip(want, buffers, strict=True))
        assert sums == [int(device_checksum(b)) for b in want]
        return plan, buffers

    first, buffers = push(mixed_state(seed=1), 1)
    again, _ = push(mixed_state(seed=2), 2, buffers)          # new values, same layout and buffers
    assert (len(built), len(made)) == (1, 1)
    assert (first.manifest.version, again.manifest.version) == (1, 2) and first.signature() == again.signature()
    push(mixed_state(seed=3), 3)                              # new buffers: new views, the same plan
    assert (len(built), len(made)) == (1, 2)
    grown = {**mixed_state(seed=4), "a.lora_A.weight": torch.randn(8, 33).bfloat16()}
    changed, _ = push(grown, 4)                               # a shape changed: a new plan and new views
    assert (len(built), len(made)) == (2, 3) and changed.signature() != first.signature()
    recast = {**mixed_state(seed=5), "a.lora_B.weight": torch.randn(33, 4).bfloat16()}
    push(recast, 5)                                           # a dtype changed
    assert (len(built), len(made)) == (3, 4)


def check_cast_copies(device) -> None:
    """The snapshot of a push (float32 and bfloat16 sources, as master weights and a model's may be): each tensor
    cast, in storage of its own (the trainer's next step leaves it as it was)."""
    state = {k: v for k, v in mixed_state(device).items() if v.is_floating_point()}
    copies = cast_copies(state, torch.bfloat16, device)
    assert list(copies) == list(state)
    for k, v in state.items():
        assert copies[k].dtype == torch.bfloat16 and copies[k].shape == v.shape and copies[k].device == v.device
        assert torch.equal(copies[k], v.to(torch.bfloat16))
        assert copies[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr() or not v.numel()
    state["big"].mul_(2)                                      # the trainer steps after the snapshot
    assert not torch.equal(copies["big"], state["big"].to(torch.bfloat16))


def test_cast_copies_are_the_tensors_cast_in_storage_of_their_own():
    check_cast_copies("cpu")


def test_the_kept_manifest_message_is_the_one_built_per_push_under_each_version():
    from services.trainer.weights.senders import ManifestMessage, ManifestTags, device_manifest

    state = mixed_state()
    staging, message = DeviceStaging(), ManifestMessage()
    tags = ManifestTags(adapter="default", adapter_config='{"r": 4}', base_id="b")
    for version in (1, 2):
        plan = staging.plan(state, version, 64)
        assert message(plan, "ipc", tags=tags).manifest == device_manifest(plan, "ipc", tags=tags)
        assert message(plan, "nccl", "g1").manifest == device_manifest(plan, "nccl", "g1")
    grown = {**state, "a.lora_A.weight": torch.randn(8, 33).bfloat16()}
    plan = staging.plan(grown, 3, 64)
    assert message(plan, "ipc", tags=tags).manifest == device_manifest(plan, "ipc", tags=tags)


def test_the_rollout_manifest_converter_gives_each_push_its_own_version_over_one_layout():
    from meshrl.v1 import common_pb2
    from services.common.manifest import manifest_from_kwargs
    from services.rollout import convert

    def pb(version: int, shape: list[int]) -> common_pb2.WeightManifest:
        tensors = [common_pb2.TensorSpec(name="x.lora_A.weight", dtype="bfloat16", shape=shape, offset=0,
                                         nbytes=2 * shape[0] * shape[1])]
        return common_pb2.WeightManifest(version=version, total_bytes=tensors[0].nbytes, tensors=tensors,
                                         adapter="a", adapter_config="{}", base_id="sha256:b")

    first, second, other = (convert.manifest_from_pb(pb(v, s)) for v, s in ((1, [4, 8]), (2, [4, 8]), (3, [8, 4])))
    want = pb(2, [4, 8])
    assert second == manifest_from_kwargs(want.version, want.total_bytes, want.tensors, adapter="a",
                                          adapter_config="{}", base_id="sha256:b")
    assert (first.version, second.version, other.version) == (1, 2, 3)
    assert first.tensors is second.tensors and other.tensors[0].shape == (8, 4)


def test_a_bad_manifest_is_refused_every_time_and_a_checked_layout_under_another_total_too():
    good = build_manifest({"a": torch.zeros(2, 3), "b": torch.zeros(4)}, 1)
    PayloadAssembler(good)
    PayloadAssembler(good)                          # checked once, then known
    with pytest.raises(ValueError, match="total_bytes"):
        PayloadAssembler(dataclasses.replace(good, total_bytes=good.total_bytes + 4))
    bad = dataclasses.replace(good, tensors=(good.tensors[0], dataclasses.replace(good.tensors[1], offset=0)))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"manifest.tensors\[1\] \(b\): offset/nbytes"):
            PayloadAssembler(bad)
