"""
Averaging rounds, knowing nothing about hivemind's classes:

- :mod:`~hivemind_accum.rounds.fallback`: each round's local gradients, kept until the round is settled, for a failed
  round's fallback;
- :mod:`~hivemind_accum.rounds.finite`: the finite check, and what an averager does with it around a round;
- :mod:`~hivemind_accum.rounds.step_gate`: each round's decision for its optimizer step, and the hooks that skip it.
"""
