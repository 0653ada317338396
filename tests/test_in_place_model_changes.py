"""
In-place mode where the model changes after the optimizer is built, as upstream's ``reuse_grad_buffers=True`` allows:
a solo peer (whose own gradients the optimizer steps with), ``model.half()`` or ``model.double()`` mid-epoch, and a
parameter frozen at build and unfrozen mid-epoch; with an optimizer instance and a factory, alone and with two peers.

Oracle: each micro-batch's gradient, computed beforehand on a copy of the model as it is at that micro-step, and a
torch optimizer that records what it is handed. A solo peer must be handed the mean of its epoch's micro-batch
gradients; two peers the sample-weighted mean of both peers' means (or, after a failed round, their own).
"""
import copy
import multiprocessing as mp
import time

import hivemind
import pytest
import torch
import torch.nn.functional as F

import hivemind_accum
from tests.conftest import SINGLE_PEER_TRACKER, receive_by_value, send_by_value, swarm

MICRO_STEPS, BATCH, EPOCHS, CHANGE_AT = 4, 4, 3, 2  # the change comes after micro-step 2 of the first epoch


class RecordingSGD(torch.optim.SGD):
    """SGD keeping a float32 copy of every gradient it steps with once ``recording`` is set (hivemind's constructor
    runs one step on zero gradients first)"""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.recording, self.handed = False, []

    def step(self, closure=None):
        if self.recording:
            self.handed.append([torch.zeros(p.shape) if p.grad is None else p.grad.detach().float().clone()
                                for group in self.param_groups for p in group["params"]])
        return super().step(closure)


class Conv(torch.nn.Module):
    """a 1x2 convolution over 3 channels of a 1x2 image (a Linear(3 x 2, 4) whose weight's memory order channels_last
    changes)"""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, (1, 2))

    def forward(self, x):
        return self.conv(x[:, :, None, None] * torch.tensor([1.0, -0.5])).flatten(1)


def make_model(change):
    torch.manual_seed(0)
    first = Conv() if change == "channels_last" else torch.nn.Linear(3, 4)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(4, 2))
    if change == "unfreeze":
        model[2].bias.requires_grad_(False)
    return model


def apply_change(model, change):
    if change == "half":
        model.half()
    elif change == "double":
        model.double()
    elif change == "unfreeze":
        model[2].bias.requires_grad_(True)
    elif change == "channels_last":
        model.to(memory_format=torch.channels_last)


def loss(model, x, y):
    """the squared error, taken in float32 (torch 2.3 has no float16 mse_loss backward on the CPU)"""
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def micro_batch_grads(model, x, y):
    """this micro-batch's gradient alone, on a copy of the model as it is (float32; zeros where there is none)"""
    reference = copy.deepcopy(model)
    for param in reference.parameters():
        param.grad = None
    loss(reference, x, y).backward()
    return [torch.zeros(p.shape) if p.grad is None else p.grad.float() for p in reference.parameters()]


def train(change, instance, dht, rank=0, peers=1, barrier=None):
    """train one peer for EPOCHS optimizer steps; returns the gradients handed to each step and this peer's (mean,
    samples) of each epoch, both keyed by the epoch (an epoch a state download skips has neither)"""
    model = make_model(change)
    kwargs = dict(tracker_opts=SINGLE_PEER_TRACKER) if peers == 1 else dict(tracker_opts=dict(max_refresh_period=1.0))
    if instance:
        kwargs["optimizer"] = RecordingSGD(model.parameters(), lr=0.1)
    else:
        kwargs.update(params=model.parameters(), optimizer=lambda params: RecordingSGD(params, lr=0.1))
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id=f"changes_{change}_{instance}", target_batch_size=MICRO_STEPS * BATCH * peers,
        batch_size_per_step=BATCH, reuse_grad_buffers=True, matchmaking_time=1.0, averaging_timeout=60.0,
        average_state_every=10**6, verbose=False, **kwargs,
    )
    recorder = opt.state_averager.optimizer
    recorder.recording = True
    if barrier is not None:
        update_global_epoch = opt._update_global_epoch

        def together(grad_scaler):  # both peers enter every epoch boundary together
            barrier.wait(timeout=120)
            update_global_epoch(grad_scaler)

        opt._update_global_epoch = together
        opt.tracker.report_local_progress(opt.local_epoch, 1)
        deadline = time.monotonic() + 60
        while opt.tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    generator = torch.Generator().manual_seed(rank)
    handed, means, epoch_grads, step = {}, {}, [], 0
    try:
        while len(recorder.handed) < EPOCHS:
            if step == CHANGE_AT:
                apply_change(model, change)
            x, y = torch.randn(BATCH, 3, generator=generator), torch.randn(BATCH, 2, generator=generator)
            epoch_grads.append(micro_batch_grads(model, x, y))
            loss(model, x, y).backward(create_graph=change == "create_graph")
            epoch, steps_before = opt.local_epoch, len(recorder.handed)
            opt.step()
            step += 1
            if len(recorder.handed) > steps_before:
                handed[epoch] = recorder.handed[-1]
            if opt.local_epoch != epoch:
                means[epoch] = ([torch.stack(g).mean(0) for g in zip(*epoch_grads)], BATCH * len(epoch_grads))
                epoch_grads = []
        for param in model.parameters():
            param.grad = None  # drop any graph kept by create_graph
        return handed, means
    finally:
        opt.shutdown()


