"""The benchmark tables (README's headlines, docs/benchmarks.md's every row) are exactly what
`benchmarks/report.py` renders from the result files; the README stays short."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_benchmark_table_matches_the_results():
    report = load_report()
    table = report.table()
    assert table.count("\n") >= 10
    assert report.readme_table((ROOT / "docs" / "benchmarks.md").read_text()) == table, "run `make bench`"
    headlines = report.table(headlines=True)
    assert headlines.count("\n") == len(report.HEADLINES) + 1 and "| same |" not in headlines
    assert report.readme_table((ROOT / "README.md").read_text()) == headlines, "run `make bench`"


def test_the_readme_is_short_and_links_its_details():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024, len(readme.encode())
    for doc in ("docs/benchmarks.md", "docs/cli.md", "docs/usage.md", "docs/vllm.md", "docs/design.md",
                "docs/graph-contract.md"):
        assert f"]({doc})" in readme and (ROOT / doc).exists(), doc


def test_every_result_file_is_in_the_table():
    used = {"capacity", "overlap", "overlap_model", "runtime_overhead", "decode_step", "active_blocks", "pass_time",
            "owner_mode", "vllm_serving", "vllm_owner_mode", "hybrid_steps", "pd_prefill"}
    assert {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")} == used
