"""Training-framework integrations: a policy in PyTorch Lightning
(`autoprec.integrations.lightning`) and in transformers' Trainer
(`autoprec.integrations.transformers`). Each needs its framework installed; ``import autoprec``
imports neither."""
