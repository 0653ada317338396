"""
Mixed precision: fp32 accumulation of bf16/fp16 gradients, overflowing micro-steps dropped on the device without a
host sync, and PowerSGD with a bf16 model. Oracles: an fp64 sum, native PyTorch accumulation (with the same
scripted overflow) and hand-computed native accumulation of the micro-steps that did not overflow.
"""
import multiprocessing as mp
import time
from functools import partial

import hivemind
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import hivemind_accum
from hivemind_accum import GradientAverager
from tests.conftest import MixedNet, mixed_batch, swarm, wait_for_tracker
from tests.test_grad_scaler import BATCH, EPOCHS, LR, MICRO_STEPS, SCALE, batches, make_model

SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")  # what .item() / bool(tensor) launch


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_accumulate_in_fp32(dht, dtype):
    """K micro-steps of bf16/fp16 gradients: the fp32 accumulators' error against an fp64 sum is at least 10x smaller
    than naive accumulation in the gradients' dtype (which accumulate_in_fp32=False reproduces exactly)"""
    micro_steps = 256
    model = torch.nn.Linear(64, 32).to(dtype)
    fp32 = GradientAverager(model.parameters(), dht=dht, prefix="fp32", start=False)
    low = GradientAverager(model.parameters(), dht=dht, prefix="low", accumulate_in_fp32=False, start=False)
    assert all(acc.dtype == torch.float32 for acc in fp32._grad_accumulators())
    assert all(acc.dtype == dtype for acc in low._grad_accumulators())
    generator = torch.Generator().manual_seed(0)
    reference = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    naive = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(micro_steps):
        for param, ref, acc in zip(model.parameters(), reference, naive):
            param.grad = (1 + 0.1 * torch.randn(param.shape, generator=generator)).to(dtype)
            ref += param.grad.double()
            acc += param.grad
        fp32.accumulate_grads_(batch_size=8)
        low.accumulate_grads_(batch_size=8)
    for averager in fp32, low:
        averager.load_accumulators_into_averager_()
    with fp32.get_tensors() as averaged_fp32, low.get_tensors() as averaged_low:
        assert all(avg.dtype == torch.float32 for avg in (*averaged_fp32, *averaged_low))  # shared buffers: fp32
        for avg32, avg_low, ref, acc in zip(averaged_fp32, averaged_low, reference, naive, strict=True):
            expected = ref / micro_steps
            naive_error = (acc.double() / micro_steps - expected).abs().max().item()
            fp32_error = (avg32.double() - expected).abs().max().item()
            assert naive_error > 0 and fp32_error * 10 <= naive_error, (fp32_error, naive_error)
            torch.testing.assert_close(avg_low, acc.float() / micro_steps)


@pytest.mark.forked
def test_overflowing_micro_step_is_dropped_on_the_device(dht):
    """a scripted inf/NaN in micro-step j of K: the averaged gradient equals native accumulation of the other K - 1
    (unscaled), the averaging weight counts their samples only, and .grad is left untouched"""
    torch.manual_seed(0)
    model = MixedNet()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="overflow", start=False)
    scale, batch, micro_steps = 2.0**12, 3, 5
    generator = torch.Generator().manual_seed(1)
    batches = [mixed_batch(generator, batch) for _ in range(micro_steps)]
    native = [torch.zeros_like(p) for p in model.parameters()]
    found = []
    for j, (images, tokens, targets) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(images, tokens, j % 2 == 0), targets)
        (loss * scale).backward()
        if j == 2:
            model.fc.weight.grad[0, 0] = float("inf")
        elif j == 3:
            model.double_branch.bias.grad[1] = float("nan")  # the float64 bucket: drops the whole micro-step
        else:
            for acc, param in zip(native, model.parameters()):
                if param.grad is not None:
                    acc += param.grad.to_dense() / scale
        kept_grad = model.fc.weight.grad.clone()
        found.append(averager.accumulate_grads_(batch, inv_grad_scale=torch.tensor(1 / scale)))
        torch.testing.assert_close(model.fc.weight.grad, kept_grad, rtol=0, atol=0, equal_nan=True)
    assert [f.item() for f in found] == [0, 0, 1, 1, 0]
    assert (averager.local_times_accumulated, averager.local_samples_accumulated) == (5, 5 * batch)  # until settled
    averager.load_accumulators_into_averager_()
    assert (averager.local_times_accumulated, averager.local_samples_accumulated) == (3, 3 * batch)
    with averager.get_tensors() as averaged:
        for avg, exp in zip(averaged, native, strict=True):
            torch.testing.assert_close(avg, exp / 3)
    averager.reset_accumulated_grads_()
    assert averager._dropped_micro_steps.item() == 0


@pytest.mark.forked
def test_inv_grad_scale_in_place_mode_is_a_clear_error(dht):
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="err", reuse_grad_buffers=True, start=False)
    with pytest.raises(ValueError, match="inv_grad_scale"):
        averager.accumulate_grads_(1, inv_grad_scale=torch.tensor(1.0))


