"""An adapter update's batched path on the replica (issue 43): AdapterBank.load writes its slot bit for bit as the
per-layer load it replaced, refuses bad adapters by name with the bank untouched; tensors_from_flat gives the views
slicing gave; HostReceiver keeps its staging buffer only across updates that were applied."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from services.common.tensors.weight_transport import HostPayload, decode_bucket, encode_bucket, tensors_from_flat
from services.common.tensors.weights import build_manifest
from services.rollout.engine_torch.lora import AdapterBank
from services.rollout.weight_receivers import HostReceiver

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 8


def tiny_model(dtype: torch.dtype, device: str = "cpu"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, max_position_embeddings=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def make_bank(dtype: torch.dtype, max_loras: int = 2, device: str = "cpu") -> AdapterBank:
    return AdapterBank(tiny_model(dtype, device), max_loras=max_loras, max_rank=MAX_RANK, targets=TARGETS, max_rows=4)


def adapter(bank: AdapterBank, rank: int, dtype: torch.dtype, seed: int, targets=TARGETS,
            device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path, m in bank.layers.items():
        if path.rsplit(".", 1)[-1] in targets:
            out[f"base_model.model.{path}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g)
            out[f"base_model.model.{path}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def per_layer_load(bank: AdapterBank, slot: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The load as it was before batching: zero the slot, then copy A and b.to(float32).mul(scale) layer by layer."""
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    lo, hi, r = slot * bank.max_rank, slot * bank.max_rank + rank, bank.max_rank
    with torch.no_grad():
        for path, m in bank.layers.items():
            m.lora_A_cat[slot * r:(slot + 1) * r].zero_()
            m.lora_B_cat[:, slot * r:(slot + 1) * r].zero_()
            a = tensors.get(f"base_model.model.{path}.lora_A.weight")
            if a is not None:
                b = tensors[f"base_model.model.{path}.lora_B.weight"]
                m.lora_A_cat[lo:hi].copy_(a.to(bank.device, bank.dtype))
                m.lora_B_cat[:, lo:hi].copy_(b.to(bank.device).to(torch.float32).mul(scale))


def snapshot(bank: AdapterBank) -> list[torch.Tensor]:
    return [t.clone() for t in bank.buffers()]


def assert_bitwise_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):       # bits, not values: -0.0 and 0.0 differ
        assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))


DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
               (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float64)]


def check_batched_load(bank_dtype: torch.dtype, src_dtype: torch.dtype, device: str = "cpu", src_device: str = "cpu",
                       batched_b: bool = False):
    """batched_b: the B's written as on a GPU (stacked per projection, the rest by foreach) on any device."""
    batched, reference = make_bank(bank_dtype, device=device), make_bank(bank_dtype, device=device)
    if batched_b:
        batched.batched_b_devices = (device,)
    # A full-rank adapter, then over it in the same slot one of a smaller rank on fewer layers (its gaps must be
    # zeroed), an rsLoRA one in the other slot; scales that are no power of two, so every rounding shows.
    loads = [("a", 1, {"r": MAX_RANK, "lora_alpha": 11.0}, dict(rank=MAX_RANK, seed=1)),
             ("a", 1, {"r": 3, "lora_alpha": 7.0}, dict(rank=3, seed=2, targets=["q_proj", "up_proj"])),
             ("b", 2, {"r": 5, "lora_alpha": 3.0, "use_rslora": True}, dict(rank=5, seed=3))]
    for name, slot, config, kw in loads:
        tensors = adapter(batched, dtype=src_dtype, device=src_device, **kw)
        assert batched.load(name, config, tensors) == slot
        per_layer_load(reference, slot, config, tensors)
        assert_bitwise_equal(snapshot(batched), snapshot(reference))
    assert any(t.count_nonzero() for t in batched.buffers())


