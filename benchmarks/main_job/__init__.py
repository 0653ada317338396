"""
The main job, split by concern: :mod:`.work` (what a micro-step costs per mode), :mod:`.training` (two peers learn
digits per mode), :mod:`.claims` (one line per comparison), :mod:`.report` (the screen) and :mod:`.cli`.

Run it as ``python benchmarks/benchmark_local_accumulation.py``; docs/measurement.md#the-main-job explains every number.
"""
