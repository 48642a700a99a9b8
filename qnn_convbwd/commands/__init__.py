"""The user-facing ``qnn-convbwd`` subcommands (demo, train, finetune, cache) and the
models ``demo`` and ``train`` train.

Each module has ``add_arguments(parser)`` and ``run(args) -> int``; ``qnn_convbwd.cli``
imports only the one it runs. A lowering never imports this package
(tests/test_structure.py).
"""
