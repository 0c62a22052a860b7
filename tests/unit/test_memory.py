"""coordinator/recipe/memory.py: per-service GPU memory estimates of a recipe and `meshrl up`'s fit check; and the
one-GPU recipe examples/gpu/grpo.yaml, which relies on the `auto` defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.peers.settings import QWEN25
from coordinator.cli.runs import _load_recipe, _placement
from coordinator.recipe import fits, memory
from coordinator.recipe.memory import FUSED_CHUNK_BYTES, GIB
from coordinator.recipe.model_shape import count_params

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPE = REPO / "examples" / "gpu" / "grpo.yaml"
H100 = 80 * GIB

TINY = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=100, tie_word_embeddings=True, max_position_embeddings=512)


def _folder(tmp_path: Path, name: str, config: dict) -> str:
    """A model folder with only its config.json: the estimate reads nothing else."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _qwen(tmp_path: Path, size: str) -> str:
    return _folder(tmp_path, f"qwen2.5-{size}", {"model_type": "qwen2", **QWEN25[f"qwen2.5-{size}"]})


def _recipe(path: Path, overrides: dict[str, str]):
    """The recipe's run config and `meshrl up`'s placement of it."""
    raw, cfg = _load_recipe(path, {}, overrides)
    placement, trainer_devices = _placement(cfg, raw, overrides)
    return cfg, placement, trainer_devices


def test_parameter_counts_match_the_published_qwen25_sizes():
    counts = {size: count_params({"model_type": "qwen2", **QWEN25[f"qwen2.5-{size}"]})
              for size in ("0.5b", "1.5b", "3b", "7b")}
    assert counts == {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688, "7b": 7_615_616_512}


def test_tiny_config_estimates_equal_the_hand_computed_bytes(tmp_path):
    path = _folder(tmp_path, "tiny", TINY)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": path, "device": "cuda", "dtype": "float32"},
        "rollout": {"engine": "torch", "replicas": 1, "n": 2, "max_tokens": 16},
        "reference": {"replicas": 1}, "algorithm": {"use_kl_loss": True},
        "data": {"rollout_batch_size": 2, "max_prompt_length": 16}}))
    cfg, placement, trainer_devices = _recipe(recipe, {})
    by_service = {e.service: e for e in memory.estimate(cfg, placement, trainer_devices)}
    # embed 100*64; per block q 64*64+64, k and v 64*32+32, o 64*64, MLP 3*64*128, two norms 64; final norm 64.
    params = 6400 + 2 * (4160 + 2 * 2080 + 4096 + 24576 + 128) + 64
    assert params == 80704
    trainer = by_service["trainer"].parts
    assert trainer["float32 weights"] == trainer["gradients"] == params * 4
    assert trainer["AdamW state"] == 2 * params * 4
    assert "bfloat16 autocast copy" not in trainer and "float32 autocast copy" not in trainer
    # 2 prompts x 2 samples x (16 + 16) tokens = 128 tokens; per block and token (fp32): norms 2*(3*4*64),
    # q/k/v + attention out 4*(3*64 + 2*32), MLP 4*4*128.
    assert trainer["activations"] == 128 * 2 * (1536 + 1024 + 2048) + FUSED_CHUNK_BYTES
    assert trainer["ipc weight staging"] == params * 4          # transport auto, replica on the trainer's GPU
    rollout = by_service["rollout 0"].parts
    # kv_cache auto on CUDA: the paged pool, room for 512 rows of 256 + 2 * 16 tokens (the GPU's size unknown here:
    # no cap); K and V of 2 layers x 2 kv heads x 16 dims in fp32.
    assert rollout["paged KV pool (auto: 512 rows of 256 + 2 x 16 tokens)"] == 512 * 288 * (2 * 2 * 2 * 16 * 4)
    assert not [p for p in rollout if p.startswith("KV cache")]
    # kv_cache none: CUDA graphs (auto, torch engine): 4 rows -> batch bucket 8; 16 + 2*16 tokens -> length bucket
    # 256.
    cfg, placement, trainer_devices = _recipe(recipe, {"rollout.kv_cache": "none"})
    rollout = next(e for e in memory.estimate(cfg, placement, trainer_devices) if e.service == "rollout 0").parts
    assert rollout["KV cache (8 rows x 256 tokens)"] == 8 * 256 * (2 * 2 * 2 * 16 * 4)
    assert by_service["reference 0"].parts["float32 weights"] == params * 4
    assert all(e.gpu == "cuda:0" and e.parts["CUDA context"] == GIB // 2 for e in by_service.values())


def test_the_one_gpu_recipe_at_1_5b_fits_an_80_gib_gpu(tmp_path):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "1.5b")})
    estimates = fits.check_fits(cfg, placement, H100, trainer_devices)
    assert sorted(e.service for e in estimates) == ["reference 0", "rollout 0", "trainer"]
    total = sum(e.total for e in estimates)
    assert 30 * GIB < total < 0.95 * H100
    trainer = next(e for e in estimates if e.service == "trainer").parts
    assert trainer["float32 weights"] == 1_543_714_304 * 4     # fp32 master weights under bf16 compute


