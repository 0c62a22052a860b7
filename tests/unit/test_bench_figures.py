"""The figures users read (README.md, docs/, bench/README.md) are the numbers in bench/results/*.json."""
import json
import re
from pathlib import Path

import pytest

from bench import docs, provenance

REPO = Path(__file__).resolve().parents[2]
# A number with a unit a benchmark would report: 5.6x, x5.64, 92.0%, 0.93 s, 44.9 ms, 1.06 GB/s, 60,368 tok/s.
FIGURE = re.compile(r"(?<![\w.\-/])\d[\d,]*(?:\.\d+)?\s?(?:x\b|×|%|ms\b|s\b|GB/s|tok/s|steps/s|samples/s)"
                    r"|(?<![\w.])[x×]\d+\.\d+")
# Unmarked figures left per file (bench/README.md's prose: the report of #28 lists them). A count may only go
# down: a new figure comes marked, from its JSON (`make bench-docs`). docs/*.md are not counted: their
# numbers are mostly settings (timeouts, intervals, shares of a cluster), and their measured figures carry marks.
UNMARKED_AT_MOST = {"README.md": 0, "bench/README.md": 103}


def unmarked_figures(text: str) -> list[str]:
    text = docs.FIG.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)   # commands, not figures
    text = re.sub(r"`[^`\n]*`", "", text)                # names and settings
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return [m.group(0) for m in FIGURE.finditer(text)]


@pytest.mark.parametrize("rel", docs.DOCS)
def test_every_marked_figure_equals_its_json(rel):
    # Stale marks are refreshed by `make bench-docs`, not checked here: a whole-mesh figure goes stale with
    # any change to services/ or coordinator/, and a suite that failed on every such commit would be a tripwire.
    text = (REPO / rel).read_text()
    diffs = docs.differences(text, docs.fill(text, {}, stale_marks=False))
    assert not diffs, f"{rel}: run `make bench-docs`:\n" + "\n".join(diffs)


def test_the_headline_figures_are_marked():
    readme = (REPO / "README.md").read_text()
    specs = [m["spec"] for m in docs.FIG.finditer(readme)]
    for needed in ("demo_cpu:heldout_accuracy_after", "demo_cpu:run_seconds", "vs_trl_cpu:ratio_meshrl_over_trl"):
        assert any(s.startswith(needed) for s in specs), f"README.md has no figure from {needed}"
    # GPU figures are measured by hand on a lent machine and go stale with the next change to the services: the
    # front page points to docs/gpu.md and bench/README.md for them rather than showing a stale note.
    assert not [s for s in specs if s.split(":")[0].endswith("_gpu")], "README.md shows a GPU figure"
    # The front page gives each figure once, from the latest call: a file's history stays in bench/README.md.
    assert not any(".earlier_calls" in s or ":earlier_calls" in s for s in specs)
    for stem in {s.split(":")[0] for s in specs}:
        assert f"<!-- stale: {stem} -->" in readme, f"README.md shows {stem}.json without its stale mark"


@pytest.mark.parametrize("rel", sorted(UNMARKED_AT_MOST))
def test_no_new_figure_goes_unmarked(rel):
    found = unmarked_figures((REPO / rel).read_text())
    assert len(found) <= UNMARKED_AT_MOST[rel], f"{rel}: figures without a JSON mark: {found}"


def test_every_results_file_names_the_commit_it_was_measured_at():
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        _, commit = provenance.staleness(path.stem, data)
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), f"{path.name}: no commit ({commit!r})"


def test_render_lists_every_call_and_computes_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "RESULTS", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"calls": [{"x": 6.134}, {"x": 4.15}], "a": 3.0, "b": 2.0, "p": 0.036}))
    assert docs.render("r:calls.*.x|{:.2f}x", {}) == "6.13x, 4.15x"
    assert docs.render("r:a|over=b|gain|pct|{:+.0f}%", {}) == "+50%"
    assert docs.render("r:p|pct|{:.1f}%", {}) == "3.6%"
    text = "<!-- fig: r:a|{:.1f} -->9.9<!-- /fig -->"
    assert docs.differences(text, docs.fill(text, {})) == ["r:a|{:.1f}: doc says '9.9', JSON gives '3.0'"]
    with pytest.raises(docs.FigureError, match="r:missing: no 'missing'"):
        docs.render("r:missing", {})


def test_a_stamped_result_turns_stale_when_the_code_it_measures_changes(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "engine.py").write_text("x = 1\n")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.setitem(provenance.SOURCES, "toy", ["src"])
    data = provenance.stamp("toy", {})
    assert data["provenance"]["source_digest"] == provenance.source_digest("toy", tmp_path)
    assert provenance.staleness("toy", data)[0] is False
    (tmp_path / "src" / "engine.py").write_text("x = 2\n")
    assert provenance.staleness("toy", data)[0] is True


def test_a_named_commit_that_is_not_the_git_head_leaves_the_edits_untold(monkeypatch):
    # A GPU machine's copy of the tree may carry an older .git: its status would compare the wrong commit.
    monkeypatch.setenv("MESHRL_COMMIT", "0000000")
    prov = provenance.stamp("lora_train", {})["provenance"]
    assert prov["commit"] == "0000000" and prov["tree_had_uncommitted_edits"] is None
    head = provenance._git("rev-parse", "--short", "HEAD").stdout.strip()
    if head:                                     # a clone: the named commit is git's own, so git can tell
        monkeypatch.setenv("MESHRL_COMMIT", head)
        assert provenance.stamp("lora_train", {})["provenance"]["tree_had_uncommitted_edits"] is not None
