"""report.png's panels: a metric logged every k steps is drawn as points at those steps (not a line with gaps that
shows nothing), and a panel whose metrics the run never logged is left out (no empty panel)."""

import json
import math

import pytest

from coordinator.cli.report import TIME_TITLE, figure, plot_run, read_metrics


def _run(tmp_path, num_steps=30, parity_every=10):
    records = [{"step": 0, "heldout_accuracy": 0.3}]
    for step in range(1, num_steps + 1):
        m = {"step": step, "reward_mean": step / num_steps, "accuracy": step / num_steps, "kl": 0.001 * step,
             "actor/entropy": 1.0 - step / 100, "time/generate": 0.2, "time/train": 0.1}
        if step == 1 or step % parity_every == 0:
            m["rollout_vs_trainer/logprob_abs_diff"] = 0.01 * step
        records.append(m)
    records.append({"step": num_steps, "heldout_accuracy": 0.9, "final": 1.0})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    return run


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_a_metric_logged_every_ten_steps_is_drawn_as_points_at_those_steps(tmp_path):
    fig = figure(read_metrics(_run(tmp_path)))
    (line,) = _axes(fig)["rollout vs trainer |dlogp|"].get_lines()
    assert line.get_marker() == "o"
    assert list(line.get_xdata()) == [1, 10, 20, 30]
    assert all(math.isfinite(v) for v in line.get_ydata())     # no NaN gaps: every point is drawn
    # A metric of every step stays a line; held-out accuracy (before and after) is points too.
    reward, accuracy, heldout = _axes(fig)["reward and accuracy"].get_lines()
    assert reward.get_marker() in ("None", "", None) and len(reward.get_xdata()) == 30
    assert heldout.get_marker() == "o" and list(heldout.get_xdata()) == [0, 30]


def test_a_panel_whose_metrics_were_never_logged_is_left_out(tmp_path):
    fig = figure(read_metrics(_run(tmp_path)))
    titles = set(_axes(fig))
    # response_length_mean is in no record: no panel for it, and no blank cell left where it would sit.
    assert "response length (tokens)" not in titles
    assert titles == {"reward and accuracy", "KL(actor || reference)", "entropy", "rollout vs trainer |dlogp|",
                      TIME_TITLE}
    assert all(ax.has_data() for ax in fig.axes)


def test_the_parity_panel_goes_when_the_run_never_logged_the_metric(tmp_path):
    records = read_metrics(_run(tmp_path, num_steps=5))
    assert "rollout vs trainer |dlogp|" in _axes(figure(records))       # step 1 has it
    for m in records:
        m.pop("rollout_vs_trainer/logprob_abs_diff", None)
    assert "rollout vs trainer |dlogp|" not in _axes(figure(records))


def test_plot_run_writes_the_png(tmp_path):
    out = plot_run(_run(tmp_path))
    assert out.name == "report.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
