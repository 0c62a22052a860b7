"""Activation checkpointing on a gloo mesh: a FSDP, TP or pipelined trainer with
actor.activation_checkpointing on takes the step of a single process with it off (loss, log-probs, exported
weights under the model's own names, and a checkpoint that resumes on one rank)."""

from __future__ import annotations

import pytest

from tests.multiproc.test_trainer_mesh import check_against_single_process


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, budget=24, checkpointing="full"), dict(tp=2, checkpointing="selective"),
                                  dict(pp=2, schedule="1f1b", checkpointing="full"),
                                  dict(dp=2, dp_mode="ddp", budget=24, checkpointing="selective")],
                         ids=["fsdp-dp2-full", "tp2-selective", "pp2-full", "ddp-dp2-selective"])
def test_a_checkpointed_mesh_step_matches_a_single_process_run_without(tmp_path, mesh):
    check_against_single_process(tmp_path, **mesh)