def tolerance(change):
    return dict(rtol=2e-2, atol=2e-3) if change == "half" else dict(rtol=1e-5, atol=1e-6)


CHANGES = [None, "half", "double", "unfreeze", "channels_last", "create_graph"]


@pytest.mark.forked
@pytest.mark.parametrize("instance", [True, False], ids=["instance", "factory"])
@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_solo_peer_steps_with_the_mean_of_its_micro_batch_gradients(dht, change, instance):
    handed, means = train(change, instance, dht)
    assert len(handed) == EPOCHS
    for epoch, grads in handed.items():
        mean, _ = means[epoch]
        assert all(m.abs().sum() > 0 for m in mean[:2])
        for got, want in zip(grads, mean, strict=True):
            torch.testing.assert_close(got, want, **tolerance(change), msg=lambda m: f"epoch {epoch}: {m}")


def _peer(rank, change, instance, initial_peers, barrier, queue):
    dht = hivemind.DHT(start=True, initial_peers=initial_peers)
    try:
        send_by_value(queue, (rank, train(change, instance, dht, rank=rank, peers=2, barrier=barrier)))
        barrier.wait(timeout=120)  # the other peer is through too
    finally:
        dht.shutdown()


@pytest.mark.forked
@pytest.mark.timeout(600)
@pytest.mark.parametrize("instance", [True, False], ids=["instance", "factory"])
@pytest.mark.parametrize("change", [None, "half", "unfreeze"], ids=str)
def test_two_peers_step_with_the_weighted_mean_of_both_peers_gradients(change, instance):
    ctx = mp.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    with swarm(1) as (bootstrap,):
        args = (change, instance, bootstrap.get_visible_maddrs(), barrier, queue)
        peers = [ctx.Process(target=_peer, args=(rank, *args)) for rank in (0, 1)]
        for peer in peers:
            peer.start()
        try:
            results = dict(receive_by_value(queue, timeout=300) for _ in peers)
        finally:
            for peer in peers:
                peer.join(timeout=60)
                if peer.is_alive():
                    peer.kill()
    averaged = 0
    for rank in (0, 1):
        handed, means = results[rank]
        assert len(handed) == EPOCHS
        for epoch, grads in handed.items():  # paired by epoch: one peer may skip an epoch by downloading the state
            own, own_samples = means[epoch]
            wants = [own]
            if epoch in results[1 - rank][1]:
                other, other_samples = results[1 - rank][1][epoch]
                wants.insert(0, [(own_samples * a + other_samples * b) / (own_samples + other_samples)
                                 for a, b in zip(own, other)])
            close = [all(torch.allclose(g, w, **tolerance(change)) for g, w in zip(grads, want)) for want in wants]
            assert any(close), f"peer {rank}, epoch {epoch}: handed neither the average nor its own mean"
            averaged += len(wants) == 2 and close[0]
    assert averaged >= 2, f"only {averaged} of {2 * EPOCHS} steps averaged"