def test_the_one_gpu_recipe_without_activation_checkpointing_is_refused_at_1_5b(tmp_path):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "1.5b"),
                                                           "actor.activation_checkpointing": "none"})
    with pytest.raises(ValueError, match="actor.activation_checkpointing full"):
        fits.check_fits(cfg, placement, H100, trainer_devices)


def test_7b_full_fine_tuning_is_refused_naming_the_estimate_and_the_settings_to_change(tmp_path):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "7b")})
    with pytest.raises(ValueError) as e:
        fits.check_fits(cfg, placement, H100, trainer_devices)
    msg = str(e.value)
    assert msg.startswith("model.path: ") and "on cuda:0" in msg and "the GPU has 80.0 GiB" in msg
    assert "trainer " in msg and "AdamW state" in msg and "rollout 0 " in msg and "reference 0 " in msg
    # LoRA fits alone and comes first; bf16 master weights alone do not.
    assert msg.index("set actor.lora.rank 16") < msg.index("actor.param_dtype bfloat16")
    assert "actor.param_dtype bfloat16 (no fp32 master weights: 8 bytes/param, not 16+) (not enough alone)" in msg
    assert "trainer.devices" in msg


def test_7b_with_lora_and_the_trainer_as_reference_fits_an_80_gib_gpu(tmp_path):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "7b"),
                                                           "actor.lora.rank": "16", "reference.replicas": "0"})
    estimates = fits.check_fits(cfg, placement, H100, trainer_devices)
    assert sorted(e.service for e in estimates) == ["rollout 0", "trainer"]
    trainer = next(e for e in estimates if e.service == "trainer").parts
    assert trainer["bfloat16 frozen base"] == 7_615_616_512 * 2
    assert trainer["LoRA rank 16 adapters + AdamW"] < GIB


def test_services_on_their_own_gpus_are_summed_per_gpu(tmp_path):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "3b"),
                                                           "trainer.devices": "0", "rollout.devices": "1",
                                                           "reference.devices": "1"})
    # Together the 3B recipe passes 95% of an 80 GiB GPU; the trainer alone on GPU 0 fits.
    gpus = memory.by_gpu(fits.check_fits(cfg, placement, [H100, H100], trainer_devices))
    assert sorted(gpus) == ["cuda:0", "cuda:1"]
    assert [e.service for e in gpus["cuda:0"]] == ["trainer"]
    assert "nccl staging" in gpus["cuda:0"][0].parts       # transport auto: the replica is on another GPU
    shared, _, _ = _recipe(GPU_RECIPE, {"model.path": str(tmp_path / "qwen2.5-3b")})
    with pytest.raises(ValueError, match="on cuda:0"):
        fits.check_fits(shared, placement={k: [""] * len(v) for k, v in placement.items()}, gpu_bytes=H100)


def test_a_recipe_on_cpu_is_not_checked(monkeypatch):
    cfg, placement, trainer_devices = _recipe(REPO / "examples" / "arith" / "grpo.yaml", {})

    def no_gpu_query():
        raise AssertionError("a CPU recipe must not look for GPUs")

    monkeypatch.setattr(fits, "gpu_memory", no_gpu_query)
    assert memory.estimate(cfg, placement, trainer_devices) == []
    fits.check_recipe_fits(cfg, placement, trainer_devices)      # no GPU query, no error
    assert fits.check_fits(cfg, placement, 1, trainer_devices) == []


