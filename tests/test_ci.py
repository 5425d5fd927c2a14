"""CI cannot pass by accident: ``.ci/run`` fails when the README has no test command for it, and under
``CI=true`` a part the test dependency group installs that is missing fails the run instead of skipping its tests."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import missing_parts, required_modules

ROOT = Path(__file__).resolve().parent.parent
MARK = "the-test-command-ran"


def _tree(tmp_path, lines) -> None:
    """``.ci/run`` copied into a tree laid out as the repository's, with ``lines`` as its README.md, and a
    stand-in ``./pytest`` that prints "pytest" and its arguments."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text("\n".join(lines) + "\n")
    (tmp_path / "pytest").write_text('#!/bin/sh\necho pytest "$@"\n')
    (tmp_path / "pytest").chmod(0o755)


def _ci_run(tmp_path, lines) -> subprocess.CompletedProcess:
    _tree(tmp_path, lines)
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


def _readme():
    """The repository's README with every line of its ```bash blocks a stand-in (so nothing real is ever run
    here, whichever block a broken ``.ci/run`` would pick): the test command's line ``./pytest MARK``, the
    others' ``echo ran-block-N``; the index of the "Tests ..." line naming .ci/run, and of the block's fence."""
    lines = (ROOT / "README.md").read_text().splitlines()
    tests = next(i for i, line in enumerate(lines) if line.startswith("Tests ") and ".ci/run" in line)
    fence = next(i for i in range(tests + 1, len(lines)) if lines[i].strip())
    assert lines[fence] == "```bash" and "pytest" in lines[fence + 1], lines[tests : fence + 2]  # the command
    inside = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            inside = line.startswith("```bash") and not inside
        elif inside:
            lines[i] = f"./pytest {MARK}" if i == fence + 1 else f"echo ran-block-{i}"
    return lines, tests, fence


def test_ci_run_runs_the_readme_s_test_command(tmp_path):
    """The control: the README as it is (its commands swapped for stand-ins) runs its test command, alone."""
    lines, _, _ = _readme()
    res = _ci_run(tmp_path, lines)
    assert res.returncode == 0 and res.stdout.splitlines() == [f"+ ./pytest {MARK}", f"pytest {MARK}"], \
        (res.stdout, res.stderr)


@pytest.mark.parametrize("command, said", [
    ("echo {MARK}", "runs no pytest"),
    (".venv/bin/python -m pytest -q -k 'not slow' && echo {MARK}", "gives pytest '-k'"),
    (".venv/bin/python -m pytest -q -m 'not ray' && echo {MARK}", "gives pytest '-m'"),
    (".venv/bin/python -m pytest -q --deselect tests/test_ci.py && echo {MARK}", "gives pytest '--deselect'"),
    (".venv/bin/python -m pytest -q --ignore tests/gpu && echo {MARK}", "gives pytest '--ignore'"),
    (".venv/bin/python -m pytest -q -x && echo {MARK}", "gives pytest '-x'"),
    (".venv/bin/python -m pytest -q --lf && echo {MARK}", "gives pytest '--lf'"),
    (".venv/bin/python -m pytest -q -knot_slow && echo {MARK}", "gives pytest '-k'"),
    ("echo pytest {MARK} || true", "holds '|'"),
    (".venv/bin/python -m pytest -q | tee log && echo pytest {MARK}", "holds '|'"),
    ("echo $(echo pytest) {MARK}", "holds '$('"),
    ("echo pytest {MARK}; true", "holds ';'"),
    ("PYTEST_ADDOPTS='-k x' echo pytest {MARK}", "holds 'PYTEST_ADDOPTS'"),
    ("echo pytest {MARK}", "does not end by running pytest"),
    ("./pytest -q && echo pytest {MARK}", "does not end by running pytest"),
    ("python3 -c 'import pytest' {MARK}", "does not end by running pytest"),
])
def test_ci_run_refuses_a_test_command_that_leaves_tests_unrun_or_forgives_a_failure(tmp_path, command, said):
    lines, _, fence = _readme()
    lines[fence + 1] = command.format(MARK=MARK)
    res = _ci_run(tmp_path, lines)
    assert res.returncode == 1 and said in res.stderr and "nothing run" in res.stderr, (res.stdout, res.stderr)
    assert MARK not in res.stdout


