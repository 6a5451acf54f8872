"""CPU stand-ins for hardware-only libraries (DeepEP, DeepGEMM), for the tests only.

They follow the real libraries' Python APIs (signatures, tuple arities, dtypes, layouts, the checks the real
kernels make) so the adapters that call them run, and fail the way they would on a GPU. They are never
importable under the real names: a test imports ``standins.deep_ep`` / ``standins.deep_gemm`` and passes the
module to the adapter explicitly (``deep_ep_module=``, ``deep_gemm_module=``); the run-time code still needs
the real package.
"""
