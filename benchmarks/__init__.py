"""Benchmarks of hivemind_accum. Every process that imports them drops one kind of hivemind shutdown noise: the DHT's
error for a request whose sender has exited (:mod:`hivemind_accum.shutdown_noise`)."""
from hivemind_accum.shutdown_noise import silence_exited_sender_errors

silence_exited_sender_errors()
