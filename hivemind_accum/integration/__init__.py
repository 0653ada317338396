"""
hivemind's classes with this package's parts wired in: thin subclasses of hivemind 1.1.12's ``GradientAverager``
(:mod:`~hivemind_accum.integration.grad_averager`), ``Optimizer`` (:mod:`~hivemind_accum.integration.optimizer`, with
its round hooks in :mod:`~hivemind_accum.integration.round_steps`),
``PowerSGDGradientAverager``, ``TrainingStateAverager`` and ``ProgressTracker``, the schema-mismatch log, and
:mod:`~hivemind_accum.integration.workarounds`, one place for the workarounds of hivemind 1.1.12's defects.
"""