def test_no_gpu_found_skips_the_check(tmp_path, monkeypatch):
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "7b")})
    monkeypatch.setattr(fits, "gpu_memory", lambda: None)
    fits.check_recipe_fits(cfg, placement, trainer_devices)
    monkeypatch.setattr(fits, "gpu_memory", lambda: [H100])
    with pytest.raises(ValueError, match="needs about"):
        fits.check_recipe_fits(cfg, placement, trainer_devices)


def test_meshrl_up_refuses_a_recipe_that_cannot_fit_before_any_process_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from coordinator.cli import launcher
    from coordinator.cli import app

    path = _qwen(tmp_path, "7b")
    (Path(path) / "model.safetensors").write_bytes(b"")       # preflight wants a weights file; it is not read
    monkeypatch.setattr(fits, "gpu_memory", lambda: [H100])

    def no_start(*args, **kwargs):
        raise AssertionError("the launcher started")

    monkeypatch.setattr(launcher, "Launcher", no_start)
    result = CliRunner().invoke(app, ["up", str(GPU_RECIPE), "--model.path", path])
    assert result.exit_code == 2, result.output
    assert "meshrl up: model.path: " in result.output and "actor.lora.rank 16" in result.output


def test_meshrl_memory_prints_each_service_and_the_verdict(tmp_path):
    from typer.testing import CliRunner

    from coordinator.cli import app

    result = CliRunner().invoke(app, ["memory", str(GPU_RECIPE), "--gpu-gib", "80",
                                      "--model.path", _qwen(tmp_path, "1.5b")])
    assert result.exit_code == 0, result.output
    assert "trainer" in result.output and "rollout 0" in result.output and "reference 0" in result.output
    assert "of 80.0 GiB: fits" in result.output


def _keys(data) -> set[str]:
    if isinstance(data, dict):
        return set(data) | {k for v in data.values() for k in _keys(v)}
    if isinstance(data, list):
        return {k for v in data for k in _keys(v)}
    return set()


def test_the_one_gpu_recipe_loads_and_sets_no_speed_switch():
    raw = yaml.safe_load(GPU_RECIPE.read_text())
    assert not _keys(raw) & {"cuda_graphs", "transport", "compile", "max_batch_size", "cuda_graph_compile",
                             "use_remove_padding", "fused_logprobs", "weight_sync"}
    _, cfg = _load_recipe(GPU_RECIPE, {}, {})
    assert (cfg.model.path, cfg.model.device, cfg.model.dtype) == ("examples/gpu/models/qwen2.5-1.5b", "cuda",
                                                                   "bfloat16")
    assert (cfg.rollout.engine, cfg.rollout.replicas, cfg.rollout.n, cfg.rollout.max_tokens) == ("torch", 1, 8, 512)
    assert cfg.data.rollout_batch_size == 32 and cfg.algorithm.use_kl_loss and cfg.algorithm.kl_loss_type == "k3"
    assert all(Path(REPO / f).is_file() for f in cfg.data.train_files + cfg.data.heldout_files)


def _lora_estimates(tmp_path: Path, model: str, dtype: str, rollout: dict, actor: dict) -> dict:
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": model, "device": "cuda", "dtype": dtype}, "actor": actor,
        "rollout": {"engine": "torch", "replicas": 1, "n": 2, "max_tokens": 16, **rollout},
        "reference": {"replicas": 0}, "data": {"rollout_batch_size": 2, "max_prompt_length": 16}}))
    cfg, placement, trainer_devices = _recipe(recipe, {})
    return {e.service: e.parts for e in memory.estimate(cfg, placement, trainer_devices)}


def test_lora_counts_the_trainers_adapters_and_the_replicas_adapter_slots_by_hand(tmp_path):
    path = _folder(tmp_path, "tiny", TINY)
    parts = _lora_estimates(tmp_path, path, "float32", {"max_loras": 2},
                            {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}})
    # q_proj 64 -> 64 and v_proj 64 -> 32 (2 kv heads x 16): 128 + 96 = 224 in + out features per block, 2 blocks.
    trainer = parts["trainer"]
    assert trainer["float32 frozen base"] == 80704 * 4
    assert trainer["LoRA rank 4 adapters + AdamW"] == 4 * (2 * 4 * 224) * 4     # A+B, grads, 2 AdamW moments
    assert "gradients" not in trainer and "AdamW state" not in trainer
    assert trainer["ipc weight staging"] == 2 * 4 * 224 * 4     # the replica serves adapters: a push is the adapter
    # enable_lora auto -> on (actor.lora); max_lora_rank auto -> 4; slots 2 + the base's: 3 x 4 columns, fp32.
    # A: q and v read 64 each; B: one block-diagonal [q+k+v out = 128, 2 members x 12 columns] for the q/k/v group.
    assert parts["rollout 0"]["LoRA adapter slots (2 x rank <= 4)"] == 2 * (128 + 128 * 2) * (3 * 4) * 4


