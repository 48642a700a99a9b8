"""A stand-in for the device-side training runner (``qnn_convbwd.device_train``'s
contract), run on x86-64 with executorch's own runtime: loads the program (and its
``.ptd``), calls ``forward`` once per line of the input list on the one loaded
method, writes each step's loss as ``output_<k>_0.raw`` and, at the end, each
buffer named in the dump list as ``<name>.raw``; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    for flag in ("model_path", "input_list_path", "dump_list_path", "output_folder_path"):
        parser.add_argument(f"--{flag}", required=True)
    parser.add_argument("--data_path")
    args = parser.parse_args(argv)
    from executorch.extension.pybindings.portable_lib import _load_program_from_buffer

    pte = Path(args.model_path).read_bytes()
    options = {"data_path": args.data_path} if args.data_path else {}
    program = _load_program_from_buffer(pte, **options)
    method = program.load_method("forward")
    meta = method.method_meta()
    out = Path(args.output_folder_path)
    out.mkdir(parents=True, exist_ok=True)
    lines = [line.split() for line in Path(args.input_list_path).read_text().splitlines() if line]
    for step, files in enumerate(lines):
        inputs = []
        for index, name in enumerate(files):
            info = meta.input_tensor_meta(index)
            dtype = {6: torch.float32, 4: torch.int64}[int(info.dtype())]
            data = bytearray(Path(name).read_bytes())
            inputs.append(torch.frombuffer(data, dtype=dtype).reshape(tuple(info.sizes())))
        loss = method.call(inputs, clone_outputs=True)[0]
        loss.to(torch.float32).contiguous().numpy().tofile(out / f"output_{step}_0.raw")
    for name in Path(args.dump_list_path).read_text().split():
        method.get_attribute(name).contiguous().numpy().tofile(out / f"{name}.raw")
    print(f"{len(lines)} steps done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
