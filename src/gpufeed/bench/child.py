"""One measurement of `gpufeed bench` in a fresh process: reads its request (JSON) from standard input,
reports each epoch as it ends on the pipe the request names, and writes the row to the file it names
(``bench.run._in_child``)."""

from __future__ import annotations

import json
import sys

from .progress import EpochPipe
from .run import BenchConfig, measure


def main() -> int:
    request = json.loads(sys.stdin.read())
    config = dict(request["config"], pipelines=tuple(request["config"]["pipelines"]))
    report = EpochPipe(request["progress_fd"])
    try:
        row = measure(request["what"], BenchConfig(**config), request["root"], report)
    finally:
        report.close()
    with open(request["out"], "w") as f:
        json.dump(row, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
