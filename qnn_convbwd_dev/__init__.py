"""Developer and research tools built on ``qnn_convbwd``'s public API: benchmarks
(``qnn-convbwd bench``), multiply-add cost (``cost``), the fidelity judge
(``fidelity``; ``step_floor`` for a training step's loss), gate flips and gate
matching, lowering time, weight bytes, reference models and kernels, and helpers
the scripts and tests share.

Installed with the repository (``pip install -e '.[dev]'`` brings its third-party
dependencies). ``qnn_convbwd`` never imports it: the CLI's developer subcommands load it
when run (tests/test_structure.py).
"""
