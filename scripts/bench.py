#!/usr/bin/env python3
"""Same as ``qnn-convbwd bench``: training graphs with and without the plugin.

python scripts/bench.py                        # defaults: docs/bench/
python scripts/bench.py --sizes 16 32 64 --scaling-depths 1 2 4 8
"""

from __future__ import annotations

import argparse
import logging
import sys

from qnn_convbwd_dev import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=bench.__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
