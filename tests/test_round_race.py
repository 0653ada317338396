"""
A round's fallback that runs late, after the next round began, must use that round's own micro-steps (issue 28).

With ``delay_grad_averaging=True``, round E's fallback (``Optimizer._average_gradients_and_load_into_optimizer`` in
the state averager's thread) can wait for E's all-reduce, which holds the averager's tensor lock; hivemind's main
thread waits for it only ``allreduce_timeout`` and begins round E + 1. The race is built here by construction: E's
fallback (``_load_local_gradients_into_optimizer``) and E + 1's load (``get_tensors``) are gated per thread on events,
so each order in which they run happens in every run. The probe's gradient at micro-step
``j`` is the one-hot ``e_j``, so each optimizer step's gradient names the micro-steps it used. A cancelled round must
read as cancelled when the averager's process learns of it, or that process runs its all-reduce anyway.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import hivemind_accum
from hivemind_accum.rounds.step_gate import StepDecisions
from tests.conftest import SINGLE_PEER_TRACKER

WINDOW = 3  # micro-steps per epoch


class Gates:
    """methods of objects, made to wait in the threads registered here: a registered thread sets its ``arrived``
    event when it calls the method, then waits for its ``go`` event"""

    def __init__(self):
        self._gates = {}

    def install(self, obj, name: str) -> None:
        original = getattr(obj, name)

        def gated(*args, **kwargs):
            gate = self._gates.get((threading.current_thread(), name))
            if gate is not None:
                arrived, go = gate
                arrived.set()
                assert go.wait(timeout=60), "the test's gate was never opened"
            return original(*args, **kwargs)

        setattr(obj, name, gated)

    def register(self, thread: threading.Thread, name: str, arrived: threading.Event, go: threading.Event) -> None:
        self._gates[thread, name] = arrived, go


def _micro_step(opt, probe, j: int, factor: float = 1.0) -> None:
    """micro-step ``j``: its gradient is the one-hot e_j (times ``factor``: NaN makes the micro-step non-finite)"""
    if not opt.grad_averager.reuse_grad_buffers:
        probe.grad = None
    (probe[j] * factor).backward()
    opt.grad_averager.accumulate_grads_(batch_size=1)


def _make_optimizer(dht, probe, reuse_grad_buffers: bool, delay_grad_averaging: bool = True):
    return hivemind_accum.Optimizer(
        dht=dht, run_id="round_race", params=[probe], optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        target_batch_size=10**6, batch_size_per_step=1, reuse_grad_buffers=reuse_grad_buffers,
        delay_optimizer_step=True, delay_grad_averaging=delay_grad_averaging, average_state_every=10**6,
        tracker_opts=SINGLE_PEER_TRACKER,
    )


def _begin_round(opt):
    """begin a round as hivemind_accum.Optimizer does (``_begin_averaging_gradients``): with a control scheduled first"""
    return opt.grad_averager.step(control=opt.grad_averager.schedule_step(), reset_accumulators=True, wait=False)


def _record_steps(opt) -> list:
    """the gradient each optimizer step of ``opt`` runs with (None: skipped), as multiples of 1 / WINDOW, recorded by
    a step pre-hook that runs after the skip's"""
    used = []

    def record(optimizer, args, kwargs):
        grad = optimizer.param_groups[0]["params"][0].grad
        used.append(None if grad is None else grad * WINDOW)

    opt.state_averager.optimizer.register_step_pre_hook(record)
    return used


def _fallback_and_step(opt, control) -> None:
    """what the state averager's thread runs for a delayed round: the round's trigger, then the optimizer step"""
    opt._average_gradients_and_load_into_optimizer(control)
    opt.state_averager.optimizer.step()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("order", ["next_round_loads_first", "fallback_loads_first"])
