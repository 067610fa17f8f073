"""`kvpp-fx demo`: launched by torch's elastic launcher in-process, and by torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank


def check_outputs(report, tmp_path, kvpp_mode="broadcast"):
    assert report["tokens_identical"] is True
    assert report["ranks"] == 2 and report["kvpp_mode"] == kvpp_mode
    assert [r["owned_layers"] for r in report["per_rank"]] == [[0, 1], [2, 3]]
    steps = report["steps"]
    if kvpp_mode == "owner":
        assert all(r["broadcasts"] == 0 and r["exchanges"] == 4 * len(steps) for r in report["per_rank"])
        # per layer and query token: the other rank's 2 heads of q (40 values) in and output (32) out, fp32
        for st in steps:
            assert st["mode"] == "owner" and st["broadcast_bytes"] == 0
            assert st["owner_bytes"] == 4 * st["tokens"] * 2 * (40 + 32) * 4
    else:  # "auto" on the CPU bench's link model: the tiny model's steps are all cheaper to broadcast
        assert all(r["broadcasts"] > 0 and r["exchanges"] == 0 for r in report["per_rank"])
        assert steps[0]["broadcast_bytes"] == 0  # the first prefill has no history
        for st in steps[1:]:  # active blocks: each step moves its read blocks of the 4 layers, not the pool
            assert st["mode"] == "broadcast" and 0 < st["active_blocks"] < st["pool_blocks"]
            assert st["broadcast_bytes"] == 4 * st["active_blocks"] * ((32 + 8) * 4 * 16 + 8)  # fp32 latent+rope, id
    trace = json.loads((tmp_path / "trace.json").read_text())
    categories = {e.get("cat") for e in trace["traceEvents"]}
    assert {"prefetch", "wait", "piece:eager", "piece:compiled"} <= categories
    assert ("broadcast" in categories) == (kvpp_mode != "owner")
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert list((tmp_path / "graphs").glob("rank*/graph_*/index.json"))


def test_demo_json_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpp_fx", "demo", "--preset", "tiny", "--kv-memory", "16MiB",
                          "--json", "--trace", str(tmp_path / "trace.json"), "--dump-dir", str(tmp_path / "graphs")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    check_outputs(json.loads(out.stdout), tmp_path, "auto")


def test_demo_under_torchrun_in_owner_mode(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "kvpp_fx.cli.demo", "--preset", "tiny",
                          "--kv-memory", "16MiB", "--json", "--trace", str(tmp_path / "trace.json"),
                          "--dump-dir", str(tmp_path / "graphs"), "--kvpp-mode", "owner"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    check_outputs(json.loads(out.stdout), tmp_path, "owner")


def test_report_marks_differing_tokens_and_the_demo_fails(monkeypatch, capsys):
    from kvpp_fx.cli import demo

    def rank_result(rank, on_tokens):
        run = {"outputs": on_tokens, "num_blocks": 10, "kv_memory": 1 << 20, "decode_step_s": [0.01], "steps": [],
               "dump_dir": None, "stats": {"persistent_layers": [rank], "allocated_bytes": 1, "broadcasts": 1,
                                           "bytes": 1, "exchanges": 0, "modes": {"broadcast": 1, "owner": 0}}}
        return {"rank": rank, "on": run, "off": dict(run, outputs=[[1, 2, 3]])}

    monkeypatch.setattr(demo, "launch",
                        lambda nproc, options: [rank_result(0, [[1, 2, 4]]), rank_result(1, [[1, 2, 3]])])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = demo.argparse.Namespace(nproc=2, preset="tiny", mode="eager", inner="eager", kv_memory="1MiB",
                                   trace="", dump_dir="", json=False, kvpp_mode="auto", context_tokens=0,
                                   token_budget=None)
    assert demo.run_demo(args) == 1
    assert "tokens identical to the replicated run: ✗" in capsys.readouterr().out
