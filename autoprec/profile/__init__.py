"""Sensitivity profiling and what is built from it: automatic groups and the guided search."""