def test_late_fallback_uses_its_own_round(dht, reuse_grad_buffers, order):
    """round E fails; E + 1's micro-steps accumulate; E's fallback blocks on the tensor lock while E + 1 begins.
    Either order in which they then take the lock: E's step uses exactly E's micro-steps, E + 1's step E + 1's"""
    probe = torch.nn.Parameter(torch.zeros(2 * WINDOW))
    opt = _make_optimizer(dht, probe, reuse_grad_buffers)
    used = _record_steps(opt)
    try:
        for j in range(WINDOW):  # window E
            _micro_step(opt, probe, j)
        round_e = _begin_round(opt)
        round_e.cancel()  # E fails (alone in the swarm anyway): its trigger finds the result not done
        for j in range(WINDOW, 2 * WINDOW):  # window E + 1 accumulates while E's fallback is pending
            _micro_step(opt, probe, j)

        gates = Gates()
        gates.install(opt, "_load_local_gradients_into_optimizer")  # E's fallback, waiting for E's all-reduce
        gates.install(opt.grad_averager, "get_tensors")  # E + 1's load, waiting for the lock
        fallback_arrived, fallback_go, fallback_done = threading.Event(), threading.Event(), threading.Event()
        fallback = threading.Thread(target=_fallback_and_step, args=(opt, round_e))
        gates.register(fallback, "_load_local_gradients_into_optimizer", fallback_arrived, fallback_go)
        if order == "next_round_loads_first":
            fallback.start()
            assert fallback_arrived.wait(timeout=60)  # E's fallback waits for the lock
            round_next = _begin_round(opt)  # E + 1 begins, loads, hands off
            fallback_go.set()  # the lock frees: E's fallback loads now
            fallback.join(timeout=60)
        else:
            next_arrived = threading.Event()
            began = []
            beginner = threading.Thread(
                target=lambda: began.append(_begin_round(opt))
            )
            gates.register(beginner, "get_tensors", next_arrived, fallback_done)
            gates.register(fallback, "_load_local_gradients_into_optimizer", fallback_arrived, next_arrived)
            fallback.start()
            assert fallback_arrived.wait(timeout=60)
            beginner.start()  # E + 1 begins and waits for the lock; E's fallback takes it first
            fallback.join(timeout=60)
            fallback_done.set()
            beginner.join(timeout=60)
            (round_next,) = began
        assert not fallback.is_alive()
        with opt.grad_averager.get_tensors() as (part,):  # what E + 1's all-reduce sends: E + 1's own part, untouched
            torch.testing.assert_close(part * WINDOW, torch.tensor([0.0] * WINDOW + [1.0] * WINDOW))

        round_next.cancel()  # E + 1 fails too and falls back, in order
        _fallback_and_step(opt, round_next)

        window_e, window_next = torch.zeros(2 * WINDOW), torch.zeros(2 * WINDOW)
        window_e[:WINDOW], window_next[WINDOW:] = 1.0, 1.0
        assert len(used) == 2
        assert used[0] is not None and used[1] is not None, "neither round's gradients may be lost"
        steps = f"micro-steps used by E's step {used[0].tolist()}, by E + 1's step {used[1].tolist()}"
        torch.testing.assert_close(used[0], window_e, msg=steps)  # E's step: micro-steps 0, 1, 2 once each
        torch.testing.assert_close(used[1], window_next, msg=steps)  # E + 1's step: micro-steps 3, 4, 5 once each
    finally:
        opt.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
@pytest.mark.parametrize("nonfinite", ["this_round", "next_round"])
def test_late_step_reads_its_own_rounds_finiteness(dht, reuse_grad_buffers, nonfinite):
    """one of rounds E and E + 1 holds a NaN micro-step; E's fallback and step come after E + 1 began, so E + 1's
    check of its own gradients ran in between. The NaN round's step is skipped and the other round's step uses
    exactly its own micro-steps, whichever came last"""
    probe = torch.nn.Parameter(torch.zeros(2 * WINDOW))
    opt = _make_optimizer(dht, probe, reuse_grad_buffers)
    used = _record_steps(opt)
    nan_step = 1 if nonfinite == "this_round" else WINDOW + 1
    try:
        rounds = []
        for window in range(2):
            for j in range(window * WINDOW, (window + 1) * WINDOW):
                _micro_step(opt, probe, j, factor=float("nan") if j == nan_step else 1.0)
            rounds.append(_begin_round(opt))  # E + 1's own check runs before E's step
            rounds[-1].cancel()
        for control in rounds:
            _fallback_and_step(opt, control)
        assert len(used) == 2
        own = [torch.zeros(2 * WINDOW), torch.zeros(2 * WINDOW)]
        own[0][:WINDOW], own[1][WINDOW:] = 1.0, 1.0
        skipped, stepped = (0, 1) if nonfinite == "this_round" else (1, 0)
        assert used[skipped] is None, f"the NaN round's step must be skipped, it used {used[skipped]}"
        assert used[stepped] is not None, "the finite round's step must not be skipped"
        torch.testing.assert_close(used[stepped], own[stepped])
    finally:
        opt.shutdown()


@pytest.mark.forked
def test_queued_step_reads_its_own_rounds_decision(dht):
    """delay_optimizer_step without delay_grad_averaging: the main thread loads each round and queues its step in the
    state averager's thread. E holds a NaN micro-step; E's step is still queued (behind a slow job) when E + 1 is
    loaded and decided. E's step must still be skipped, and E + 1's step use E + 1's micro-steps once. Before
    decisions travelled with the step's job, E's step read E + 1's decision and used window E + 1, which E + 1's step
    then used again"""
    probe = torch.nn.Parameter(torch.zeros(2 * WINDOW))
    opt = _make_optimizer(dht, probe, reuse_grad_buffers=False, delay_grad_averaging=False)
    used = _record_steps(opt)
    slow_job = threading.Event()
    try:
        opt.state_averager.step_executor.submit(slow_job.wait, 60)  # holds the state averager's only thread
        for window in range(2):
            for j in range(window * WINDOW, (window + 1) * WINDOW):
                _micro_step(opt, probe, j, factor=float("nan") if j == 1 else 1.0)
            control = _begin_round(opt)
            control.cancel()  # the round fails: the main thread falls back to its local gradients and decides
            opt._average_gradients_and_load_into_optimizer(control)
            opt.state_averager.step(optimizer_step=True, delay_optimizer_step=True)  # queued behind the slow job
        slow_job.set()
        opt.state_averager.step(wait_for_delayed_updates=True)
        window_next = torch.zeros(2 * WINDOW)
        window_next[WINDOW:] = 1.0
        assert len(used) == 2
        assert used[0] is None, f"E's step must be skipped (its micro-step 1 was NaN), it used {used[0]}"
        assert used[1] is not None, "E + 1's step must not be skipped"
        torch.testing.assert_close(used[1], window_next)
    finally:
        slow_job.set()
        opt.shutdown()


