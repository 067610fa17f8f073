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
                "docs/graph-contract.md", "docs/design-blocks.md", "docs/design-owner.md", "docs/vllm-pd.md"):
        assert f"]({doc})" in readme and (ROOT / doc).exists(), doc


def test_every_doc_is_short_and_every_link_between_them_resolves():
    """Each page of docs/ fits in 30 KB; every relative link of the README and of docs/ names a file that
    exists. The control: a link to a missing page is found."""
    import re

    pages = sorted((ROOT / "docs").glob("*.md"))
    assert len(pages) >= 10
    for page in pages:
        assert len(page.read_bytes()) <= 30 * 1024, (page.name, len(page.read_bytes()))

    def broken(path, text):
        links = re.findall(r"\]\(([^)#:\s]+\.md)\)", text)
        return [link for link in links if not (path.parent / link).exists()]

    for path in (ROOT / "README.md", *pages):
        assert broken(path, path.read_text()) == [], path.name
    assert broken(ROOT / "docs" / "vllm.md", "[x](vllm-nowhere.md)") == ["vllm-nowhere.md"]


def test_every_result_file_is_in_the_table():
    used = {"capacity", "overlap", "overlap_model", "runtime_overhead", "decode_step", "active_blocks", "pass_time",
            "owner_mode", "vllm_serving", "vllm_owner_mode", "hybrid_steps", "pd_prefill", "step_host_cost",
            "vllm_prefill_history", "history_overlap", "vllm_deepseek_v4", "vllm_serving_deepseek_v4",
            "vllm_owner_mode_deepseek_v32"}
    assert {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")} == used
