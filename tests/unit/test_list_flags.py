"""A list or mapping key takes a `--section.key value` flag as it takes a YAML value (README: config keys come from
the YAML file, then env, then flags): written in YAML's inline form, `--data.train_files [a.jsonl,b.jsonl]`. Before,
every such flag was a string and refused (`data.train_files: Input should be a valid list`)."""

from __future__ import annotations

from pathlib import Path

from coordinator.cli.runs import _load_recipe, _recipe_args
from services.common.config import load_config
from services.common.rpc.launch import parse_args
from services.rollout.config import RolloutSettings

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples/arith"


def test_a_flag_in_yaml_inline_form_sets_a_list_key_of_the_recipe():
    train, heldout = str(ARITH / "data/train.jsonl"), str(ARITH / "data/heldout.jsonl")
    verl, overrides = _recipe_args(["--data.train_files", f"[{train}, {heldout}]", "--rollout.stop=['#', '!']",
                                    "--actor.betas", "[0.9, 0.95]", "--rollout.n", "4"])
    _, cfg = _load_recipe(ARITH / "grpo.yaml", verl, overrides)
    assert cfg.data.train_files == [train, heldout]
    assert cfg.rollout.stop == ["#", "!"] and tuple(cfg.actor.betas) == (0.9, 0.95) and cfg.rollout.n == 4


def test_a_service_started_with_a_list_flag_reads_the_list():
    args, overrides = parse_args("rollout", ["--config", str(ARITH / "grpo.yaml"), "--rollout.stop", '["###"]',
                                             "--rollout.upstream_model", "{m}"])   # a mapping, not a string
    settings = load_config(RolloutSettings, args.config, overrides={k: v for k, v in overrides.items()
                                                                     if k != "rollout.upstream_model"})
    assert settings.rollout.stop == ["###"] and overrides["rollout.upstream_model"] == {"m": None}


def test_a_value_that_is_no_yaml_list_stays_the_string_given():
    # A bracketed IPv6 address is a string key's value, not a list that failed to parse.
    assert parse_args("trainer", ["--trainer.address", "[::1]:50051"])[1] == {"trainer.address": "[::1]:50051"}
