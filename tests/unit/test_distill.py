"""On-policy distillation: the per-token reverse-KL advantage by hand, pure and added to a reward estimator's, its
metrics, and the settings it refuses by name (a KL-to-reference beside it, no teacher, another temperature, a
teacher whose tokenizer gives other ids)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from coordinator.recipe.config import AlgorithmConfig, RunConfig, distill_coef
from coordinator.recipe.data import Problem
from coordinator.recipe.distill import check_teacher_tokenizer
from coordinator.recipe.preflight import check_run
from coordinator.training.advantages import distill_advantages, grpo_advantages
from coordinator.training.phases import compute_advantages
from coordinator.training.remote import Sample
from services.common.config import load_config

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"
TRAIN = str(ARITH / "data" / "train.jsonl")


def _sample(group: int, reward: float, student: list[float], teacher: list[float]) -> Sample:
    problem = Problem(id=f"q{group}", prompt="1+1=", ground_truth="2", data_source="arith")
    n = len(student)
    s = Sample(problem, group, np.array([1, 5], dtype=np.int32), np.arange(4, 4 + n, dtype=np.int32),
               np.array(student, dtype=np.float32), "", "stop", 0, reward=reward)
    s.ref_logprobs = np.array(teacher, dtype=np.float32)
    return s


def _ctx(**algorithm):
    return SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig(**algorithm)), kl_coef=0.0,
                           kl_controller=None)


def test_the_advantage_is_the_negated_log_ratio_of_student_to_teacher_on_each_token():
    student = torch.tensor([[-0.1, -2.0, -0.5], [-1.0, -0.2, 0.0]])
    teacher = torch.tensor([[-3.0, -0.1, -0.5], [-0.3, -0.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # A token the student likes more than the teacher is pushed down, one it likes less is pushed up.
    torch.testing.assert_close(distill_advantages(student, teacher, mask, 0.5),
                               torch.tensor([[-1.45, 0.95, 0.0], [0.35, 0.0, 0.0]]))


def test_pure_distillation_ignores_the_reward_and_reports_the_reverse_kl():
    samples = [_sample(0, 1.0, [-0.1, -2.0], [-3.0, -0.1]), _sample(0, 0.0, [-1.0], [-0.3])]
    metrics = compute_advantages(_ctx(adv_estimator="distill"), samples)
    np.testing.assert_allclose(samples[0].advantages, [-2.9, 1.9], atol=1e-6)
    np.testing.assert_allclose(samples[1].advantages, [0.7], atol=1e-6)
    # log pi_student - log pi_teacher: 2.9, -1.9, -0.7 over 3 tokens.
    assert metrics["distill/reverse_kl"] == pytest.approx(0.3 / 3, abs=1e-6)
    assert metrics["distill/teacher_logprob"] == pytest.approx(-3.4 / 3, abs=1e-6)
    assert metrics["distill/kl_coef"] == 1.0


def test_a_distill_coefficient_beside_grpo_adds_the_weighted_term_to_the_group_advantage():
    samples = [_sample(0, 1.0, [-0.1, -2.0], [-3.0, -0.1]), _sample(0, 0.0, [-1.0, -1.0], [-1.0, -2.0])]
    compute_advantages(_ctx(adv_estimator="grpo", distill_kl_coef=0.1), samples)
    grpo = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    np.testing.assert_allclose(samples[0].advantages, [grpo[0] - 0.29, grpo[0] + 0.19], atol=1e-5)
    np.testing.assert_allclose(samples[1].advantages, [grpo[1], grpo[1] - 0.1], atol=1e-5)


def test_without_distillation_the_teacher_is_not_read():
    samples = [_sample(0, 1.0, [-0.1], [-3.0]), _sample(0, 0.0, [-1.0], [-0.3])]
    metrics = compute_advantages(_ctx(adv_estimator="grpo"), samples)
    assert not any(k.startswith("distill/") for k in metrics)
    assert distill_coef(AlgorithmConfig()) == 0.0 and distill_coef(AlgorithmConfig(adv_estimator="distill")) == 1.0


def test_a_sample_without_teacher_log_probs_is_refused_by_name():
    s = _sample(0, 1.0, [-0.1, -0.2], [-3.0, -0.1])
    s.ref_logprobs = []
    with pytest.raises(ValueError, match="algorithm.distill_kl_coef: sample q0#0 lacks"):
        compute_advantages(_ctx(adv_estimator="distill"), [s])


def _config(**algorithm_and_sections) -> RunConfig:
    sections = {k: v for k, v in algorithm_and_sections.items() if k in ("rollout", "reference", "actor")}
    algorithm = {k: v for k, v in algorithm_and_sections.items() if k not in sections}
    data = {"model": {"path": str(ARITH / "model")}, "rollout": {"n": 4, "max_tokens": 6},
            "reference": {"model_path": str(ARITH / "teacher")}, "data": {"train_files": [TRAIN]},
            "algorithm": {"adv_estimator": "distill", **algorithm}}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return load_config(RunConfig, data=data)


@pytest.mark.parametrize("settings,message", [
    ({"use_kl_loss": True}, "algorithm.use_kl_loss: the reference replicas serve the distillation teacher"),
    ({"adv_estimator": "grpo", "distill_kl_coef": 0.5, "use_kl_in_reward": True},
     "algorithm.use_kl_in_reward: the reference replicas serve the distillation teacher"),
    ({"distill_kl_coef": 0.0}, "algorithm.distill_kl_coef: 0 under adv_estimator distill"),
    ({"reference": {"model_path": None}}, "reference.model_path: distillation"),
    ({"reference": {"model_path": str(ARITH / "model")}}, "reference.model_path: distillation"),
    ({"rollout": {"temperature": 0.7}}, "rollout.temperature: 0.7; distillation"),
    ({"filter_groups": {"enable": True}}, "algorithm.filter_groups.enable: drops groups"),
])
def test_settings_distillation_cannot_honour_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        _config(**settings)


def test_a_recipe_that_distills_needs_a_reference_pool_even_under_lora():
    from coordinator.training.algorithms import ALGORITHMS, _mesh_roles

    assert _config().needs_reference
    assert _config(adv_estimator="grpo", distill_kl_coef=0.2).needs_reference
    # Under actor.lora the trainer answers as the reference (its base model), which is no teacher.
    lora = {"lora": {"rank": 4}}
    required, _ = _mesh_roles(_config(actor=lora), ALGORITHMS["rl"], "distillation")
    assert "reference" in required
    required, _ = _mesh_roles(_config(adv_estimator="grpo", distill_kl_coef=0.0, actor=lora, reference={}),
                              ALGORITHMS["rl"], "kl")
    assert "reference" not in required


def test_the_committed_teacher_shares_the_students_tokenizer_and_passes_preflight():
    check_teacher_tokenizer(str(ARITH / "model"), str(ARITH / "teacher"))
    check_run(_config(), world_size=1)
    check_run(_config(rollout={"n": 1}), world_size=1)     # no group baseline: one sample per prompt is enough


def _teacher_with(tmp_path: Path, edit) -> str:
    folder = tmp_path / "teacher"
    shutil.copytree(ARITH / "teacher", folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    edit(tok)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return str(folder)


def test_a_teacher_whose_tokenizer_gives_other_ids_is_refused_by_name(tmp_path):
    def swap(tok):      # "1" and "2" trade ids: the same vocabulary, other ids
        vocab = tok["model"]["vocab"]
        vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    teacher = _teacher_with(tmp_path, swap)
    with pytest.raises(ValueError, match=r"reference.model_path: the teacher's tokenizer .* other ids: \['1', '2'\]"):
        check_teacher_tokenizer(str(ARITH / "model"), teacher)
    with pytest.raises(ValueError, match="reference.model_path: the teacher's tokenizer"):
        check_run(_config(reference={"model_path": teacher}), world_size=1)


def test_teacher_replicas_are_checked_by_the_tokenizer_fingerprint_they_report(tmp_path):
    from coordinator.recipe.distill import check_teacher_replicas
    from coordinator.recipe.run_settings import Running
    from services.common.tensors.modeling import tokenizer_fingerprint

    student, teacher = str(ARITH / "model"), str(ARITH / "teacher")
    assert tokenizer_fingerprint(teacher) == tokenizer_fingerprint(student)
    other = _teacher_with(tmp_path, lambda tok: tok["model"]["vocab"].update({"1": 6, "2": 5}))
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(student)

    def replica(fingerprint):
        return Running("reference", "10.0.0.9:50051", {"reference": {"model_path": "/teachers/t"}},
                       {"tokenizer": fingerprint})
    check_teacher_replicas(student, [replica(tokenizer_fingerprint(teacher)),
                                     Running("rollout", "r:1", {}, {})])
    with pytest.raises(ValueError, match=r"reference.model_path: the teacher replica 10.0.0.9:50051 \(/teachers/t\) "
                                         r"has tokenizer [0-9a-f]{16}, the student's"):
        check_teacher_replicas(student, [replica(tokenizer_fingerprint(other))])
    with pytest.raises(ValueError, match="reports no tokenizer"):
        check_teacher_replicas(student, [replica("")])
