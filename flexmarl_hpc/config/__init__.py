"""Pure configuration: the typed schema, loading and validation, resources and the rank layout.

Nothing here imports torch or mpi4py, so `submit` and `simulate` stay instant on a login node
(tests/unit/test_imports.py holds it to that).
"""