def test_the_adapter_slots_at_1_5b_rank_16_four_slots_are_270_mib_and_only_where_enable_lora_is_on(tmp_path):
    path = _qwen(tmp_path, "1.5b")
    on = _lora_estimates(tmp_path, path, "bfloat16", {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16},
                         {"lora": {"rank": 16}})
    # Every projection: q 1536+1536, k and v 1536+256, o 1536+1536, gate and up 1536+8960, down 8960+1536.
    per_block = 2 * 3072 + 2 * 1792 + 3 * 10496
    assert per_block == 41216
    # The replica's bank: A [80, in] per projection; B block-diagonal per group (q/k/v: 2048 rows x 3 blocks,
    # gate/up: 17920 x 2, o and down: 1536 x 1), off-block zeros included.
    bank_block = (6 * 1536 + 8960) + (2048 * 3 + 1536 + 17920 * 2 + 1536)
    assert bank_block == 63232
    slots = on["rollout 0"]["LoRA adapter slots (4 x rank <= 16)"]
    assert slots == 28 * bank_block * (5 * 16) * 2 == 283_279_360           # 270.2 MiB of bf16
    off = _lora_estimates(tmp_path, path, "bfloat16", {"enable_lora": False}, {"lora": {"rank": 16}})
    assert not any(k.startswith("LoRA adapter slots") for k in off["rollout 0"])
    # Pushes stage the rank-16 adapter (16 x 41216 per block) where the replica serves adapters, else merged weights.
    assert on["trainer"]["ipc weight staging"] == 28 * 16 * per_block * 2
    assert off["trainer"]["ipc weight staging"] == 1_543_714_304 * 2
    full = _lora_estimates(tmp_path, path, "bfloat16", {}, {})          # auto without actor.lora: off
    assert not any(k.startswith("LoRA adapter slots") for k in full["rollout 0"])
    assert on["rollout 0"]["bfloat16 weights"] == full["rollout 0"]["bfloat16 weights"]


def test_the_adapter_slot_estimate_equals_what_the_torch_engine_allocates(tmp_path):
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.testing import make_tiny_model

    path = make_tiny_model(tmp_path / "model")
    rollout = {"max_loras": 3, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "o_proj", "down_proj"]}
    parts = _lora_estimates(tmp_path, path, "float32", {"enable_lora": True, **rollout}, {})
    engine = TorchEngine(RolloutSettings(model={"path": path}, rollout={"enable_lora": True, **rollout}))
    allocated = sum(t.numel() * t.element_size() for t in engine.adapters.buffers())
    assert parts["rollout 0"]["LoRA adapter slots (3 x rank <= 8)"] == allocated > 0


