"""Precision on a model: where a policy lands and what installs it (`landing`: ``Policy.plan``,
``Policy.apply``), what each leaf runs in under it (`resolution`), the hooks ``apply``
returns (`hooks`), loss scaling, the cast plan, fp8 layers and the label of emulated
figures."""
