"""hivemind_accum.Optimizer against upstream hivemind.Optimizer as the oracle."""
import multiprocessing as mp
import time

import hivemind
import pytest
import torch
import torch.nn.functional as F

import hivemind_accum
from tests.conftest import SINGLE_PEER_TRACKER, receive_by_value, send_by_value


def _train_one_peer(optimizer_cls_name: str, reuse_grad_buffers: bool, offload: bool, zero_grad: bool, result_queue):
    optimizer_cls = dict(upstream=hivemind.Optimizer, ours=hivemind_accum.Optimizer, patched=hivemind.Optimizer)[
        optimizer_cls_name
    ]
    if optimizer_cls_name == "patched":
        hivemind_accum.patch_hivemind()  # a training loop written against plain hivemind.Optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    dht = hivemind.DHT(start=True)
    kwargs = dict(params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    if not offload:
        kwargs = dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), offload_optimizer=False)
    opt = optimizer_cls(
        dht=dht, run_id=f"single_{optimizer_cls_name}", target_batch_size=12, batch_size_per_step=4,
        matchmaking_time=0.5, averaging_timeout=5, reuse_grad_buffers=reuse_grad_buffers, verbose=False,
        tracker_opts=SINGLE_PEER_TRACKER, **kwargs,
    )
    generator = torch.Generator().manual_seed(1)
    initial = [p.detach().clone() for p in model.parameters()]
    epochs = []
    try:
        for step in range(14):
            x, y = torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)
            if zero_grad:
                opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            epochs.append(opt.local_epoch)
        averager = f"{type(opt.grad_averager).__module__}.{type(opt.grad_averager).__name__}"
        send_by_value(result_queue, (epochs, initial, [p.detach().clone() for p in model.parameters()], averager))
    finally:
        opt.shutdown()
        dht.shutdown()


def train_one_peer(name: str, reuse_grad_buffers: bool = False, offload: bool = True, zero_grad: bool = True):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=_train_one_peer, args=(name, reuse_grad_buffers, offload, zero_grad, queue))
    process.start()
    *result, averager = receive_by_value(queue, timeout=120)
    process.join(timeout=60)
    expected = "hivemind.optim.grad_averager" if name == "upstream" else "hivemind_accum.integration.grad_averager"
    assert averager == expected + ".GradientAverager"
    return result


@pytest.mark.forked
@pytest.mark.parametrize("offload", [True, False])
def test_optimizer_trains_like_upstream_single_peer(offload):
    ref_epochs, ref_initial, ref_params = train_one_peer("upstream", offload=offload)
    epochs, initial, params = train_one_peer("ours", offload=offload)
    assert ref_epochs[-1] >= 3, "the run must cross several epochs for the comparison to mean anything"
    assert epochs == ref_epochs
    for ours, ref, start in zip(params, ref_params, initial, strict=True):
        torch.testing.assert_close(ours, ref)
        assert (ours - start).abs().max() > 1e-3  # training moved every parameter


@pytest.mark.forked
def test_in_place_optimizer_allows_zero_grad_and_trains_like_upstream():
    """upstream's reuse_grad_buffers=True forbids zero_grad; ours accepts it (a framework zeroing gradients after
    every optimizer call) and still trains exactly like upstream's in-place run without zero_grad"""
    ref_epochs, _, ref_params = train_one_peer("upstream", reuse_grad_buffers=True, zero_grad=False)
    epochs, _, params = train_one_peer("ours", reuse_grad_buffers=True, zero_grad=True)
    assert ref_epochs[-1] >= 3 and epochs == ref_epochs
    for ours, ref in zip(params, ref_params, strict=True):
        torch.testing.assert_close(ours, ref)


