import pytest
import torch

from hivemind import DHT
from hivemind.optim.grad_averager import GradientAverager


@pytest.mark.forked
def test_step_control_is_cancelled_before_the_averager_is_signalled():
    dht = DHT(start=True)
    averager = GradientAverager([torch.zeros(3, requires_grad=True)], dht=dht, prefix="test", start=True)
    try:
        _check_cancel_order(averager.schedule_step(timeout=60))  # alone in the swarm: matchmaking stays pending
    finally:
        averager.shutdown()
        dht.shutdown()


def _check_cancel_order(control):
    # the averager wakes on either signal and checks control.cancelled() once before all-reduce
    cancelled_when_signalled = []
    for future, method in (control._trigger, "cancel"), (control._cancel, "set_result"):
        signal = getattr(future, method)

        def record_and_signal(*args, signal=signal):
            cancelled_when_signalled.append(control.cancelled())
            return signal(*args)

        setattr(future, method, record_and_signal)

    assert control.cancel() and control.cancelled()
    assert cancelled_when_signalled == [True, True]
