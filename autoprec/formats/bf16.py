"""bf16: fp32's range in 16 bits, with 7 bits of mantissa."""

from autoprec.formats.base import Format, Limits


class BF16(Format):
    name = "bf16"
    help = "bfloat16: fp32's 8 exponent bits, 7 mantissa bits"
    limits = Limits(3.3895313892515355e38, 2.0**-126, 2.0**-133, 7)
    torch_name = "bfloat16"
    bytes_per_element = 2.0
    colour = "#55a868"
