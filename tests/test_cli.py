import json
import math
import subprocess
import sys

import pytest

from kvpp_fx.cli import main
from kvpp_fx.plan_report import parse_bytes


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvpp_fx", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_deepseek_v3_tp8_ratio_matches_formula(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--tp", "8", "--kv-memory", "64GiB",
                 "--block-size", "128", "--staging-fraction", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    formula = 61 / (math.ceil(61 / 8) + 2)
    assert abs(report["capacity_ratio"] - formula) / formula < 1e-3
    assert report["worst_rank"] == 0
    assert [len(r["owned_layers"]) for r in report["ranks"]] == [8, 8, 8, 8, 8, 7, 7, 7]
    bpb = 576 * 2 * 128
    assert report["replicated"]["bytes_per_block"] == 61 * bpb
    assert report["ranks"][0]["bytes_per_block"] == (8 + 2) * bpb
    for r in report["ranks"]:
        assert r["tokens"] == r["blocks"] * 128
        assert r["allocated_bytes"] <= 64 * 2**30


def test_plan_table_names_the_ratio():
    out = run_cli("plan", "--model", "deepseek-v3", "--tp", "8", "--kv-memory", "64GiB")
    assert out.returncode == 0, out.stderr
    # 25 % staging (default) costs a quarter of a layer per rank: 61 / (8 + 2 + 0.25 * (1 + 8/bpb))
    assert "capacity ratio (worst rank 0): 5.95" in out.stdout
    assert "without staging: 6.10" in out.stdout
    assert "repl" in out.stdout and "0-7 (8)" in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["plan", "--model", "llama-3", "--tp", "8"], "unknown model 'llama-3'"),
    (["plan", "--model", "deepseek-v3", "--tp", "0"], "--tp"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--kv-memory", "lots"], "memory size"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--kv-dtype", "fp4"], "--kv-dtype"),
    (["plan", "--tp", "8"], "--model"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--depth", "1"], "scratch depth must be at least 2"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--staging-fraction", "1.5"], "fraction in [0, 1]"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--context-tokens", "-5"], "non-negative"),
    (["plan", "--model", "deepseek-v3", "--tp", "8", "--context-tokens", "5", "--link-gbps", "0"], "positive"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_options_exit_2_with_one_line(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_shard_draft_reports_gain(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--tp", "4", "--mtp", "--shard-draft", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_layers"] == [61]
    assert report["draft_sharding_gain"] > 1.0


def test_parse_bytes():
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("40 GB") == 40 * 10**9
    assert parse_bytes("1.5MiB") == 3 * 2**19
    assert parse_bytes("123") == 123


def test_graph_command_prints_the_rewritten_reference_graph():
    out = run_cli("graph", "--layers", "2", "--mode", "piecewise")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert text.splitlines()[1].strip() == "kvpp_prefetch_L0 = torch.ops.kvpp.prefetch.default(0, 0)"
    assert "kvpp_ref.write_kv(kv_L0," in text and "kvpp_ref.mla_attention(q_latent, q_pe_1, kv_L0," in text
    assert "submod_2 [eager]: kvpp.wait(0, 0, [l_caches_0_0_], ['kv']); kvpp.prefetch(1, 1)" in text
    assert "kvpp.prefetch(2" not in text


def test_plan_prints_the_transfer_cost_of_a_step(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--tp", "8", "--kv-memory", "64GiB", "--json",
                 "--context-tokens", "100000", "--link-gbps", "400"]) == 0
    report = json.loads(capsys.readouterr().out)
    cost = report["transfer_cost"]
    bpb = 576 * 2 * 128                      # one layer's latent cache per block, bf16
    pool = report["engine_blocks"]
    active = math.ceil(100_000 / 128)        # 782 blocks
    assert cost["active_blocks"] == active and cost["path"] == "active-block"
    assert cost["whole_layer"]["bytes_per_layer"] == pool * bpb
    assert cost["whole_layer"]["bytes_per_forward"] == 61 * pool * bpb
    assert cost["active_block"]["bytes_per_layer"] == active * (bpb + 8)
    assert cost["active_block"]["bytes_per_forward"] == 61 * active * (bpb + 8)
    assert cost["active_block"]["seconds_per_forward"] == pytest.approx(61 * active * (bpb + 8) / 400e9)
    assert cost["whole_layer"]["seconds_per_forward"] > 50 * cost["active_block"]["seconds_per_forward"]


def test_a_step_beyond_the_staging_capacity_is_costed_whole_layer(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--tp", "8", "--kv-memory", "64GiB", "--json",
                 "--context-tokens", str(128 * 30_000)]) == 0
    cost = json.loads(capsys.readouterr().out)["transfer_cost"]
    assert cost["active_blocks"] > cost["pool_blocks"] * 0.25 and cost["path"] == "whole-layer"
    assert cost["active_block"] == cost["whole_layer"]
    out = run_cli("plan", "--model", "deepseek-v3", "--tp", "8", "--context-tokens", "1000")
    assert "active-block path" in out.stdout and "ms/forward" in out.stdout
