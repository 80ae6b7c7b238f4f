"""Private helpers shared across autoprec: files, names, digests, nested structures and
child servers."""
