"""fp16: half precision, fast where kernels have it; overflows past 65504, and its
gradients underflow unless the loss is scaled."""

from autoprec.formats.base import Format, Limits


class FP16(Format):
    name = "fp16"
    help = "IEEE half precision: 5 exponent bits, largest 65504; needs loss scaling"
    limits = Limits(65504.0, 2.0**-14, 2.0**-24, 10)
    torch_name = "float16"
    bytes_per_element = 2.0
    colour = "#dd8452"
    scales_loss = True