def test_step_decisions_reach_their_own_job_only():
    """StepDecisions: a job takes the decision its submitter made last, a decision made inside the job replaces it,
    and a decision whose job was cancelled before it ran reaches no later job"""
    decisions = StepDecisions()
    executor = decisions.carried_by(ThreadPoolExecutor(max_workers=1))
    gate = threading.Event()
    try:
        executor.submit(gate.wait, 60)
        decisions.decide(False)
        first = executor.submit(decisions.take)  # round E's step
        decisions.decide(True)
        second = executor.submit(decisions.take)  # round E + 1's, decided before E's step ran
        undecided = executor.submit(decisions.take)
        decisions.decide(False)
        cancelled = executor.submit(decisions.take)
        assert cancelled.cancel()
        after_cancelled = executor.submit(decisions.take)
        own = executor.submit(lambda: (decisions.decide(True), decisions.take())[1])  # a delayed round's load
        assert decisions.take() is None  # the submitter's decisions went with its jobs
        gate.set()
        assert [first.result(60), second.result(60), undecided.result(60), after_cancelled.result(60),
                own.result(60)] == [False, True, None, None, True]
    finally:
        gate.set()
        executor.shutdown()


@pytest.mark.forked
def test_fallback_after_two_later_rounds_skips_its_step(dht):
    """rounds E, E + 1 and E + 2 begin before E's fallback: E's gradients are dropped when E + 2 begins (two rounds
    are kept), so E's step is skipped rather than run with a later window; E + 1 and E + 2 still use their own"""
    probe = torch.nn.Parameter(torch.zeros(3 * WINDOW))
    opt = _make_optimizer(dht, probe, reuse_grad_buffers=False)
    used = _record_steps(opt)
    try:
        rounds = []
        for window in range(3):
            for j in range(window * WINDOW, (window + 1) * WINDOW):
                _micro_step(opt, probe, j)
            rounds.append(_begin_round(opt))
            rounds[-1].cancel()
        assert opt.grad_averager.local_fallback.kept_rounds == 2
        for control in rounds:
            _fallback_and_step(opt, control)
        assert opt.grad_averager.local_fallback.kept_rounds == 0
        assert used[0] is None, f"E's step must be skipped, it used {used[0]}"
        for window, grad in enumerate(used[1:], start=1):
            expected = torch.zeros(3 * WINDOW)
            expected[window * WINDOW:(window + 1) * WINDOW] = 1.0
            torch.testing.assert_close(grad, expected)
        # two host copies at most: E + 1 was copied out when E + 2's micro-steps came, E's copy freed for reuse
        assert opt.grad_averager.local_fallback.host_bytes == 2 * 3 * WINDOW * 4
    finally:
        opt.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("implementation", [
    "hivemind_accum",
    pytest.param("upstream", marks=pytest.mark.xfail(strict=True, reason="hivemind 1.1.12 signals before it marks")),
])
def test_cancelled_round_reads_as_cancelled_when_the_averager_is_signalled(dht, implementation):
    """a pre-scheduled round that the optimizer cancels ("no other peers"): when the averager's process receives the
    cancelled trigger or the cancel signal, the round must already read as cancelled, or that process, which checks
    it once before the all-reduce and counts a cancelled trigger as a trigger, runs the abandoned round"""
    from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager

    averager_cls = hivemind_accum.GradientAverager if implementation == "hivemind_accum" else UpstreamGradientAverager
    averager = averager_cls([torch.zeros(3, requires_grad=True)], dht=dht, prefix="cancel", start=True)
    try:
        control = averager.schedule_step(timeout=60)  # looking for a group, alone: it stays pending
        seen = []
        for future, name in ((control._trigger, "cancel"), (control._cancel, "set_result")):
            original = getattr(future, name)
            setattr(future, name, lambda *args, original=original: (seen.append(control.cancelled()), original(*args))[1])
        assert control.cancel() and control.cancelled()
        assert seen == [True, True]
    finally:
        averager.shutdown()
