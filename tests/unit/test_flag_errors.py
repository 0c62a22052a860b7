"""A bad key or value given by a `--section.key value` flag is named as that flag, not under the recipe file's
name (`examples/arith/grpo.yaml: rollout.tempratur: unknown key` sent the user looking in a file that never held
it); a bad key of the file keeps the file's name, and a message with both says which is which."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from coordinator.cli import app

RECIPE = str(Path(__file__).resolve().parents[2] / "examples/arith/grpo.yaml")


def say(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def test_an_unknown_flag_key_is_named_as_the_flag():
    assert say("up", RECIPE, "--rollout.tempratur", "0.5") == (
        2, "meshrl up: --rollout.tempratur: unknown key (did you mean 'temperature'?)")


def test_a_bad_flag_value_is_named_as_the_flag():
    assert say("run", RECIPE, "--run.num_steps", "0", "--coordinator", "127.0.0.1:1") == (
        2, "meshrl run: --run.num_steps: Input should be greater than or equal to 1")


def test_a_bad_key_of_the_file_keeps_the_files_name_beside_a_flags(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(RECIPE).read_text().replace("  lr: 2.0e-5", "  lrr: 2.0e-5"))
    code, out = say("up", str(recipe), "--rollout.tempratur", "0.5")
    assert code == 2
    assert out == (f"meshrl up: {recipe}: --rollout.tempratur: unknown key (did you mean 'temperature'?); actor.lrr: "
                   f"unknown key (did you mean 'lr'?)"), out
