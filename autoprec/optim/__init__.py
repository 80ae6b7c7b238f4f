"""The optimizer a policy describes: the per-group optimizer (`optimizer`), its state's
dtypes (`state`) and their part of a search space (`space`)."""