def test_ci_run_sets_ci_itself(tmp_path):
    lines, _, fence = _readme()
    lines[fence + 1] = './pytest "CI=$CI"'
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    _tree(tmp_path, lines)
    res = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == "pytest CI=true", (res.stdout, res.stderr)


DOCTORED = ["no Tests line", "Tests line reworded", "Tests line not naming .ci/run", "no bash block after it",
            "prose between the line and its block", "an empty block", "another Tests line with a block below"]


@pytest.mark.parametrize("doctor", DOCTORED)
def test_ci_run_fails_when_it_cannot_find_the_readme_s_test_command(tmp_path, doctor):
    """Rather than run nothing and pass, or run another of the README's commands (a later "Tests ..." line
    followed by a block further down)."""
    lines, tests, fence = _readme()
    if doctor == "no Tests line":
        del lines[tests]
    elif doctor == "Tests line reworded":
        lines[tests] = "The tests (what CI runs through `.ci/run`):"
    elif doctor == "Tests line not naming .ci/run":
        lines[tests] = "Tests (what CI runs):"
    elif doctor == "no bash block after it":
        lines[fence] = "```sh"
    elif doctor == "prose between the line and its block":
        lines[tests + 1 : tests + 1] = ["", "Install first, then:"]
    elif doctor == "an empty block":
        del lines[fence + 1]
    else:
        del lines[tests]
        lines += ["", "Tests of the examples:", "", "```bash", "echo ran-another-block", "```"]
    res = _ci_run(tmp_path, lines)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.startswith(".ci/run: no test command in README.md") and "nothing run" in res.stderr, res.stderr
    assert "ran-" not in res.stdout + res.stderr


