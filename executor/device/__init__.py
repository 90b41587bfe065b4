"""The device the executor runs on, behind one interface (base.py: `DeviceBackend`, the plain CPU backend and
the errors of a tier's allocations), one file per backend (cuda.py, emulated.py: the adversarial CPU emulation
of CUDA for tests) and the factory that picks one for `--device NAME` (factory.py: `make_backend`). No backend
imports another, and this package imports nothing, so importing one of its modules loads only what it needs.
"""
