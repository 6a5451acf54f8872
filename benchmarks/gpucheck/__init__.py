"""``make gpu-check``: one prepared command that proves the GPU paths on one NVIDIA GPU.

A GPU is lent only at times and briefly, so everything that must be shown on one runs as a single command
(``benchmarks/gpu_check.py``) that keeps going after a failure, writes what it has after every part and fits
a fixed time: the environment, the GPU tests, the kernels and the decode step against their limits
(``bench_gpu.py --quick``), the engine as a user runs it, and the server when it exists. The report holds one
PASS/MISS line per goal (``goals.py``). docs/gpu_check.md says how to run it on a lent machine.

Modules, one job each: ``main`` (arguments, the no-GPU exit), ``schedule`` (parts in order, each under its
own time budget and the check's deadline; results saved after each), ``parts`` (what each part runs and
reads back), ``subproc`` (a subprocess with a timeout that kills its whole process group), ``goals`` (the
goal table and the PASS/MISS decisions), ``report`` (report.md), ``engine_figures`` (per-step figures from
the engine's own counters), ``fp8_figures`` (FP8 against bf16, and greedy agreement); scripts run as
subprocesses: ``env_info``, ``model_prep``, ``engine_run``, ``engine_link``, ``engine_fp8``;
``select_tests`` is a pytest plugin; ``wheels`` downloads what the GPU machine lacks.
"""
