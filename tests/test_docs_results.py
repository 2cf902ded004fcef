"""The docs' result tables are what their result files say (kvpop_eval/docs_results.py, `make docs-results`)."""
import json
from pathlib import Path

import pytest

from kvpop_eval import docs_results

SWEEP = {
    "tasks": 4, "scoring": "contains", "tasks_file": "build/real-tasks/test-2048.jsonl",
    "results": [
        {"policy": "full", "compression": 0.0, "accuracy": 0.75, "mean_budget": 2048.0,
         "max_peak_kv_bytes": 2**20 * 90, "tasks": 4, "correct_by_task": "1110"},
        {"policy": "kvpop:mlstm", "compression": 0.0, "accuracy": 0.75, "mean_budget": 2048.0,
         "max_peak_kv_bytes": 2**20 * 90, "tasks": 4, "correct_by_task": "1110", "note": "no eviction at 0%"},
        {"policy": "kvpop:mlstm", "compression": 0.88, "accuracy": 0.5, "mean_budget": 250.0,
         "max_peak_kv_bytes": 2**20 * 11, "tasks": 4, "correct_by_task": "1001"},
    ],
}


def marked(name: str, body: str = "stale\n") -> str:
    return f"# Doc\n\n<!-- results:{name} -->\n{body}<!-- /results -->\n\nafter\n"


def test_every_table_in_readme_and_docs_matches_its_result_file():
    stale = docs_results.render(docs_results.documents(), docs_results.RESULTS_DIR, check=True)
    assert not stale, f"run `make docs-results`: stale tables in {[str(p) for p in stale]}"


def test_every_marker_names_a_result_the_renderer_knows():
    names = {m.group("name") for path in docs_results.documents() for m in docs_results.MARKER.finditer(path.read_text())}
    assert "headline" in names
    assert names <= {"headline", *docs_results.SPECS}


def test_a_stale_table_is_rewritten_and_check_mode_reports_it(tmp_path: Path):
    (tmp_path / "quality-real-2048.json").write_text(json.dumps(SWEEP))
    (tmp_path / "manifest.json").write_text(json.dumps({"quality-real-2048": {"commit": "a" * 40}}))
    doc = tmp_path / "DOC.md"
    doc.write_text(marked("quality-real-2048"))
    assert docs_results.render([doc], tmp_path, check=True) == [doc]
    assert "stale" in doc.read_text()
    assert docs_results.render([doc], tmp_path) == [doc]
    text = doc.read_text()
    assert "stale" not in text and text.endswith("<!-- /results -->\n\nafter\n")
    assert "| kvpop:mlstm | 88% | 0.500" in text and "+1/-2" in text and "`aaaaaaaaaaaa`" in text
    assert docs_results.render([doc], tmp_path, check=True) == []


def test_a_result_not_published_yet_renders_a_placeholder(tmp_path: Path):
    doc = tmp_path / "DOC.md"
    doc.write_text(marked("service-reference"))
    docs_results.render([doc], tmp_path)
    assert "Not published yet" in doc.read_text()


def test_intervals_and_paired_counts():
    low, high = docs_results.wilson_interval(35, 48)
    assert 0.58 < low < 0.60 and 0.83 < high < 0.85
    assert docs_results.paired_counts("1100", "1010") == (1, 1)
    stats = docs_results.ratio_and_retained("1111", "1111")
    assert stats["ratio"] == 1.0 and stats["ratio_interval"] == [1.0, 1.0] and stats["retained"] == 1.0
    stats = docs_results.ratio_and_retained("0110", "1110")
    assert stats["ratio"] == pytest.approx(2 / 3) and stats["retained"] == pytest.approx(2 / 3)


def test_publish_copies_finished_runs_and_records_their_commit(tmp_path: Path):
    build, results = tmp_path / "build", tmp_path / "results"
    (build / "diverse-validation").mkdir(parents=True)
    (build / "diverse-validation" / "sweep.json").write_text(json.dumps(SWEEP))
    (build / "quality-reference-2048").mkdir()
    (build / "quality-reference-2048" / "sweep.json").write_text(json.dumps({**SWEEP, "complete": False}))
    (build / "manifest.json").write_text(json.dumps({"commit": "b" * 40}))
    assert docs_results.publish(list(docs_results.SPECS), build, results) == ["diverse-validation-2048"]
    assert json.loads((results / "diverse-validation-2048.json").read_text()) == SWEEP
    assert json.loads((results / "manifest.json").read_text())["diverse-validation-2048"]["commit"] == "b" * 40


@pytest.mark.parametrize("name", ["headline", *docs_results.SPECS])
def test_every_table_renders_from_the_committed_results(name: str):
    assert docs_results.render_table(name, docs_results.RESULTS_DIR).strip()


def test_multiturn_chats_render_every_route_and_how_many_chats_each_row_ran(tmp_path: Path):
    versus = {"tasks": 2, "ratio": 0.5, "ratio_interval": [0.0, 1.0], "retained": 0.5, "retained_interval": [0.09, 0.91],
              "gained": 0, "lost": 1}
    row = {"compression_achieved": 0.88, "mean_budget": 90.0, "mean_tokens": 750.0, "max_peak_kv_bytes": 2**20}
    routes = {route: {"results": [{**row, "policy": "full", "compression": 0.0, "tasks": 3, "accuracy": 2 / 3},
                                  {**row, "policy": "kvpop", "compression": 0.88, "tasks": 2, "accuracy": 0.5, "versus_full": versus}]}
              for route in ("sessions", "openai")}
    chats = {"tasks": 100, "scoring": "the answer", "tasks_file": "chats.jsonl", "tasks_sha256": "a" * 64, "all_chats_ran": False,
             "preregistration": {"file": "plan.json", "commits": ["c" * 40], "chats": 100}, "routes": routes}
    (tmp_path / "multiturn.json").write_text(json.dumps(chats))
    table = docs_results.render_table("multiturn", tmp_path)
    assert "| sessions | kvpop | 88% | 2 | 0.500" in table and "| OpenAI API | full | 0% | 3 |" in table
    assert "0.50 [0.00, 1.00]" in table and "not complete" in table and "`cccccccccccc`" in table
    headline = docs_results.multiturn_headline(chats)
    assert len(headline) == 2 and "3 of 100 chats run" in headline[0] and "0.500 of 2" in headline[0]
