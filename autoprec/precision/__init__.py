"""Training precision: the hooks ``Policy.apply`` returns (`hooks`), loss scaling, the cast
plan, fp8 layers and the label of emulated figures."""