# ------------------------------------------------- a single peer training with a grad scaler --------------------------
OVERFLOW_AT = (0, 2)  # epoch 0, micro-step 2; model, data and hyperparameters as in test_grad_scaler


def loss_fn(model, x, y, step):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    return loss * float("inf") if divmod(step, MICRO_STEPS) == OVERFLOW_AT else loss


def native_reference(drop: str):
    """native PyTorch accumulation. drop="micro_step" (what the exact mode promises): plain backward of the unscaled
    loss, leaving the overflowing micro-step out of the mean; drop="epoch" (native behaviour with a grad scaler,
    what the in-place mode promises): torch.amp.GradScaler skips the whole accumulated step and backs off"""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=drop == "epoch")
    kept = 0
    for step, (x, y) in enumerate(batches()):
        if drop == "micro_step" and divmod(step, MICRO_STEPS) == OVERFLOW_AT:
            continue
        scaler.scale(loss_fn(model, x, y, step)).backward()
        kept += 1
        if (step + 1) % MICRO_STEPS == 0:
            scaler.unscale_(opt)
            for param in model.parameters():
                param.grad /= kept
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            kept = 0
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale() if drop == "epoch" else SCALE / 2


def _train(scaler_kind: str, reuse_grad_buffers: bool, queue, optimizer_cls=hivemind_accum.Optimizer):
    model = make_model()
    dht = hivemind.DHT(start=True)
    opt = optimizer_cls(
        dht=dht, run_id="amp_drop", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        target_batch_size=MICRO_STEPS * BATCH, batch_size_per_step=BATCH, reuse_grad_buffers=reuse_grad_buffers,
        matchmaking_time=0.5, averaging_timeout=5,
    )
    scaler_cls = hivemind.GradScaler if scaler_kind == "hivemind" else torch.amp.GradScaler
    scaler = scaler_cls("cpu", init_scale=SCALE)
    loaded = {}  # epoch -> (samples, micro-steps) when the accumulators are loaded into the averager
    load = opt.grad_averager.load_accumulators_into_averager_

    def recording_load():
        load()
        loaded[opt.local_epoch] = opt.grad_averager.local_samples_accumulated, opt.grad_averager.local_times_accumulated

    opt.grad_averager.load_accumulators_into_averager_ = recording_load
    sync_ops, scales = [], []
    try:
        for step, (x, y) in enumerate(batches()):
            if not reuse_grad_buffers:
                opt.zero_grad()
            scaler.scale(loss_fn(model, x, y, step)).backward()
            no_sync_step = (step + 1) % MICRO_STEPS != 0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                scaler.step(opt)
                if scaler_kind == "torch":
                    scaler.update()
            if scaler_kind == "hivemind":
                scaler.update()  # hivemind.GradScaler.update reads the overflow flag on the host (upstream code)
            if no_sync_step:
                sync_ops.append(sum(1 for e in prof.events() if e.name in SYNC_OPS))
            wait_for_tracker(opt)
            scales.append(scaler.get_scale())
        queue.put((opt.local_epoch, [p.detach().clone() for p in model.parameters()], loaded, sync_ops, scales))
    except Exception as e:
        queue.put(e)
    finally:
        opt.shutdown()
        dht.shutdown()


def train(scaler_kind: str, reuse_grad_buffers: bool, optimizer_cls=hivemind_accum.Optimizer):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=_train, args=(scaler_kind, reuse_grad_buffers, queue, optimizer_cls))
    process.start()
    result = queue.get(timeout=120)
    process.join(timeout=60)
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.forked
@pytest.mark.parametrize("scaler_kind", ["torch", "hivemind"])
def test_exact_mode_drops_only_the_overflowing_micro_step(scaler_kind):
    epoch, params, loaded, sync_ops, scales = train(scaler_kind, reuse_grad_buffers=False)
    expected, expected_scale = native_reference(drop="micro_step")
    assert epoch == EPOCHS
    full, dropped = (MICRO_STEPS * BATCH, MICRO_STEPS), ((MICRO_STEPS - 1) * BATCH, MICRO_STEPS - 1)
    assert loaded == {0: dropped, 1: full, 2: full}  # the averaging weight leaves the dropped micro-step out
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)
    assert scales[OVERFLOW_AT[0] * MICRO_STEPS + OVERFLOW_AT[1]] == SCALE / 2 == expected_scale  # backed off at once
    assert sync_ops == [0] * len(sync_ops) and len(sync_ops) == EPOCHS * (MICRO_STEPS - 1)