def _pytest(args, cwd, *, ci: bool, hide: str | None = None) -> subprocess.CompletedProcess:
    """pytest ``args`` in a child process, with ``CI=true`` or without CI, and module ``hide`` made unimportable
    (None in ``sys.modules``, as for a package that is not installed)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if ci:
        env["CI"] = "true"
    code = ("import sys; " + (f"sys.modules[{hide!r}] = None; " if hide else "")
            + f"import pytest; sys.exit(pytest.main({['-q', '-rA', '-p', 'no:cacheprovider', *args]!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=env)


@pytest.mark.parametrize("hide, tests, missing", [
    ("pyarrow", "tests/test_parquet.py", "pyarrow (the test group): cannot import 'pyarrow'"),
    ("gpufeed.decode._turbo_crop", "tests/test_cropped_decode.py", "the cropped-decode C extension"),
])
def test_a_missing_part_fails_the_run_under_ci_and_only_skips_without(hide, tests, missing):
    """Without CI the part's tests skip (a user's machine may lack it); under ``CI=true`` the run fails at
    once, naming the part."""
    local = _pytest([tests], ROOT, ci=False, hide=hide)  # a module that skips itself collects no test: 5
    assert local.returncode in (0, pytest.ExitCode.NO_TESTS_COLLECTED) and " skipped" in local.stdout and "passed" not in local.stdout, local.stdout
    ci = _pytest([tests], ROOT, ci=True, hide=hide)
    assert ci.returncode == pytest.ExitCode.USAGE_ERROR, ci.stdout + ci.stderr
    assert "CI=true and parts the suite needs are missing" in ci.stderr and missing in ci.stderr, ci.stderr
    assert " skipped" not in ci.stdout


_SKIPS = '''
import pytest


def test_needs_a_part_not_here():
    pytest.importorskip("gpufeed_no_such_part")


def test_skips_itself():
    pytest.skip("a reason of its own")


@pytest.mark.skipif(True, reason="a condition")
def test_skipped_by_a_condition():
    pass


@pytest.mark.gpu
def test_on_the_gpu():
    assert __import__("torch").cuda.is_available()  # the conftest skips it without CUDA
'''


def test_under_ci_only_a_gpu_test_may_skip(tmp_path):
    """The repository's conftest as a plugin on tests that skip in each way: without CI they skip; under
    ``CI=true`` each fails (the module that skips itself fails to collect), but the gpu-marked one, which
    skips without CUDA."""
    (tmp_path / "test_skips.py").write_text(_SKIPS)
    (tmp_path / "test_module_skip.py").write_text('import pytest\n\npytest.importorskip("gpufeed_no_such_part")\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    args = ["-p", "tests.conftest", "--continue-on-collection-errors", str(tmp_path)]
    local = _pytest(args, tmp_path, ci=False)
    assert local.returncode == 0, local.stdout + local.stderr
    gpu_skips = int(not __import__("torch").cuda.is_available())
    assert f"{4 + gpu_skips} skipped" in local.stdout, local.stdout
    ci = _pytest(args, tmp_path, ci=True)
    if missing_parts():  # this environment lacks a part: under CI the run stops before any test
        assert ci.returncode != 0 and "parts the suite needs are missing" in ci.stderr, ci.stderr
        return
    assert ci.returncode == pytest.ExitCode.TESTS_FAILED, ci.stdout + ci.stderr
    out = ci.stdout
    for name in ("test_needs_a_part_not_here", "test_skips_itself"):  # skipped in the call: failed
        assert f"FAILED test_skips.py::{name}" in out, out
    assert "ERROR test_skips.py::test_skipped_by_a_condition" in out, out  # skipped at setup: an error there
    assert "ERROR test_module_skip.py" in out and "could not import 'gpufeed_no_such_part'" in out, out
    assert "CI=true: skipped (a reason of its own)" in out, out
    if gpu_skips:
        assert "SKIPPED [1] test_skips.py" in out and "needs a CUDA GPU" in out, out
    summary = out.strip().splitlines()[-1]
    counts = {"failed": 2, "passed": 1 - gpu_skips, "skipped": gpu_skips, "errors": 2}
    assert all((f"{n} {what}" in summary) == (n > 0) for what, n in counts.items()), summary


_NOT_EXEMPT = '''
import pytest


@pytest.mark.parametrize("device", ["gpu"])
def test_says_gpu_but_is_not_marked(device):
    pytest.skip("not here")


@pytest.mark.xfail(reason="a known fault")
def test_expected_to_fail():
    assert 1 == 2
'''


def test_under_ci_neither_a_gpu_name_nor_an_expected_failure_passes(tmp_path):
    """A test whose parameter says "gpu" but carries no gpu marker, and an xfail: without CI a skip and an
    expected failure; under ``CI=true`` both fail."""
    (tmp_path / "gpu").mkdir()  # the folder's name says gpu too
    (tmp_path / "gpu" / "test_not_exempt.py").write_text(_NOT_EXEMPT)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    args = ["-p", "tests.conftest", str(tmp_path)]
    local = _pytest(args, tmp_path, ci=False)
    assert "1 skipped" in local.stdout and "1 xfailed" in local.stdout, local.stdout
    ci = _pytest(args, tmp_path, ci=True)
    if missing_parts():
        assert ci.returncode != 0 and "parts the suite needs are missing" in ci.stderr, ci.stderr
        return
    assert ci.returncode == pytest.ExitCode.TESTS_FAILED and "2 failed" in ci.stdout, ci.stdout
    assert "CI=true: an expected failure (a known fault) is a failure" in ci.stdout, ci.stdout


def test_the_repository_s_expected_failures_are_strict():
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["xfail_strict"] is True


def test_the_parts_checked_are_the_test_groups(tmp_path):
    """Each distribution of pyproject.toml's test dependency group by its import name (Triton included, which
    PyTorch's CPU-only build lacks); a distribution added to the group is checked without another change."""
    modules = required_modules()
    for module in ("pyarrow", "s3fs", "moto", "flask_cors", "lightning", "timm", "pynvml", "psutil", "triton"):
        assert module in modules, (module, sorted(modules))
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "x"\n\n[dependency-groups]\n'
                     'test = ["pytest>=7", "gpufeed-no-such-part[x]>=1", "nvidia-ml-py>=12", '
                     '"triton>=3.0; sys_platform == \'linux\'"]\n')
    assert required_modules(other) == {"pytest": "pytest (the test group)", "pynvml": "nvidia-ml-py (the test group)",
                                       "gpufeed_no_such_part": "gpufeed-no-such-part (the test group)",
                                       "triton": "triton (the test group)"}
    assert "gpufeed-no-such-part (the test group): cannot import 'gpufeed_no_such_part'" in missing_parts(other)
