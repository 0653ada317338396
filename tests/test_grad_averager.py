"""Exact mode against upstream hivemind's GradientAverager as the oracle."""
import copy
import random

import pytest
import torch
import torch.nn.functional as F
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager
from hivemind.optim.power_sgd_averager import (
    PowerSGDGradientAverager as UpstreamPowerSGDGradientAverager,
)

from hivemind_accum import GradientAverager, PowerSGDGradientAverager
from tests.conftest import MixedNet, mixed_batch, shutting_down, swarm


def run_micro_steps(models_and_averagers, num_steps: int, seed: int, set_to_none: bool, clip: bool):
    """feed every (model, averager) pair the same random micro-steps of varying batch size"""
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    for step in range(num_steps):
        batch_size = rng.choice([1, 3, 4, 7])
        images, tokens, targets = mixed_batch(generator, batch_size)
        use_sometimes = rng.random() < 0.5
        for model, averager in models_and_averagers:
            model.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(images, tokens, use_sometimes), targets).backward()
            if clip and step % 2:
                torch.nn.utils.clip_grad_norm_([*model.conv.parameters(), *model.fc.parameters()], 0.1)
            averager.accumulate_grads_(batch_size=batch_size)


@pytest.mark.forked
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_mode_matches_upstream(dht, set_to_none, seed):
    torch.manual_seed(seed)
    model = MixedNet()
    upstream_model = copy.deepcopy(model)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="ours", start=False)
    upstream_averager = UpstreamGradientAverager(upstream_model.parameters(), dht=dht, prefix="ref", start=False)
    assert len(averager._accumulators.buckets) == 2  # float32 and float64

    for round_ in range(2):  # the second round checks that reset_accumulated_grads_ leaves nothing behind
        run_micro_steps(
            [(model, averager), (upstream_model, upstream_averager)],
            num_steps=3 + 2 * round_ + seed,
            seed=10 * seed + round_,
            set_to_none=set_to_none,
            clip=bool(round_),
        )
        assert averager.local_samples_accumulated == upstream_averager.local_samples_accumulated > 0
        assert averager.local_times_accumulated == upstream_averager.local_times_accumulated > 0
        for ours, ref in zip(averager._grad_accumulators(), upstream_averager._grad_accumulators(), strict=True):
            torch.testing.assert_close(ours, ref.to_dense())
        assert any(acc.abs().sum() > 0 for acc in averager._grad_accumulators())

        averager.load_accumulators_into_averager_()
        upstream_averager.load_accumulators_into_averager_()
        with averager.get_tensors() as ours_avg, upstream_averager.get_tensors() as ref_avg:
            assert len(ours_avg) == len(ref_avg) == len(list(model.parameters()))
            for ours, ref in zip(ours_avg, ref_avg):
                assert ours.dtype == ref.dtype and ours.device.type == "cpu" and ours.is_shared()
                torch.testing.assert_close(ours, ref)
        averager.reset_accumulated_grads_()
        upstream_averager.reset_accumulated_grads_()
        assert all(acc.count_nonzero() == 0 for acc in averager._grad_accumulators())


@pytest.mark.forked
def test_views_keep_parameter_layout(dht):
    model = MixedNet()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="layout", start=False)
    with averager.get_tensors() as averaged:
        for param, acc, avg in zip(model.parameters(), averager._grad_accumulators(), averaged):
            assert acc.shape == avg.shape == param.shape and acc.dtype == avg.dtype == param.dtype
            assert acc.stride() == avg.stride() == param.stride()  # conv weight is channels_last
    # accumulators and averaged gradients are views of one flat buffer per (device, dtype)
    storages = {acc.untyped_storage().data_ptr() for acc in averager._grad_accumulators()}
    assert len(storages) == len(averager._accumulators.buckets) == 2


