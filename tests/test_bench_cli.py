"""`gpufeed bench` as a user meets it: --data checked before anything starts, the plan said before the first
run, a step per line while it runs, and a result that reads at a glance in each --format."""

import csv
import io
import json
import os
import subprocess
import sys
import time

import pytest

from gpufeed.cli import main

WIDTH = 100


def _bench(args, *, env=None, timeout=300):
    """``python -m gpufeed bench ARGS`` in a process of its own (standard error a pipe, not a terminal)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpufeed", "bench", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_a_missing_data_path_fails_at_once_in_one_line_naming_it(tmp_path):
    missing = tmp_path / "nonexistent"
    t0 = time.monotonic()
    res = _bench(["--data", str(missing), "--device", "cpu"])
    elapsed = time.monotonic() - t0
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1  # one line, no traceback
    assert res.stderr.startswith(f"gpufeed bench: error: --data {missing}: no such file or folder; expected an "
                                 "ImageFolder folder")
    assert elapsed < 10  # interpreter start included; no pipeline process is started


def test_data_that_holds_no_image_the_loader_opens_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["bench", "--data", str(tmp_path / "empty"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--data {tmp_path / 'empty'}: " in err and "has no class sub-folders" in err
    bad = tmp_path / "bad" / "class_a" / "photo.jpg"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"GIF89a" + bytes(range(256)) * 8)  # a format gpufeed does not read, named like a JPEG
    assert main(["bench", "--data", str(tmp_path / "bad"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--data {tmp_path / 'bad'}: its first image does not open: " in err
    assert str(bad) in err and "not an image of a format gpufeed reads" in err


@pytest.fixture(scope="module")
def markdown_run(synth_root, tmp_path_factory):
    """The default format, both usual pipelines, on 40 images: (process result, its JSON)."""
    out = tmp_path_factory.mktemp("bench")
    res = _bench(["--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "4", "--device", "cpu",
                  "--pipelines", "baseline,gpufeed", "--json", str(out / "r.json"), "--chart", str(out / "r.png")])
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads((out / "r.json").read_text()), out / "r.png"


def test_the_table_fits_100_columns_and_leaves_out_what_was_not_measured(markdown_run):
    res, result, _ = markdown_run
    out = res.stdout
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    header = next(line for line in out.splitlines() if line.startswith("| pipeline "))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[:4] == ["pipeline", "images/s", "spread", "vs baseline"] and "PSS added GB" in columns
    # --device cpu: nothing read from a GPU, whatever the machine has; no model: no share of its own rate
    assert not any("GPU" in c for c in columns) and "of its own rate" not in columns
    assert "of ceiling" not in out and "bench overhead" not in columns
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"pipeline", "baseline", "gpufeed"}
    rate = next(r for r in result["rows"] if r["name"] == "gpufeed")["images_per_s"]
    assert f" {rate:,.0f} |" in rows["gpufeed"]
    spread = next(r for r in result["rows"] if r["name"] == "gpufeed")["plain_spread"]
    assert f" {100 * spread:.1f}% |" in rows["gpufeed"]
    assert isinstance(result["within_spread"], list)  # the pairs this run cannot tell apart, maybe none
    assert "baseline: torchvision ImageFolder + DataLoader (1 worker)" in out
    assert "gpufeed: cpu decode" in out
    # the user's --data: advice about it, not about the synthetic data's --n
    assert "- baseline, gpufeed: 5 batches an epoch" in out and "more images in --data" in out and "--n" not in out


def test_the_plan_is_said_before_the_first_run_and_each_step_as_it_ends(markdown_run, synth_root):
    res, result, _ = markdown_run
    err = res.stderr.splitlines()
    assert err[0].startswith("gpufeed bench: ") and "CPU cores" in err[0]
    data = err.index(f"data: {synth_root}: 40 images in 4 classes")
    plan = "\n".join(err[:data])
    assert "runs: baseline, gpufeed" in plan and "5 epochs (1 warm-up, 2 plain, 1 monitored, 1 memory" in plan
    # standard error is no terminal here: one line per epoch, then the row's outcome
    started = err.index("[1/2] baseline: torchvision ImageFolder + DataLoader (1 worker)")
    first_epoch = next(i for i, line in enumerate(err) if line.startswith("  baseline epoch 1/5 (warm-up): "))
    done = next(i for i, line in enumerate(err) if line.startswith("[1/2] baseline: ") and "images/s" in line)
    assert data < started < first_epoch < done
    assert [line.split(" (")[0] for line in err if line.startswith("  gpufeed epoch")] == \
        [f"  gpufeed epoch {i}/5" for i in range(1, 6)]
    assert all(len(line) <= WIDTH for line in err)


def test_the_chart_draws_each_rows_spread_and_names_the_baseline(markdown_run):
    from matplotlib.container import BarContainer

    from gpufeed.bench.chart import draw

    _, result, png = markdown_run
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = draw(result)
    ax = fig.axes[0]
    bars = next(c for c in ax.containers if isinstance(c, BarContainer))
    whiskers = bars.errorbar.lines[2][0].get_segments()  # one (slowest, fastest) segment per row
    for row, segment in zip(result["rows"], whiskers):
        plain = [e["images_per_s"] for e in row["epochs"] if e["kind"] == "plain"]
        assert [x for x, _ in segment] == pytest.approx([min(plain), max(plain)])
    labels = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    assert labels[0] == "baseline: torchvision ImageFolder + DataLoader (1 worker)"
    assert "of ceiling" not in " ".join(t.get_text() for t in ax.texts)


def test_the_synthetic_data_is_said_made_then_reused_and_csv_and_json_parse(tmp_path):
    """Without --data: the bench says what it makes and where, and that the next run reuses it; --format csv
    and json give standard output that the csv and json modules read."""
    args = ["--n", "16", "--batch-size", "4", "--workers", "1", "--epochs", "2", "--device", "cpu",
            "--pipelines", "gpufeed"]
    first = _bench([*args, "--format", "json"], env={"HOME": str(tmp_path)})
    assert first.returncode == 0, first.stderr[-3000:]
    where = tmp_path / ".cache" / "gpufeed" / "synth-16-seed0"
    said = " ".join(first.stderr.split())  # the plan's lines wrap at 100 columns
    assert f"data: 16 synthetic ImageNet-like JPEGs (about 100 KB each) under {where}: made once, then reused" in said
    assert "synthetic data: made 16 JPEGs in " in said and "; cached for the next run" in said
    result = json.loads(first.stdout)
    (row,) = result["rows"]
    assert row["name"] == "gpufeed" and row["images_per_s"] > 0 and result["dataset"] == str(where)
    assert "more images (--n)" in " ".join(row["warnings"])  # 4 batches an epoch, of the bench's own data

    second = _bench([*args, "--format", "csv"], env={"HOME": str(tmp_path)})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "synthetic data: reused, as cached by an earlier run" in second.stderr
    (line,) = list(csv.DictReader(io.StringIO(second.stdout)))
    assert line["pipeline"] == "gpufeed" and float(line["images_per_s"]) > 0
    assert float(line["plain_min_images_per_s"]) == float(line["plain_max_images_per_s"]) == float(line["images_per_s"])
    assert line["of_its_own_rate"] == "" and line["failed"] == ""


def test_a_pipeline_that_fails_is_said_under_the_table_and_its_details_after(synth_root, capsys):
    """A row that fails (no GPU decoder here, or none asked for with --device cpu) is a FAILED cell, one
    line under the table, and its traceback on standard error after the table; exit status 1."""
    rc = main(["bench", "--data", str(synth_root), "--batch-size", "8", "--workers", "1", "--epochs", "2",
               "--device", "cpu", "--pipelines", "gpufeed-gpu-only"])
    assert rc == 1
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if line.startswith("| gpufeed-gpu-only "))
    assert "FAILED" in row and max(len(line) for line in captured.out.splitlines()) <= WIDTH
    assert "- gpufeed-gpu-only: FAILED: " in captured.out
    assert "[1/1] gpufeed-gpu-only: FAILED (why: under the table" in captured.err
    assert "gpufeed-gpu-only failed:\nTraceback" in captured.err


def test_help_lists_the_columns_in_the_readmes_words(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "%%" not in out and "of its own rate: " in out and "of ceiling" not in out
    assert "--format {markdown,csv,json}" in out


def test_the_baseline_asked_for_data_it_cannot_read_is_refused_before_anything_runs(synth_root, tmp_path, capsys):
    from gpufeed.sources import create_source
    from gpufeed.synth import tar_shards

    shard = tmp_path / "shard-0.tar"
    shard.write_bytes(tar_shards(create_source(str(synth_root)), 40)[0])
    assert main(["bench", "--data", str(shard), "--pipelines", "baseline,gpufeed", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"reads only a local ImageFolder folder, not '{shard}'" in err
    assert "leave baseline out of --pipelines" in err


def _row(name, plain):
    return {"name": name, "pipeline": name, "images_per_s": sorted(plain)[len(plain) // 2],
            "plain_spread": max(plain) / min(plain) - 1, "warnings": [],
            "epochs": [{"kind": "warm-up", "images_per_s": 1.0}, *({"kind": "plain", "images_per_s": p} for p in plain)]}


def test_rows_whose_plain_epochs_overlap_are_said_within_their_spread_in_the_table_and_json():
    """Two pipelines whose plain epochs' ranges overlap are named under the table with both ranges, and listed
    in ``within_spread``; a pair apart, the model alone and a row that failed are not."""
    from gpufeed.bench.report import format_table, within_spread

    rows = [{"name": "ceiling", "pipeline": "GPU-resident tensors", "images_per_s": 1500.0, "epochs": [],
             "warnings": []},
            _row("baseline", [400.0, 460.0, 430.0]), _row("gpufeed", [455.0, 520.0, 500.0]),
            _row("gpufeed-cpu", [600.0, 610.0, 620.0]), {**_row("gpufeed-gpu", [450.0, 470.0]), "error": True,
                                                          "failure": "no GPU"}]
    assert within_spread(rows) == [["baseline", "gpufeed"]]
    assert within_spread([_row("a", [100.0, 110.0]), _row("b", [110.0, 120.0])]) == [["a", "b"]]  # touching
    assert within_spread([_row("a", [100.0]), _row("b", [100.0])]) == []  # one plain epoch: no range to compare
    result = {"date": "2026-12-04 10:00", "machine": {"cpu_cores": 2, "torch": "2"}, "dataset": "/d",
              "config": {"device": "cpu", "batch_size": 8, "workers": 1, "model": None},
              "epoch_kinds": ["warm-up", "plain", "monitored", "plain", "memory"], "rows": rows,
              "within_spread": within_spread(rows)}
    out = format_table(result)
    note = next(line for line in out.splitlines() if "plain epochs overlap" in line)
    assert note.startswith("- baseline, gpufeed: plain epochs overlap (400-460 against 455-520 images/s)")
    assert sum(line.startswith("- ") and "overlap" in line for line in out.splitlines()) == 1
    gpufeed = next(line for line in out.splitlines() if line.startswith("| gpufeed "))
    assert gpufeed.split("|")[3].strip() == "14.3%"  # 520 / 455 - 1


def test_a_batch_larger_than_the_data_is_refused_before_anything_runs(synth_root, capsys):
    """Every pipeline drops the ragged tail, so a batch over the images of --data would time empty epochs: one
    line naming both sizes and the way out, exit 2, nothing run."""
    assert main(["bench", "--data", str(synth_root), "--batch-size", "64", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert f"--batch-size 64 is more than its 40 images of --data {synth_root}" in captured.err
    assert "give --batch-size 40 or less, or more images" in captured.err


def test_gpufeed_alone_lists_its_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gpufeed") and all(c in err for c in ("synth", "bench", "shards", "info"))