@pytest.mark.forked
def test_in_place_mode_drops_the_overflowing_epoch_like_native():
    epoch, params, loaded, sync_ops, scales = train("hivemind", reuse_grad_buffers=True)
    expected, expected_scale = native_reference(drop="epoch")
    assert epoch == EPOCHS
    full = (MICRO_STEPS * BATCH, MICRO_STEPS)
    assert loaded == {0: (0, 0), 1: full, 2: full}  # the overflowing round was dropped before reaching the averager
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)
    assert scales[-1] == expected_scale == SCALE / 2
    assert sync_ops == [0] * len(sync_ops) and len(sync_ops) == EPOCHS * (MICRO_STEPS - 1)


@pytest.mark.forked
def test_sync_guard_sees_upstreams_per_micro_step_overflow_check():
    """the guard above is not vacuous: upstream's no-sync step reads the overflow flag on the host every micro-step"""
    *_, sync_ops, _ = train("hivemind", reuse_grad_buffers=True, optimizer_cls=hivemind.Optimizer)
    assert all(count >= 1 for count in sync_ops) and len(sync_ops) == EPOCHS * (MICRO_STEPS - 1)


@pytest.mark.forked
def test_plain_torch_grad_scaler_in_place_is_a_clear_error():
    with pytest.raises(ValueError, match="hivemind.GradScaler"):
        train("torch", reuse_grad_buffers=True)


# ------------------------------------------------- PowerSGD with a bf16 model, two peers -----------------------------
def _powersgd_peer(rank: int, initial_peers, queue, barrier):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    dht = hivemind.DHT(start=True, initial_peers=initial_peers)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="powersgd_bf16", params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.2),
        target_batch_size=2 * 3 * 8, batch_size_per_step=8, matchmaking_time=1.0, averaging_timeout=10,
        grad_averager_factory=partial(hivemind_accum.PowerSGDGradientAverager, averager_rank=2),
    )
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=generator)
    y = x[:, :4] * 0.5
    averaged_rounds = []
    opt._average_gradients_and_load_into_optimizer = _counting(opt._average_gradients_and_load_into_optimizer,
                                                               opt, averaged_rounds)

    def loss():
        with torch.no_grad():
            return F.mse_loss(model(x.bfloat16()).float(), y).item()

    try:
        initial_loss = loss()
        barrier.wait(timeout=60)
        step = 0
        while opt.local_epoch < 4 and step < 200:
            opt.zero_grad()
            batch = slice(8 * (step % 8), 8 * (step % 8) + 8)
            F.mse_loss(model(x[batch].bfloat16()).float(), y[batch]).backward()
            opt.step()
            step += 1
            time.sleep(0.25)  # both peers reach each epoch's end together, so the round finds its group
        queue.put((rank, opt.local_epoch, initial_loss, loss(), sum(averaged_rounds),
                   all(p.isfinite().all() for p in model.parameters())))
    except Exception as e:
        queue.put(e)
    finally:
        opt.shutdown()
        dht.shutdown()


def _counting(method, opt, rounds):
    def wrapper(control):
        method(control)
        rounds.append(control is not None and control.done() and control.exception() is None)
    return wrapper


@pytest.mark.forked
@pytest.mark.timeout(240)
def test_bf16_model_trains_with_two_peers_and_powersgd():
    """a bf16 model with the default offloaded optimizer: upstream hivemind 1.1.12 fails before training ("attempting
    to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float": its averaged gradients keep the
    parameters' dtype, the offloaded optimizer's parameters are float32); ours averages float32 buffers, PowerSGD's
    error-feedback buffers included"""
    ctx = mp.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    with swarm(1) as (root,):
        peers = [ctx.Process(target=_powersgd_peer, args=(rank, root.get_visible_maddrs(), queue, barrier))
                 for rank in range(2)]
        for process in peers:
            process.start()
        try:
            results = [queue.get(timeout=200) for _ in peers]
        finally:
            for process in peers:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    for result in results:
        assert not isinstance(result, Exception), result
        rank, epoch, initial_loss, final_loss, averaged_rounds, finite = result
        assert epoch >= 4 and finite
        assert averaged_rounds >= 2, f"peer {rank}: only {averaged_rounds} PowerSGD rounds succeeded"
        assert final_loss < 0.8 * initial_loss, (rank, initial_loss, final_loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_cuda_no_sync_step_with_grad_scaler_does_not_synchronize(reuse_grad_buffers):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    dht = hivemind.DHT(start=True)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="cuda_sync", params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        target_batch_size=10**6, batch_size_per_step=4, reuse_grad_buffers=reuse_grad_buffers,
    )
    scaler = hivemind.GradScaler("cuda") if reuse_grad_buffers else torch.amp.GradScaler("cuda")
    try:
        for step in range(4):
            x = torch.randn(4, 64, device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            if step >= 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                scaler.step(opt)
                if not reuse_grad_buffers:
                    scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if reuse_grad_buffers:
                scaler.update()
        assert opt.grad_averager.local_times_accumulated == 4
    finally:
        opt.shutdown()
        dht.shutdown()
