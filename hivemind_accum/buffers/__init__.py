"""
Gradient buffers, knowing nothing about averaging or hivemind:

- :mod:`~hivemind_accum.buffers.buckets`: :class:`GradientBuckets`, flat buffers (one per device and dtype) cut into
  per-tensor views, and their fused add, zero and scaled copy;
- :mod:`~hivemind_accum.buffers.finite_add`: the add that keeps only finite micro-steps (host and device paths) and the
  counters of the micro-steps it drops;
- :mod:`~hivemind_accum.buffers.aliases`: in-place mode's ``.grad``, aliases of the buckets that autograd adds into.
"""
