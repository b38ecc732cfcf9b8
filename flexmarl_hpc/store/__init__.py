"""Durable state of a run: the HDF5 store (schema in docs/store.md), its repair, and checkpoints."""
