#!/usr/bin/env python3
"""Table of how often a frozen conv weight is stored: .pte / context bytes per program.

python scripts/weight_bytes.py                                   # 128x128x3 on SM8650
python scripts/weight_bytes.py --configs 64x64x3 128x128x3 256x256x3 \\
    --socs SM8450 SM8850 --formulations transpose_conv runtime_weight
python scripts/weight_bytes.py --configs 64x64x3:s2:n15 32x32x3:g32   # stride, groups, size
python scripts/weight_bytes.py --configs 256x256x3:s2:n15 --strides zero_insert parameter

A config is CINxCOUTxK with optional :sSTRIDE, :gGROUPS, :nSIZE (input size, default 8),
:dDILATION.
"""

from __future__ import annotations

import argparse
import logging
import sys

from qnn_convbwd import options
from qnn_convbwd.builders.input_gradient import FORMULATIONS
from qnn_convbwd_dev import weight_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["128x128x3"])
    parser.add_argument("--socs", nargs="+", default=["SM8650"])
    parser.add_argument(
        "--formulations",
        nargs="+",
        default=None,
        choices=sorted(FORMULATIONS),
        help="default: the default formulation",
    )
    parser.add_argument(
        "--strides",
        nargs="+",
        default=None,
        choices=options.STRIDE_MODES,
        help="Options.stride modes for strided configs (default: the default mode)",
    )
    parser.add_argument("--no-run", action="store_true", help="compile only, no simulator run")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    configs = [weight_bytes.ConvConfig.parse(spec) for spec in args.configs]
    rows = []
    for config in configs:
        for soc in args.socs:
            for formulation in args.formulations or [None]:
                modes = (args.strides or [None]) if config.stride > 1 else [None]
                for mode in modes:
                    rows.append(
                        weight_bytes.measure(
                            config, soc, formulation, run=not args.no_run, stride_mode=mode
                        )
                    )
                    print(weight_bytes.table_row(rows[-1]), file=sys.stderr, flush=True)
    print(weight_bytes.to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
