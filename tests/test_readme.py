"""The README's benchmark table is exactly what `benchmarks/report.py` renders from the result files."""

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
    assert report.readme_table((ROOT / "README.md").read_text()) == table, "run `make bench`"


def test_every_result_file_is_in_the_table():
    report = load_report()
    used = {"capacity", "overlap", "overlap_model", "runtime_overhead", "decode_step", "active_blocks", "pass_time",
            "owner_mode", "vllm_serving", "vllm_owner_mode", "hybrid_steps"}
    assert {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")} == used
