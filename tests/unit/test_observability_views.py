"""`meshrl trace`'s tree and critical path, and `meshrl watch`'s sparklines and warnings, on hand-made data."""

import json

import pytest

from coordinator.cli import traces, watch
from coordinator.client import Replica, RunStatus

MS = 1_000_000


def span(span_id, parent, name, start_ms, end_ms, **attributes):
    return {"trace_id": "t" * 32, "span_id": span_id, "parent_id": parent, "name": name, "kind": "internal",
            "start_ns": start_ms * MS, "end_ns": end_ms * MS, "status": "unset", "attributes": attributes}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_critical_path_follows_the_child_that_ended_last_at_each_level(tmp_path):
    path = tmp_path / "traces.jsonl"
    write(path, [
        span("b", "a", "generate", 0, 40), span("c", "b", "Rollout/Generate", 1, 39),
        span("d", "a", "reward", 40, 50), span("e", "a", "reference", 40, 70),     # concurrent; reference ends last
        span("f", "e", "Reference/ComputeLogProbs", 41, 69), span("g", "a", "train", 70, 90),
        span("h", "a", "weight_sync", 90, 95),
        span("a", None, "step 2", 0, 100, **{"meshrl.step": 2, "meshrl.run_id": "r"}),
    ])
    root = traces.load_step(path, 2)
    assert [s.name for s in traces.critical_path(root)] == ["step 2", "weight_sync"]
    reference = next(c for c in root.children if c.name == "reference")
    assert [s.name for s in traces.critical_path(reference)] == ["reference", "Reference/ComputeLogProbs"]
    lines = traces.render(root)
    assert lines[0].startswith("step 2  100.0 ms")
    assert [line.split()[1] for line in lines[1:-1] if line.startswith(("├", "└"))] == \
        ["generate", "reward", "reference", "train", "weight_sync"]     # in start order
    marked = [line for line in lines if " * +" in line]
    assert len(marked) == 1 and "weight_sync" in marked[0] and "5.0 ms" in marked[0]
    assert lines[-1] == "critical path: weight_sync 5.0 ms"


def test_a_step_that_was_not_traced_names_the_traced_steps(tmp_path):
    path = tmp_path / "traces.jsonl"
    write(path, [span(f"s{i}", None, f"step {i}", 0, 1, **{"meshrl.step": i}) for i in (1, 2, 3)])
    with pytest.raises(ValueError, match=r"step 9: not in .*traced steps: 1-3"):
        traces.load_step(path, 9)
    with pytest.raises(ValueError, match=r"run 'nope': no traces.jsonl"):
        traces.trace_file("nope", tmp_path)


def test_sparkline_scales_between_min_and_max_and_skips_missing_values():
    assert watch.sparkline([0.0, 0.5, 1.0, float("nan")]) == "▁▅█"
    assert watch.sparkline([]) == ""
    assert watch.sparkline([2.0, 2.0]) == "▁▁"
    assert len(watch.sparkline(list(range(100)))) == watch.SPARK_WIDTH


def test_the_last_warning_is_the_runs_message_then_unhealthy_or_lagging_replicas():
    status = RunStatus("r", "RUNNING", 5, 10, 5, 80, "", "", "runs/r")
    replicas = [Replica("rollout", "a:1", True, 5, 0), Replica("rollout", "b:1", True, 4, 0),
                Replica("reward", "c:1", False, -1, 0)]
    assert watch.warnings(status, replicas) == ["rollout replica b:1 serves weight version 4 < 5",
                                                "reward replica c:1 is unhealthy"]
    paused = RunStatus("r", "PAUSED", 5, 10, 5, 80, "", "trainer unavailable", "runs/r")
    assert watch.warnings(paused, [])[-1] == "paused: trainer unavailable"
