"""On-policy distillation's settings checks: a teacher served by the reference replicas, no KL-to-reference beside
it, and a teacher tokenizer that gives the student's token ids (the advantage compares log-probs of the same ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_distill_config(cfg: Any, coef: float) -> None:
    """Refuses, by key, a distillation the run could not honour. cfg: the RunConfig; coef: the distill_kl_coef in
    effect (coordinator/recipe/config.py distill_coef)."""
    a = cfg.algorithm
    if a.adv_estimator == "distill" and coef == 0:
        raise ValueError("algorithm.distill_kl_coef: 0 under adv_estimator distill leaves every advantage 0; "
                         "set it > 0 (1.0 is pure on-policy distillation) or pick a reward estimator")
    if coef == 0:
        return
    if a.kind != "rl":
        raise ValueError(f"algorithm.distill_kl_coef: on-policy distillation scores the student's rollouts; "
                         f"algorithm.kind {a.kind!r} makes none")
    for key in ("use_kl_loss", "use_kl_in_reward"):
        if getattr(a, key):
            raise ValueError(f"algorithm.{key}: the reference replicas serve the distillation teacher "
                             f"(reference.model_path), so a KL-to-reference term would pull toward the teacher a "
                             f"second time, not toward the initial policy; turn {key} off while distilling")
    if a.adv_estimator == "distill" and a.filter_groups.enable:
        raise ValueError("algorithm.filter_groups.enable: drops groups whose rewards are all equal, but under "
                         "adv_estimator distill the reward has no part in the advantage; turn it off")
    teacher = cfg.reference.model_path
    student = cfg.actor.model_path or cfg.model.path
    if not teacher or Path(teacher).resolve() == Path(student).resolve():
        raise ValueError("reference.model_path: distillation (algorithm.adv_estimator distill or "
                         "distill_kl_coef > 0) needs a teacher: set reference.model_path to the teacher's model "
                         "folder, which the reference replicas serve (it is the student's now)")
    if cfg.rollout.temperature != 1.0:
        raise ValueError(f"rollout.temperature: {cfg.rollout.temperature}; distillation's reverse KL compares "
                         f"the distribution the student samples from with the teacher's at temperature 1, so "
                         f"sample at 1.0")


def tokenizer_identity(path: str) -> dict[str, Any]:
    """What must agree for two models' token ids to mean the same text: the vocabulary (token -> id, added
    tokens included) and the special tokens' ids."""
    from services.common.tensors.modeling import load_tokenizer

    tok = load_tokenizer(path)
    specials = {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    return {"vocab": tok.get_vocab(), "specials": specials}


def check_teacher_tokenizer(student: str, teacher: str) -> None:
    """Refuses a teacher whose tokenizer maps tokens to other ids than the student's: its log-probs of the
    student's ids would score other text."""
    s, t = tokenizer_identity(student), tokenizer_identity(teacher)
    if s["vocab"] != t["vocab"]:
        only_s = sorted(set(s["vocab"]) - set(t["vocab"]))[:3]
        only_t = sorted(set(t["vocab"]) - set(s["vocab"]))[:3]
        moved = sorted(k for k in set(s["vocab"]) & set(t["vocab"]) if s["vocab"][k] != t["vocab"][k])[:3]
        raise ValueError(f"reference.model_path: the teacher's tokenizer ({teacher}) is not the student's "
                         f"({student}): {len(s['vocab'])} vs {len(t['vocab'])} tokens; only the student's: "
                         f"{only_s}, only the teacher's: {only_t}, other ids: {moved}. Distillation compares "
                         f"log-probs of the same token ids, so the tokenizers must match")
    if s["specials"] != t["specials"]:
        raise ValueError(f"reference.model_path: the teacher's special token ids {t['specials']} are not the "
                         f"student's {s['specials']} ({teacher} vs {student}); the tokenizers must match")


def check_teacher_replicas(student: str, running: list) -> None:
    """Refuses reference replicas (the teachers) whose tokenizer fingerprint (GetInfo details["tokenizer"]) is not
    the student's: the check of check_teacher_tokenizer for a teacher folder the coordinator cannot read. running:
    run_settings.Running of the run's services."""
    from services.common.tensors.modeling import tokenizer_fingerprint

    want = tokenizer_fingerprint(student)
    for svc in running:
        if svc.role != "reference":
            continue
        got = svc.details.get("tokenizer", "")
        if got != want:
            why = "reports no tokenizer" if not got else f"has tokenizer {got}, the student's ({student}) is {want}"
            raise ValueError(f"reference.model_path: the teacher replica {svc.address} "
                             f"({svc.settings.get('reference', {}).get('model_path') or 'model.path'}) {why}; "
                             f"distillation compares log-probs of the same token ids, so the tokenizers must match")
