"""Can a V68 HTP (SM8350, no fp16) compute a convolution's backward quantized? The
backward's two convolutions as pt2e-quantized forward ops (int8 or int16 activations,
int8 weights), lowered with executorch's own visitors for SM8350 and SM8650 and run
on the simulator beside torch running the converted model (docs/quantized.md):

* grad_input: a transposed convolution of the gradient with the frozen weight;
* grad_weight: a convolution whose both operands are computed at run time (the
  activation and the gradient).

    python scripts/quantized_backward_v68.py
"""

from __future__ import annotations

import torch
from torch import nn

from qnn_convbwd import quantized


class GradInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(32, 16, 3, stride=2, padding=1, output_padding=1)

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return self.up(grad)


class GradWeight(nn.Module):
    def forward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        # [C_in, N, H, W] with [C_out, N, H, W] as weight: [C_in, C_out, kh, kw]
        return nn.functional.conv2d(x.transpose(0, 1), grad.transpose(0, 1), padding=1)


def _converted(module: nn.Module, inputs: tuple, dtype: str, per_channel: bool) -> nn.Module:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = quantized.quantizer(dtype, per_channel=per_channel)
    prepared = prepare_pt2e(torch.export.export(module, inputs, strict=True).module(), quantizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        prepared(*(torch.randn(t.shape, generator=gen) for t in inputs))
    prepared(*inputs)
    return convert_pt2e(prepared)


def main() -> None:
    from qnn_convbwd.toolchain import harness

    torch.manual_seed(0)
    # (module, inputs, weights quantized per channel): a run-time weight quantized per
    # channel fails executorch's AnnotateQuantAttrs (KeyError 'scale'), so per tensor.
    cases = {
        "grad_input (TransposeConv2d)": (
            GradInput().eval(),
            (torch.randn(4, 32, 8, 8),),
            True,
        ),
        "grad_weight (Conv2d, run-time weight per tensor)": (
            GradWeight().eval(),
            (torch.randn(4, 16, 8, 8), torch.randn(4, 32, 8, 8)),
            False,
        ),
    }
    print("| op | quantization | SoC | delegates | error / output range |\n|---|---|---|---|---|")
    for label, (module, inputs, per_channel) in cases.items():
        for dtype in ("8a8w", "16a8w"):
            converted = _converted(module, inputs, dtype, per_channel)
            with torch.no_grad():
                expected = converted(*inputs)
            program = torch.export.export(converted, inputs, strict=True)
            for soc in ("SM8350", "SM8650"):
                try:
                    compiled = harness.lower_program(program, soc, fp16=False)
                    (got,) = compiled.run(inputs)
                    delegates = harness.delegate_count(compiled.edge)
                    spread = float(expected.max() - expected.min())
                    error = f"{float((got - expected).abs().max()) / spread:.2e}"
                except Exception as err:  # a measurement: the failure is the result
                    delegates, error = "-", f"failed: {type(err).__name__}: {str(err)[:80]}"
                print(f"| {label} | {dtype} | {soc} | {delegates} | {error} |", flush=True)


if __name__ == "__main__":
    main()