def test_a_paged_kv_pool_is_counted_at_its_budget_or_at_the_share_of_the_gpu_auto_takes(tmp_path):
    model = _qwen(tmp_path, "1.5b")
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model, "rollout.kv_cache": "paged",
                                                           "rollout.kv_cache_gib": "6"})
    rollout = next(e for e in fits.check_fits(cfg, placement, H100, trainer_devices) if e.service == "rollout 0")
    assert rollout.parts["paged KV pool (rollout.kv_cache_gib)"] == 6 * GIB
    assert not [p for p in rollout.parts if p.startswith("KV cache")]          # the pool replaces the static cache
    # Auto (kv_cache auto is paged on CUDA): room for 512 rows of 256 + 2 x max_tokens tokens; it fits beside the
    # trainer on one GPU at the recipe's 512 tokens.
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model})
    rollout = next(e for e in fits.check_fits(cfg, placement, H100, trainer_devices) if e.service == "rollout 0")
    assert rollout.parts["paged KV pool (auto: 512 rows of 256 + 2 x 512 tokens)"] == 512 * 1280 * 28 * 2 * 256 * 2
    # At 2,048 tokens that room passes half the memory free when the replica starts, so it is counted at that
    # share, at most half of what its other parts leave of the GPU; beside the trainer on one GPU that is refused,
    # naming the budget that fits (the unpaged cache's size).
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model, "rollout.max_tokens": "2048"})
    rollout = next(e for e in memory.estimate(cfg, placement, trainer_devices, H100) if e.service == "rollout 0")
    pool = rollout.parts.pop("paged KV pool (auto: 512 rows of 256 + 2 x 2048 tokens, at most 50% of the memory free "
                             "at start)")
    assert pool == (H100 - rollout.total) // 2 < 512 * 4352 * 28 * 2 * 256 * 2
    with pytest.raises(ValueError) as e:
        fits.check_fits(cfg, placement, H100, trainer_devices)
    advice = str(e.value).split("; set ", 1)[1]
    assert advice.startswith("rollout.kv_cache_gib ")
    gib = advice.split()[1]
    unpaged = next(e for e in memory.estimate(*_recipe(GPU_RECIPE, {"model.path": model, "rollout.max_tokens": "2048",
                                                                    "rollout.kv_cache": "none"})[:2])
                   if e.service == "rollout 0")
    static = next(v for k, v in unpaged.parts.items() if k.startswith("KV cache"))
    assert int(gib) == -(-static // GIB)
    fixed, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model, "rollout.max_tokens": "2048",
                                                             "rollout.kv_cache_gib": gib})
    fits.check_fits(fixed, placement, H100, trainer_devices)


def test_meshrl_up_sizes_an_auto_paged_pool_that_would_not_fit_at_what_the_unpaged_cache_takes(tmp_path, monkeypatch):
    # The one-GPU 1.5B recipe with max_tokens 2048 fitted with the unpaged cache; with the auto paged pool it would
    # be refused. `meshrl up` sizes the pool instead (and says so); an explicit budget is never replaced.
    model = _qwen(tmp_path, "1.5b")
    monkeypatch.setattr(fits, "gpu_memory", lambda: [H100])
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model, "rollout.max_tokens": "2048"})
    size, _ = fits._static_pool(cfg, placement)
    assert fits.check_recipe_fits(cfg, placement, trainer_devices) == {"rollout.kv_cache_gib": str(size)}
    assert f"rollout.kv_cache_gib: auto -> {size} " in fits.fitted_line({"rollout.kv_cache_gib": str(size)})
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model})          # the auto pool fits
    assert fits.check_recipe_fits(cfg, placement, trainer_devices) == {}
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": model, "rollout.max_tokens": "2048",
                                                           "rollout.kv_cache_gib": "60"})
    with pytest.raises(ValueError, match="needs about"):
        fits.check_recipe_fits(cfg, placement, trainer_devices)
    # Where even the unpaged cache's size does not fit, nothing is sized: the refusal names what would help.
    cfg, placement, trainer_devices = _recipe(GPU_RECIPE, {"model.path": _qwen(tmp_path, "7b")})
    assert fits.fit_auto_pool(cfg, placement, H100, trainer_devices)[1] == {}
    with pytest.raises(ValueError, match="needs about"):
        fits.check_recipe_fits(cfg, placement, trainer_devices)


def test_meshrl_up_passes_the_sized_pool_to_every_service_and_meshrl_memory_names_it(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from coordinator.cli import app, launcher

    path = _qwen(tmp_path, "1.5b")
    (Path(path) / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(fits, "gpu_memory", lambda: [H100])
    seen = {}

    def no_start(*args, overrides=None, **kwargs):
        seen.update(overrides)
        raise RuntimeError("stop before any process starts")

    monkeypatch.setattr(launcher, "Launcher", no_start)
    result = CliRunner().invoke(app, ["up", str(GPU_RECIPE), "--model.path", path, "--rollout.max_tokens", "2048"])
    assert "rollout.kv_cache_gib: auto -> " in result.output, result.output
    size = result.output.split("rollout.kv_cache_gib: auto -> ")[1].split()[0]
    assert seen["rollout.kv_cache_gib"] == size and seen["rollout.max_tokens"] == "2048"
    result = CliRunner().invoke(app, ["memory", str(GPU_RECIPE), "--gpu-gib", "80", "--model.path", path,
                                      "--rollout.max_tokens", "2048"])
    assert "does not fit" in result.output and f"meshrl up sets rollout.kv_cache_gib: auto -> {size} " in result.output
