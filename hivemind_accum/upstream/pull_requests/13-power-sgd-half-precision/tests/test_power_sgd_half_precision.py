import pytest
import torch
import torch.nn as nn

from hivemind import DHT
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.utils import get_dht_time


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_power_sgd_half_precision(dtype: torch.dtype):
    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    # two rounds of full-rank integer gradients (exact in float16 and bfloat16) for two peers:
    # rank 1 leaves a residual in the error feedback after the first round, which the second round uses
    generator = torch.Generator().manual_seed(0)
    rounds = [[torch.randint(-8, 9, (8, 8), generator=generator).float() for _peer in range(2)] for _round in range(2)]

    # the same two peers in the given dtype and in float32 (the reference), with the same random Q
    models, averagers = {}, {}
    try:
        for run_dtype in dtype, torch.float32:
            for peer, dht in enumerate((dht1, dht2)):
                models[run_dtype, peer] = nn.Linear(8, 8).to(run_dtype)
                torch.manual_seed(peer)
                averagers[run_dtype, peer] = PowerSGDGradientAverager(
                    models[run_dtype, peer].parameters(),
                    averager_rank=1,
                    dht=dht,
                    prefix="reference" if run_dtype == torch.float32 else "test",
                    target_group_size=2,
                    start=True,
                )

        for round_grads in rounds:
            for (run_dtype, peer), model in models.items():
                model.weight.grad = round_grads[peer].to(run_dtype)
                model.bias.grad = torch.full((8,), float(peer), dtype=run_dtype)  # a vector: averaged uncompressed
                averagers[run_dtype, peer].accumulate_grads_(batch_size=1)
            controls = [averager.schedule_step(get_dht_time() + 5) for averager in averagers.values()]
            for averager, control in zip(averagers.values(), controls):
                averager.step(control=control, wait=False)
            for control in controls:
                control.result(timeout=30)

            # with float32 error feedback, the averages are those of float32 parameters, rounded once to dtype
            for peer in range(2):
                with (
                    averagers[dtype, peer].get_tensors() as grads,
                    averagers[torch.float32, peer].get_tensors() as ref,
                ):
                    for grad, reference in zip(grads, ref):
                        assert grad.dtype == dtype
                        assert torch.equal(grad, reference.to(dtype))
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht1.shutdown()
        dht2.shutdown()