@pytest.mark.parametrize("bank_dtype,src_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_a_batched_load_writes_every_slot_bit_for_bit_as_the_per_layer_load(bank_dtype, src_dtype):
    check_batched_load(bank_dtype, src_dtype)


@pytest.mark.parametrize("bank_dtype,src_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_the_gpus_stacked_b_load_writes_every_slot_bit_for_bit_as_the_per_layer_load(bank_dtype, src_dtype):
    check_batched_load(bank_dtype, src_dtype, batched_b=True)


def test_the_stacked_b_load_leaves_a_projection_missing_in_a_layer_or_of_mixed_dtypes_to_the_per_tensor_copies():
    batched, reference = make_bank(torch.bfloat16), make_bank(torch.bfloat16)
    batched.batched_b_devices = ("cpu",)
    stacked: list[set[str]] = []
    write = batched._write_b_stacked
    batched._write_b_stacked = lambda *a: stacked.append(write(*a)) or stacked[-1]
    tensors = adapter(batched, 5, torch.bfloat16, seed=9)
    for w in "AB":                                          # layer 1 has no down_proj: layer 0's goes alone
        del tensors[f"base_model.model.model.layers.1.mlp.down_proj.lora_{w}.weight"]
    up = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    tensors[up] = tensors[up].float()                       # up_proj's B's in two dtypes: copied one by one
    config = {"r": 5, "lora_alpha": 9.0}
    batched.load("a", config, tensors)
    per_layer_load(reference, 1, config, tensors)
    assert_bitwise_equal(snapshot(batched), snapshot(reference))
    assert stacked == [{f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
                        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj")}]


def test_groups_alike_share_one_stacked_b_buffer_and_forwards_see_the_same_shapes():
    bank = make_bank(torch.float32)
    assert len(bank.b_stacks) == 4 and all(stack.shape[0] == 2 for stack, _ in bank.b_stacks)   # q/k/v, o, gate/up..
    for g in bank.groups.values():
        assert g.B.is_contiguous()
        assert any(g.B.data_ptr() in (s[0].data_ptr(), s[1].data_ptr()) for s, _ in bank.b_stacks)
        assert g.B.shape == (sum(m.out_features for m in g.adapted), len(g.adapted) * bank.width)


@pytest.mark.parametrize("change,error", [
    (lambda t: {**t, "model.layers.0.self_attn.q_proj.lora_A.weight": t[next(iter(t))]}, "PEFT's saved names"),
    (lambda t: {**t, "base_model.model.model.layers.0.mlp.act.lora_A.weight": t[next(iter(t))]},
     "not a LoRA layer of this replica"),
    (lambda t: {k: v for k, v in t.items() if k != "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"},
     "model.layers.1.mlp.down_proj has lora_A or lora_B alone"),
    (lambda t: {**t, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(16, 3)},
     r"model.layers.0.self_attn.k_proj lora_A \(4, 32\) / lora_B \(16, 3\) do not fit rank 4"),
])
def test_a_bad_adapter_is_refused_by_name_and_leaves_the_bank_as_it_was(change, error):
    bank = make_bank(torch.bfloat16)
    good = adapter(bank, 4, torch.bfloat16, seed=4)
    bank.load("a", {"r": 4, "lora_alpha": 8}, good)
    before = snapshot(bank)
    with pytest.raises(ValueError, match=error):
        bank.load("a", {"r": 4, "lora_alpha": 8}, change(adapter(bank, 4, torch.bfloat16, seed=5)))
    with pytest.raises(ValueError, match="max_lora_rank"):
        bank.load("a", {"r": MAX_RANK + 1, "lora_alpha": 8}, adapter(bank, MAX_RANK + 1, torch.bfloat16, seed=6))
    assert_bitwise_equal(snapshot(bank), before)
    assert bank.slots == {"a": 1}


def sliced_views(flat: torch.Tensor, manifest) -> dict[str, torch.Tensor]:
    """tensors_from_flat as it was: slice, re-view, reshape."""
    out = {}
    for m in manifest.tensors:
        dtype = getattr(torch, m.dtype)
        part = flat[m.offset:m.offset + m.nbytes]
        if m.offset % dtype.itemsize:
            part = part.clone()
        out[m.name] = part.view(dtype).view(m.shape) if m.nbytes else torch.empty(m.shape, dtype=dtype)
    return out


@pytest.mark.parametrize("lead", [0, 2, 1])
def test_the_flat_payloads_tensors_are_the_views_slicing_gave(lead):
    # lead: where the payload starts in its buffer; slicing refused a misaligned one (a copy is made now).
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randint(0, 255, (7,), dtype=torch.uint8),
             "c": torch.randn(2, 3, generator=g), "empty": torch.zeros(0, 4), "d": torch.randn(4, generator=g).double(),
             "e": torch.tensor([True, False, True])}
    manifest = build_manifest(state, 1)
    payload = torch.cat([torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values() if t.numel()])])
    # The payload at an offset inside a bigger buffer: views must count from the payload, not the storage.
    storage = torch.zeros(lead + payload.numel() + 8, dtype=torch.uint8)
    flat = storage[lead:lead + payload.numel()]
    flat.copy_(payload)
    got = tensors_from_flat(flat, manifest)
    assert list(got) == list(state)
    for name, t in got.items():
        assert t.dtype == state[name].dtype and t.shape == state[name].shape and t.is_contiguous()
        assert torch.equal(t, state[name])
    if lead == 0:                       # views where slicing gave views (aligned offsets), of the same bytes
        sliced = sliced_views(flat, manifest)
        views = [m.name for m in manifest.tensors if m.nbytes and m.offset % state[m.name].dtype.itemsize == 0]
        assert views and all(got[n].data_ptr() == sliced[n].data_ptr() == flat.data_ptr() + manifest.tensors[
            list(state).index(n)].offset for n in views)
    with pytest.raises(ValueError, match="payload truncated"):
        tensors_from_flat(flat[:-1], manifest)


def stream(state: dict[str, torch.Tensor], version: int):
    """(manifest, buckets) of an update as the grpc servicer hands them over: the sender's wire bytes, decoded."""
    payload = HostPayload(state, version, bucket_bytes=1000)

    async def buckets():
        payload.start()
        for i, parts in enumerate(payload.buckets):
            b = decode_bucket(encode_bucket(parts, await payload.crc(i)))
            yield b.data, b.crc32
        payload.close()

    return payload.manifest, buckets()


def test_the_host_receiver_stages_each_adapter_in_the_buffer_of_the_last_one_applied():
    receiver = HostReceiver("cpu")
    first = {"x.lora_A.weight": torch.randn(4, 300), "x.lora_B.weight": torch.randn(300, 4)}
    second = {k: v + 1 for k, v in first.items()}

    async def main():
        got = await receiver.receive(*stream(first, 1))
        assert all(torch.equal(got.tensors[k], v) for k, v in first.items())
        receiver.keep(got)
        again = await receiver.receive(*stream(second, 2))
        assert again.buffer.data_ptr() == got.buffer.data_ptr()         # the kept buffer, not a new one
        assert all(torch.equal(again.tensors[k], v) for k, v in second.items())
        # Not kept (the update failed to apply): the next one gets a buffer of its own.
        third = await receiver.receive(*stream(first, 3))
        assert third.buffer.data_ptr() != again.buffer.data_ptr()
        # A corrupted bucket is refused, and the kept buffer is not handed out twice meanwhile.
        receiver.keep(third)
        manifest, buckets = stream(second, 4)

        async def corrupt():
            async for data, crc in buckets:
                yield data, crc ^ 1
        with pytest.raises(ValueError, match="checksum mismatch"):
            await receiver.receive(manifest, corrupt())
        assert receiver._spare is None

    asyncio.run(main())



def test_a_load_after_the_groups_moved_their_a_writes_the_buffers_forwards_read():
    # The bank keeps each slot's views between loads; LoraGroup.under_base_rows (the graph decoder's fused base
    # weight) moves every A under a new buffer, and the next load must write there, not into the old one.
    bank, reference = make_bank(torch.float32), make_bank(torch.float32)
    config = {"r": MAX_RANK, "lora_alpha": MAX_RANK}
    bank.load("a", config, adapter(bank, MAX_RANK, torch.float32, seed=7))
    for g in bank.groups.values():
        g.under_base_rows(5)
    second = adapter(bank, MAX_RANK, torch.float32, seed=8)
    bank.load("a", config, second)
    per_layer_load(reference, 1, config, second)
    W = bank.width
    for g in bank.groups.values():          # what the fused decoder reads: the stacked buffer's tail
        for j, m in enumerate(g.adapted):
            path = next(p for p, x in bank.layers.items() if x is m)
            want = second[f"base_model.model.{path}.lora_A.weight"]
            assert torch.equal(g.stacked[5 + j * W + MAX_RANK:5 + j * W + 2 * MAX_RANK], want)
    assert_bitwise_equal(snapshot(bank), snapshot(reference))


def test_a_refused_adapter_after_cached_loads_leaves_every_slot_as_it_was():
    bank = make_bank(torch.bfloat16)
    bank.load("a", {"r": 4, "lora_alpha": 8}, adapter(bank, 4, torch.bfloat16, seed=1))
    bank.load("b", {"r": MAX_RANK, "lora_alpha": 8}, adapter(bank, MAX_RANK, torch.bfloat16, seed=2))
    before, slots = snapshot(bank), dict(bank.slots)
    bad = adapter(bank, 4, torch.bfloat16, seed=3)
    last = next(reversed(bad))                              # the very last tensor is the bad one: all else checks out
    bad[last] = bad[last][:, :3]
    with pytest.raises(ValueError, match="do not fit rank 4"):
        bank.load("a", {"r": 4, "lora_alpha": 8}, bad)
    bad = {**adapter(bank, 4, torch.bfloat16, seed=3), "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight":
           torch.zeros(48, 4, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"targets 'model.layers.9.mlp.up_proj', which is not a LoRA layer"):
        bank.load("b", {"r": 4, "lora_alpha": 8}, bad)
    assert_bitwise_equal(snapshot(bank), before)
    assert bank.slots == slots


def test_a_layouts_second_payload_gets_views_of_its_own_buffer_and_a_short_one_is_still_refused():
    state = {"a": torch.randn(3, 5).bfloat16(), "b": torch.randn(4, 2), "empty": torch.zeros(0, 3)}
    manifest = build_manifest(state, 1)
    flats = [torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()]) for _ in range(2)]
    flats[1].view(torch.bfloat16)[:15] += 1                  # the second payload: other values of "a"
    for flat in flats:                                      # the second call reads the plan the first one made
        got = tensors_from_flat(flat, manifest)
        assert got["a"].data_ptr() == flat.data_ptr()
        assert torch.equal(got["a"], flat[:30].view(torch.bfloat16).view(3, 5))
        assert torch.equal(got["b"], state["b"]) and got["empty"].shape == (0, 3)
    with pytest.raises(ValueError, match="payload truncated"):
        tensors_from_flat(flats[0][:-1], manifest)