@pytest.mark.forked
def test_optimizer_uses_hivemind_accum_averager():
    dht = hivemind.DHT(start=True)
    model = torch.nn.Linear(4, 2)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="factory", target_batch_size=8, batch_size_per_step=2,
        params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    try:
        assert type(opt.grad_averager) is hivemind_accum.GradientAverager
        assert isinstance(opt, hivemind.Optimizer)
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.forked
def test_patch_hivemind_switches_plain_hivemind_optimizer():
    """after patch_hivemind(), plain hivemind.Optimizer(reuse_grad_buffers=True) accumulates in hivemind_accum's
    averager (train_one_peer checks its type), accepts zero_grad() and trains like upstream's in-place run"""
    ref_epochs, _, ref_params = train_one_peer("upstream", reuse_grad_buffers=True, zero_grad=False)
    epochs, _, params = train_one_peer("patched", reuse_grad_buffers=True, zero_grad=True)
    assert epochs == ref_epochs and epochs[-1] >= 3
    for ours, ref in zip(params, ref_params, strict=True):
        torch.testing.assert_close(ours, ref)

    upstream_default = hivemind.optim.optimizer.GradientAverager
    hivemind_accum.patch_hivemind()
    assert hivemind_accum.is_patched() and hivemind.optim.optimizer.GradientAverager is hivemind_accum.GradientAverager
    hivemind_accum.unpatch_hivemind()
    assert not hivemind_accum.is_patched() and hivemind.optim.optimizer.GradientAverager is upstream_default
    assert hivemind.Optimizer.zero_grad is not hivemind_accum.Optimizer.zero_grad


def _train_full_or_client_peer(client: bool, initial_peers, queue, done):
    """a linear loss (constant gradient `direction`) and SGD at lr 1 without momentum or parameter averaging: whatever
    the rounds do (average identical gradients, fall back to local ones, download the other peer's state), a peer at
    epoch e has weight init - e * direction"""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    direction = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    initial = model.weight.detach().clone()
    dht = hivemind.DHT(start=True, client_mode=client, initial_peers=initial_peers)
    if not client:
        send_by_value(queue, dht.get_visible_maddrs())
    opt = hivemind_accum.Optimizer(  # no client_mode=: taken from the DHT
        dht=dht, run_id="client_mode", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        target_batch_size=16, batch_size_per_step=4, matchmaking_time=1.0, averaging_timeout=5.0,
        average_state_every=10**6, tracker_opts=dict(max_refresh_period=2.0),
    )
    try:
        modes = (opt.client_mode, opt.grad_averager.client_mode, opt.state_averager.client_mode, opt.tracker.client_mode)

        def micro_step():
            opt.zero_grad()
            (model.weight * direction).sum().backward()
            opt.step()

        micro_step()  # this peer's first progress report; then let its tracker see both peers, so that they average
        deadline = time.monotonic() + 120
        while opt.tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        while opt.local_epoch < 3 and time.monotonic() < deadline:
            micro_step()
        send_by_value(queue, (client, modes, opt.local_epoch, initial, model.weight.detach().clone(), direction))
        done.wait(timeout=60)  # stay in the swarm until both peers are through: the other may need this one's state
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.forked
def test_client_mode_peer_trains_with_a_full_peer():
    """a peer behind NAT (hivemind.DHT(client_mode=True)) whose optimizer is built without client_mode trains through
    epochs with a full peer; upstream 1.1.12's optimizer keeps client_mode=None there and dies when its first epoch
    ends ("State sharing priority is unused: averager in client mode cannot share its state")"""
    ctx = mp.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    full = ctx.Process(target=_train_full_or_client_peer, args=(False, None, queue, done))
    full.start()
    maddrs = receive_by_value(queue, timeout=60)
    client = ctx.Process(target=_train_full_or_client_peer, args=(True, maddrs, queue, done))
    client.start()
    try:
        results = {r[0]: r[1:] for r in (receive_by_value(queue, timeout=180), receive_by_value(queue, timeout=180))}
    finally:
        done.set()
        for process in full, client:
            process.join(timeout=60)
    for is_client, (modes, epoch, initial, weight, direction) in results.items():
        assert modes == (is_client,) * 4
        assert epoch >= 3
        torch.testing.assert_close(weight, initial - epoch * direction)


@pytest.mark.forked
def test_explicit_client_mode_is_kept(dht):
    """client_mode=True on a full DHT: every part of the peer is a client (upstream 1.1.12 replaces the value by the
    DHT's, so its peer is a full one)"""
    def modes(optimizer_cls, run_id):
        opt = optimizer_cls(
            dht=dht, run_id=run_id, target_batch_size=8, batch_size_per_step=2, client_mode=True,
            params=torch.nn.Linear(3, 2).parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
        try:
            return opt.client_mode, opt.grad_averager.client_mode, opt.state_averager.client_mode, opt.tracker.client_mode
        finally:
            opt.shutdown()

    assert not dht.client_mode
    assert modes(hivemind_accum.Optimizer, "explicit") == (True, True, True, True)
    assert modes(hivemind.Optimizer, "explicit_upstream") == (False, False, False, False)
