"""`examples/compile_your_model.py`, run as the README says (torchrun, 2 CPU ranks), with faults as negative
controls; and the README's "Use it" section shows the file's marked excerpt, its command and its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpp_fx.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = Path("examples") / "compile_your_model.py"
README_COMMAND = f"torchrun --nproc-per-node 2 {EXAMPLE}"
STEPS = 5  # the prefill and 4 decode steps

# 8 layers, one fp32 component of 32 values per token, 16 tokens per block: 2 KiB per layer and block, in
# 64 MiB per rank. Replicated: 8 buffers of 8 MiB, 4096 blocks. KVPP on 2 ranks: 4 owned buffers of
# 10 MiB (5120 blocks) and 2 whole-layer scratch slots of 5120 blocks of 2 KiB + an 8-byte id (10.04 MiB,
# padded to 12 MiB): 64 MiB; one block more pads every owned buffer to 12 MiB.
CAPACITY = "5120 blocks vs 4096 replicated in 64 MiB (1.25x)"
LINE = re.compile(r"rank (\d): logits of (\d+) steps \(([a-z0-9, ]+)\) (.+); (.+)")


def run_example(*args: str) -> subprocess.CompletedProcess:
    """The README's command, with the venv's launcher on a free port; `args` go to the example."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # ranks import tests.support.faults
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(EXAMPLE), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)


def rank_reports(stdout: str) -> dict[int, tuple[int, dict[str, int], str, str]]:
    """Each rank's (steps, forwards per mode, verdict, capacity) from the lines rank 0 prints."""
    reports = {}
    for line in stdout.splitlines():
        match = LINE.fullmatch(line)
        assert match, f"unexpected output line {line!r}"
        rank, steps, modes, verdict, capacity = match.groups()
        counts = {mode: int(n) for mode, n in (part.split(" ") for part in modes.split(", "))}
        reports[int(rank)] = (int(steps), counts, verdict, capacity)
    assert sorted(reports) == [0, 1], stdout
    return reports


@pytest.mark.multirank
@pytest.mark.parametrize("mode", [None, "owner"])
def test_the_example_matches_kvpp_off(mode):
    out = run_example(*(["--kvpp-mode", mode] if mode else []))
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    for steps, modes, verdict, capacity in rank_reports(out.stdout).values():
        assert (steps, verdict, capacity) == (STEPS, "identical to KVPP off", CAPACITY)
        assert sum(modes.values()) == STEPS and set(modes) <= {"broadcast", "owner"}
        if mode == "owner":
            assert modes == {"owner": STEPS}
    if mode is None:
        assert out.stdout.splitlines() == readme_output(read_readme()), "the README shows another output"


# The negative controls: a fault in the runtime's seam (a DeviceAPI named on the command line) must make the
# example's comparison fail, on both ranks (the TP all-reduce carries a wrong head into every rank's output).
# A broadcast of layer 2 arriving as zeros breaks the steps that read its history: all but the prefill. Owner
# mode's outputs going to the wrong rank break every step, the prefill included.
@pytest.mark.multirank
@pytest.mark.parametrize("mode, fault, wrong_steps", [
    ("broadcast", "dropped_broadcast_of_layer_2", [1, 2, 3, 4]),
    ("owner", "SwappedHeads", [0, 1, 2, 3, 4]),
])
def test_a_fault_makes_the_example_fail(mode, fault, wrong_steps):
    out = run_example("--kvpp-mode", mode, "--device-api", f"tests.support.faults:{fault}")
    assert out.returncode != 0
    for steps, modes, verdict, capacity in rank_reports(out.stdout).values():  # the run got to its comparison
        assert (steps, modes, capacity) == (STEPS, {mode: STEPS}, CAPACITY)
        assert verdict == f"DIFFER from KVPP off at steps {wrong_steps}"


# --- the README shows the example --------------------------------------------------------------------------

def read_readme() -> str:
    return (ROOT / "README.md").read_text()


def use_it_section(readme: str) -> str:
    return readme.split("\n## Use it", 1)[1].split("\n## ", 1)[0]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)


def readme_code(readme: str) -> str:
    """The python code block of the README's "Use it" section."""
    (code,) = [text for language, text in fenced_blocks(use_it_section(readme)) if language == "python"]
    return code


def readme_output(readme: str) -> list[str]:
    """The lines of the section's plain code block: the example's output."""
    (output,) = [text for language, text in fenced_blocks(use_it_section(readme)) if not language]
    return output.splitlines()


def excerpt(source: str) -> str:
    """The example's lines between ``# region readme`` and ``# endregion readme``, dedented."""
    import textwrap

    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == "# region readme")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# endregion readme")
    return textwrap.dedent("".join(lines[start + 1:end]))


def readme_shows(readme: str, source: str) -> bool:
    return readme_code(readme) == excerpt(source)


def test_the_readme_shows_the_example_excerpt():
    readme, source = read_readme(), (ROOT / EXAMPLE).read_text()
    assert readme_shows(readme, source), "copy the example's `# region readme` lines into the README"
    assert 20 <= len(excerpt(source).splitlines()) <= 30
    section = use_it_section(readme)
    assert section.index(README_COMMAND) < section.index("```python")
    assert f"]({EXAMPLE.as_posix()})" in section  # the whole file, linked


def test_one_changed_line_of_the_excerpt_is_seen():
    readme, source = read_readme(), (ROOT / EXAMPLE).read_text()
    lines = source.splitlines(keepends=True)
    changed = next(i for i, line in enumerate(lines) if "backend = kvpp_backend(" in line)
    altered = "".join(lines[:changed] + [lines[changed].replace("piecewise", "eager", 1)] + lines[changed + 1:])
    assert altered != source
    assert not readme_shows(readme, altered)
    assert not readme_shows(readme, source.replace("# endregion readme", "x = 1\n    # endregion readme"))
