"""CI cannot pass by accident: ``.ci/run`` fails when the README has no test command for it."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "the-test-command-ran"


def _readme_command_line(lines):
    """The index of the line ``.ci/run`` runs: the first after a ```bash line following the "Tests " line."""
    tests = next(i for i, line in enumerate(lines) if line.startswith("Tests "))
    fence = next(i for i in range(tests, len(lines)) if lines[i].startswith("```bash"))
    return fence + 1


def _ci_run(tmp_path, readme: str) -> subprocess.CompletedProcess:
    """``.ci/run`` copied into a tree laid out as the repository's, with ``readme`` as its README.md."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(readme)
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


def _readme_with_the_command_replaced():
    """The repository's README, its test command replaced by an echo (so nothing real is ever run here)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    at = _readme_command_line(lines)
    assert "pytest" in lines[at], lines[at]  # the README's test command, which these tests never run
    lines[at] = f"echo {MARK}"
    return lines


def test_ci_run_runs_the_readme_s_test_command(tmp_path):
    """The control: the README as it is (its command swapped for an echo) runs that command, and exits 0."""
    res = _ci_run(tmp_path, "\n".join(_readme_with_the_command_replaced()) + "\n")
    assert res.returncode == 0 and res.stdout.splitlines() == [f"+ echo {MARK}", MARK], (res.stdout, res.stderr)


@pytest.mark.parametrize("doctor", ["no Tests line", "Tests line reworded", "no bash block after it"])
def test_ci_run_fails_when_it_cannot_find_the_readme_s_test_command(tmp_path, doctor):
    lines = _readme_with_the_command_replaced()
    tests = next(i for i, line in enumerate(lines) if line.startswith("Tests "))
    if doctor == "no Tests line":
        del lines[tests]
    elif doctor == "Tests line reworded":
        lines[tests] = "The tests (what CI runs through `.ci/run`):"
    else:
        lines = [line.replace("```bash", "```sh") if i >= tests else line for i, line in enumerate(lines)]
    res = _ci_run(tmp_path, "\n".join(lines) + "\n")
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert ".ci/run: no test command in README.md" in res.stderr and "nothing run" in res.stderr, res.stderr
    assert MARK not in res.stdout + res.stderr
