"""fp32: the reference every trial is compared to, and what a policy leaves alone."""

from autoprec.formats.base import Format, Limits


class FP32(Format):
    name = "fp32"
    help = "IEEE single precision: the reference, and the master weights"
    limits = Limits(3.4028234663852886e38, 2.0**-126, 2.0**-149, 23)
    torch_name = "float32"
    bytes_per_element = 4.0
    colour = "#4c72b0"
    reference = True
