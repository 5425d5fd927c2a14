"""``--help`` of the scripts in examples/: the whole description as the script's docstring writes it, and every
option with its help and its default (argparse alone: nothing is trained)."""

import re

import pytest

from .examples import load_example


@pytest.mark.parametrize("name", ["train", "timm_recipe"])
def test_help_shows_the_whole_description_and_every_option_s_default(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # each option's help on one line (or the line after a long name)
    example = load_example(name)
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert example.__doc__.strip() in out, f"examples/{name}.py --help cuts its description:\n{out}"
    arguments = out[out.index("\npositional arguments:" if name == "timm_recipe" else "\noptions:"):]
    entries = []  # one per argument: its line, and the help argparse puts on the next line after a long name
    for line in arguments.splitlines():
        if re.match(r"  [-a-z]", line):
            entries.append(line.strip())
        elif line.startswith("    ") and entries:
            entries[-1] += "  " + line.strip()
    names = {entry.split()[0] for entry in entries}
    assert {"--device", "--batch-size", "--image-size"} <= names, out  # the argument lines were found
    for entry in entries:
        if not entry.startswith("-h, --help"):
            assert re.search(r"\S  +\S.* \(default: [^)]+\)$", entry), f"no help or no default: {entry!r}"