@pytest.mark.forked
def test_user_averaged_grads_and_accumulate_on(dht):
    torch.manual_seed(3)
    model = MixedNet(sparse_embedding=False)
    upstream_model = copy.deepcopy(model)
    averaged = [torch.zeros_like(p) for p in model.parameters()]
    averager = GradientAverager(
        model.parameters(), dht=dht, prefix="ours", accumulate_grads_on=torch.device("cpu"), averaged_grads=averaged,
        start=False,
    )
    upstream_averager = UpstreamGradientAverager(upstream_model.parameters(), dht=dht, prefix="ref", start=False)
    run_micro_steps([(model, averager), (upstream_model, upstream_averager)], 4, seed=3, set_to_none=True, clip=False)
    averager.load_accumulators_into_averager_()
    upstream_averager.load_accumulators_into_averager_()
    with upstream_averager.get_tensors() as ref_avg:
        for ours, ref in zip(averaged, ref_avg, strict=True):
            torch.testing.assert_close(ours, ref)


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
@pytest.mark.parametrize("factory", ["grad", "powersgd"])
def test_two_peers_average_like_upstream(factory, reuse_grad_buffers):
    """two peers of ours and two of upstream's, fed the same gradients, end with the same averaged gradients: the
    sample-weighted mean of each peer's accumulated gradient divided by its number of micro-steps. In-place mode is
    compared with upstream's reuse_grad_buffers=True, whose loop must not zero gradients (ours may), with equal
    batch sizes (upstream's in-place mode ignores batch sizes when weighting micro-steps)"""
    if factory == "grad":
        ours_cls, ref_cls, extra = GradientAverager, UpstreamGradientAverager, {}
    else:
        ours_cls, ref_cls = PowerSGDGradientAverager, UpstreamPowerSGDGradientAverager
        extra = dict(averager_rank=2)
    shape = (6, 5)
    with swarm(2) as dhts:
        models, averagers = [], []
        for impl, cls in (("ours", ours_cls), ("ref", ref_cls)):
            for dht in dhts:
                model = torch.nn.ParameterDict(
                    dict(w=torch.nn.Parameter(torch.zeros(shape)), b=torch.nn.Parameter(torch.zeros(5)))
                )
                models.append(model)
                averagers.append(cls(model.parameters(), dht=dht, prefix=impl, target_group_size=2,
                                     reuse_grad_buffers=reuse_grad_buffers, start=True, **extra))
        with shutting_down(*averagers):
            batches = [[3, 3, 3], [4, 4]] if reuse_grad_buffers else [[2, 2, 7], [4, 4]]
            for peer in range(2):
                generator = torch.Generator().manual_seed(peer)
                targets = [(torch.randn(shape, generator=generator), torch.randn(5, generator=generator))
                           for _ in batches[peer]]
                for impl in range(2):
                    model, averager = models[2 * impl + peer], averagers[2 * impl + peer]
                    for batch_size, (tw, tb) in zip(batches[peer], targets):
                        if not (reuse_grad_buffers and impl == 1):
                            model.zero_grad()
                        (F.mse_loss(model["w"], tw) + F.mse_loss(model["b"], tb)).backward()
                        averager.accumulate_grads_(batch_size=batch_size)
            local = [[acc.clone() / averager.local_times_accumulated for acc in averager._grad_accumulators()]
                     for averager in averagers[:2]]
            weights = [averager.local_samples_accumulated for averager in averagers[:2]]
            assert weights == [sum(batches[0]), sum(batches[1])]
            for pair in averagers[:2], averagers[2:]:  # one pair at a time: four matchmakings at once on two DHT
                controls = [averager.step(wait=False, timeout=30) for averager in pair]  # nodes rarely timed out
                for control in controls:
                    assert control.result(timeout=60) is not None
            ours_avg, ref_avg = [], []
            for i, averager in enumerate(averagers):
                with averager.use_averaged_gradients():
                    (ours_avg if i < 2 else ref_avg).append([p.grad.clone() for p in models[i].parameters()])
            for peer in range(2):
                for ours, ref in zip(ours_avg[peer], ref_avg[peer], strict=True):
                    torch.testing.assert_close(ours, ref)
                    assert ours.abs().sum() > 0
            if factory == "grad":
                expected = [(weights[0] * g0 + weights[1] * g1) / sum(weights) for g0, g1 in zip(*local)]
                for peer in range(2):
                    for ours, exp in zip(ours_avg[peer], expected, strict=True):
                        torch.testing.assert_close(ours, exp)
            assert all(a.local_times_accumulated == 0 for a in averagers)  # step(reset_accumulators=True)
