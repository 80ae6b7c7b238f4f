"""Search spaces shipped with autoprec (YAML files beside this one)."""
