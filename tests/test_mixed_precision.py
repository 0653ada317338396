"""
Mixed precision: fp32 accumulation of bf16/fp16 gradients, overflowing micro-steps dropped (on the device without a
host sync, or on the CPU after one free host read: both paths are tested on CPU, the device path by forcing it),
and PowerSGD with a bf16 model. Oracles: an fp64 sum, native PyTorch accumulation (with the same
scripted overflow) and hand-computed native accumulation of the micro-steps that did not overflow.
"""
import logging
import multiprocessing as mp
import time
from functools import partial

import hivemind
import pytest
import torch
import torch.nn.functional as F
from hivemind.optim.grad_averager import GradientAverager as UpstreamGradientAverager

import hivemind_accum
from hivemind_accum import GradientAverager
from hivemind_accum import torch_compat as torch_internals
from hivemind_accum.buffers import finite_add
from hivemind_accum.integration import schema_mismatch
from tests.conftest import (
    DEVICES, NEEDS_CUDA, SINGLE_PEER_TRACKER, MixedNet, mixed_batch, receive_by_value, send_by_value, shutting_down,
    swarm, without_cyclic_gc,
)
from tests.test_grad_scaler import BATCH, EPOCHS, LR, MICRO_STEPS, SCALE, make_model
from tests.upstream_checks import HostReads  # counts aten::_local_scalar_dense: .item(), float(), bool(), .tolist()

# GradientBuckets.add_finite_'s paths: read on the host; on the device, with the fused skipping add where torch has a
# kernel for it (else as device_staging); on the device, every bucket through its staging buffer
LOSS_SCALING_PATHS = ["host_check", "device_check", "device_staging"]


def force_loss_scaling_path(path: str) -> None:
    """make add_finite_ take ``path`` even on CPU (it picks host_check when all data is on the CPU); call it in the
    process that trains (tests here are forked, so the change dies with the test)"""
    finite_add.host_check_is_free = lambda buckets: path == "host_check"
    if path == "device_staging":
        finite_add.has_add_unless_found_inf = lambda device, dtype: False


@pytest.mark.forked
@pytest.mark.parametrize("path", LOSS_SCALING_PATHS)
def test_dropped_samples_are_counted_exactly_past_float32s_integers(dht, path):
    """three dropped micro-steps of 2**24 + 1 samples, then one kept: the averaging weight is that one's batch size
    exactly (float32 counters would subtract 3 * 2**24 and leave 3 samples too many) and its gradient is the average"""
    force_loss_scaling_path(path)
    model = torch.nn.Linear(4, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="counts", start=False)
    batch_size = 2**24 + 1
    for overflow in (True, True, True, False):
        for param in model.parameters():
            param.grad = torch.full_like(param, float("inf") if overflow else 3.0)
        averager.accumulate_grads_(batch_size, inv_grad_scale=torch.tensor(1.0))
    averager.load_accumulators_into_averager_()
    assert (averager.local_times_accumulated, averager.local_samples_accumulated) == (1, batch_size)
    with averager.get_tensors() as averaged:
        for avg in averaged:
            assert torch.equal(avg, torch.full_like(avg, 3.0))


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_accumulate_in_fp32(dht, dtype):
    """K micro-steps of bf16/fp16 gradients: the fp32 accumulators' error against an fp64 sum is at least 10x smaller
    than naive accumulation in the gradients' dtype (which accumulate_in_fp32=False reproduces exactly)"""
    micro_steps = 256
    model = torch.nn.Linear(64, 32).to(dtype)
    fp32 = GradientAverager(model.parameters(), dht=dht, prefix="fp32", start=False,
                            averaged_grads_dtype=torch.float32)  # the accumulators' precision, not rounded again
    low = GradientAverager(model.parameters(), dht=dht, prefix="low", accumulate_in_fp32=False, start=False,
                           averaged_grads_dtype=torch.float32)
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
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", LOSS_SCALING_PATHS)
def test_overflowing_micro_step_is_dropped(dht, path, device):
    """a scripted inf/NaN in micro-step j of K: the averaged gradient equals native accumulation of the other K - 1
    (unscaled), the averaging weight counts their samples only, and .grad of a bucket staged for its sparse gradient
    is left untouched; in every path"""
    force_loss_scaling_path(path)
    torch.manual_seed(0)
    model = MixedNet().to(device)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="overflow", start=False)
    scale, batch, micro_steps = 2.0**12, 3, 5
    generator = torch.Generator().manual_seed(1)
    batches = [[t.to(device) for t in mixed_batch(generator, batch)] for _ in range(micro_steps)]
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
        found.append(averager.accumulate_grads_(batch, inv_grad_scale=torch.tensor(1 / scale)).clone())
        torch.testing.assert_close(model.fc.weight.grad, kept_grad, rtol=0, atol=0, equal_nan=True)
    assert [f.item() for f in found] == [0, 0, 1, 1, 0]
    assert (averager.local_times_accumulated, averager.local_samples_accumulated) == (5, 5 * batch)  # until settled
    averager.load_accumulators_into_averager_()
    assert (averager.local_times_accumulated, averager.local_samples_accumulated) == (3, 3 * batch)
    with averager.get_tensors() as averaged:
        for avg, exp in zip(averaged, native, strict=True):
            torch.testing.assert_close(avg, exp.cpu() / 3)
    averager.reset_accumulated_grads_()
    assert averager._dropped.collect_() == (0, 0, 0)  # nothing left to subtract from the next epoch


@pytest.mark.forked
def test_fused_skipping_add_unscales_grad_in_place_and_holds_no_staging_buffer(dht):
    """the device path with dense gradients of the accumulators' dtype (channels_last and float64 ones included, a
    frozen layer and a sometimes-unused one): each .grad is unscaled in place, as torch.amp.GradScaler.unscale_ leaves
    it; an overflowing micro-step adds nothing; the sum equals native accumulation of the kept micro-steps; no bucket
    allocates a staging buffer. A .grad with other strides than its parameter takes the staging buffer, same sums"""
    if not torch_internals.has_add_unless_found_inf(torch.device("cpu"), torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for _fused_sgd_: the staging path runs here")
    force_loss_scaling_path("device_check")
    torch.manual_seed(0)
    model = MixedNet(sparse_embedding=False)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="fused", start=False)
    scale, batch = 2.0**10, 3
    generator = torch.Generator().manual_seed(1)
    native = [torch.zeros_like(p) for p in model.parameters()]
    for j in range(5):
        images, tokens, targets = mixed_batch(generator, batch)
        model.zero_grad(set_to_none=True)
        (F.mse_loss(model(images, tokens, j % 2 == 0), targets) * scale).backward()
        if j == 2:
            model.fc.weight.grad[0, 0] = float("inf")
        if j == 4:  # strides other than the parameter's: this bucket is staged, the other one is not
            model.fc.weight.grad = model.fc.weight.grad.t().contiguous().t()
        scaled = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        found_inf = averager.accumulate_grads_(batch, inv_grad_scale=torch.tensor(1 / scale)).item()
        assert found_inf == (1.0 if j == 2 else 0.0)
        staged_fc = j == 4
        for k, (param, before) in enumerate(zip(model.parameters(), scaled, strict=True)):
            if before is None:
                assert param.grad is None
                continue
            left_scaled = staged_fc and param.dtype == torch.float32
            expected = before if left_scaled else before / scale
            torch.testing.assert_close(param.grad, expected, rtol=0, atol=0, equal_nan=True)
            if j != 2:
                native[k] += before / scale
    assert [bucket.staging is not None for bucket in averager._accumulators.buckets] == [True, False]
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        for avg, exp in zip(averaged, native, strict=True):
            torch.testing.assert_close(avg, exp / 4)


@pytest.mark.forked
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_device_path_adds_every_element_in_the_accumulators_dtype(dht, dtype):
    """the device path with accumulators in the gradients' dtype (accumulate_in_fp32=False for fp16/bf16), forced on
    the CPU, on tensors longer than the fused kernels' vector loops: every element is added. torch 2.4-2.13's fused SGD
    kernel for the CPU drops fp16/bf16 results of its vector loop; that path must not be taken there"""
    force_loss_scaling_path("device_check")
    model = torch.nn.Linear(67, 3).to(dtype)  # 201 + 3 elements: vector loops and scalar tails
    averager = GradientAverager(model.parameters(), dht=dht, prefix="dtypes", start=False, accumulate_in_fp32=False)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(2):
        for param, total in zip(model.parameters(), expected):
            grad = torch.arange(param.numel(), dtype=dtype).reshape(param.shape) % 7 + step  # exact in every dtype
            param.grad = grad * 8.0
            total += grad
        assert averager.accumulate_grads_(1, inv_grad_scale=torch.tensor(1 / 8.0)).item() == 0.0
    for accumulator, total in zip(averager._grad_accumulators(), expected, strict=True):
        assert accumulator.dtype == dtype
        torch.testing.assert_close(accumulator, total, rtol=0, atol=0)


@pytest.mark.forked
@pytest.mark.parametrize("path", LOSS_SCALING_PATHS)
def test_dropped_first_micro_step_does_not_anchor_batch_size_weights(dht, path):
    """upstream weighs micro-step i by b_i / b_first; when the first micro-step is dropped, the result must equal
    upstream's averager fed only the kept micro-steps"""
    force_loss_scaling_path(path)
    ours_model, ref_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ours = GradientAverager(ours_model.parameters(), dht=dht, prefix="anchor", start=False)
    ref = UpstreamGradientAverager(ref_model.parameters(), dht=dht, prefix="anchor_ref", start=False)
    generator = torch.Generator().manual_seed(0)
    for step, batch_size in enumerate([1, 4, 4, 3]):
        grads = [torch.randn(p.shape, generator=generator) for p in ours_model.parameters()]
        for param, grad in zip(ours_model.parameters(), grads):
            param.grad = grad * 8.0 if step else torch.full_like(grad, float("nan"))
        ours.accumulate_grads_(batch_size, inv_grad_scale=torch.tensor(1 / 8.0))
        if step:
            for param, grad in zip(ref_model.parameters(), grads):
                param.grad = grad.clone()
            ref.accumulate_grads_(batch_size)
    for averager in ours, ref:
        averager.load_accumulators_into_averager_()
    assert ours.local_samples_accumulated == ref.local_samples_accumulated == 11
    with ours.get_tensors() as averaged, ref.get_tensors() as expected:
        for avg, exp in zip(averaged, expected, strict=True):
            torch.testing.assert_close(avg, exp)


@pytest.mark.forked
@pytest.mark.parametrize("path", LOSS_SCALING_PATHS)
def test_fp16_gradients_are_unscaled_in_fp32(dht, path):
    """loss scaling exists to keep small fp16 gradients: unscaling must happen after the cast to the float32
    accumulator, or values below fp16's range (6e-8) become zero (float32 averaged buffers keep them; fp16 ones, the
    default, round them as upstream's do)"""
    force_loss_scaling_path(path)
    scale = 2.0**16
    model = torch.nn.Linear(100, 10).half()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="fp16", start=False,
                                averaged_grads_dtype=torch.float32)
    true_grads = [torch.logspace(-9, -3, p.numel(), dtype=torch.float64).reshape(p.shape) for p in model.parameters()]
    for param, grad in zip(model.parameters(), true_grads):
        param.grad = (grad * scale).half()  # what backward of a scaled loss writes
    averager.accumulate_grads_(4, inv_grad_scale=torch.tensor(1 / scale))
    averager.load_accumulators_into_averager_()
    with averager.get_tensors() as averaged:
        for avg, param in zip(averaged, model.parameters(), strict=True):
            assert avg.dtype == torch.float32 and avg.count_nonzero() == avg.numel()
            torch.testing.assert_close(avg.double(), param.grad.double() / scale, rtol=1e-7, atol=0)


@pytest.mark.forked
def test_inv_grad_scale_in_place_mode_is_a_clear_error(dht):
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix="err", reuse_grad_buffers=True, start=False)
    with pytest.raises(ValueError, match="inv_grad_scale"):
        averager.accumulate_grads_(1, inv_grad_scale=torch.tensor(1.0))


# ------------------------------------------------- a single peer training with a grad scaler --------------------------
# model and hyperparameters as in test_grad_scaler; micro-steps are numbered from 0 over the whole run


def make_batches(count: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(count)]


def loss_fn(model, x, y, step, overflow):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    return loss * float("inf") if step in overflow else loss


def native_reference(drop: str, overflow=frozenset()):
    """native PyTorch accumulation. drop="micro_step" (what the exact mode promises): plain backward of the unscaled
    loss, leaving the overflowing micro-steps out; an epoch is MICRO_STEPS kept micro-steps, as the swarm's target
    counts only kept samples. drop="epoch" (native behaviour with a grad scaler, what the in-place mode promises):
    epochs of MICRO_STEPS micro-steps, and torch.amp.GradScaler skips an epoch's step if any of them overflowed"""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, enabled=drop == "epoch")
    kept = 0
    for step, (x, y) in enumerate(make_batches(EPOCHS * MICRO_STEPS + (len(overflow) if drop == "micro_step" else 0))):
        if drop == "micro_step" and step in overflow:
            continue
        scaler.scale(loss_fn(model, x, y, step, overflow)).backward()
        kept += 1
        if kept == MICRO_STEPS:
            scaler.unscale_(opt)
            for param in model.parameters():
                param.grad /= kept
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            kept = 0
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale() if drop == "epoch" else None


def _train(scaler_kind, reuse_grad_buffers, overflow, queue, optimizer_cls=hivemind_accum.Optimizer, path=None,
           growth_interval=2000, unscale=False, call="scaler.step(opt)"):
    if path is not None:
        force_loss_scaling_path(path)
    model = make_model()
    dht = hivemind.DHT(start=True)
    opt = optimizer_cls(
        dht=dht, run_id="amp_drop", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        target_batch_size=MICRO_STEPS * BATCH, batch_size_per_step=BATCH, reuse_grad_buffers=reuse_grad_buffers,
        matchmaking_time=0.5, averaging_timeout=5, tracker_opts=SINGLE_PEER_TRACKER,
    )
    if scaler_kind == "hivemind_no_device":  # targets CUDA: disables itself on a machine without it
        scaler = hivemind.GradScaler() if not torch.cuda.is_available() else hivemind.GradScaler(enabled=False)
    else:
        scaler_cls = hivemind.GradScaler if scaler_kind == "hivemind" else torch.amp.GradScaler
        scaler = scaler_cls("cpu", init_scale=SCALE, growth_interval=growth_interval,
                            enabled=scaler_kind != "torch_disabled")
    torch_internals.check_torch_internals()  # the first use's checks of torch's private interfaces, not profiled below
    loaded = {}  # epoch -> (samples, micro-steps) when the accumulators are loaded into the averager
    load = opt.grad_averager.load_accumulators_into_averager_

    def recording_load():
        load()
        loaded[opt.local_epoch] = opt.grad_averager.local_samples_accumulated, opt.grad_averager.local_times_accumulated

    opt.grad_averager.load_accumulators_into_averager_ = recording_load
    host_reads, scales, in_epoch = [], [], 0
    try:
        for step, (x, y) in enumerate(make_batches(EPOCHS * MICRO_STEPS + (0 if reuse_grad_buffers else len(overflow)))):
            epoch = opt.local_epoch
            with without_cyclic_gc(), HostReads() as reads:  # the whole loop, as a user writes it
                if not reuse_grad_buffers:
                    opt.zero_grad()
                scaler.scale(loss_fn(model, x, y, step, overflow)).backward()
                if unscale:  # before clipping, say
                    scaler.unscale_(opt)
                if call == "opt.step(grad_scaler=scaler)" or scaler_kind == "torch_disabled":
                    opt.step(grad_scaler=scaler)
                else:
                    scaler.step(opt)
                if scaler_kind != "hivemind_no_device":  # update() of a disabled hivemind.GradScaler raises (the test)
                    scaler.update()
            if in_epoch + 1 < MICRO_STEPS:  # cannot be the end of an epoch: a no-sync step
                host_reads.append(reads.count)
            in_epoch = 0 if opt.local_epoch != epoch else in_epoch + 1
            scales.append(scaler.get_scale())
        send_by_value(queue, (opt.local_epoch, [p.detach().clone() for p in model.parameters()], loaded, host_reads,
                              scales))
    except Exception as e:
        send_by_value(queue, e)
    finally:
        opt.shutdown()
        dht.shutdown()


def train(scaler_kind: str, reuse_grad_buffers: bool, overflow=frozenset(), optimizer_cls=hivemind_accum.Optimizer,
          path=None, growth_interval=2000, unscale=False, call="scaler.step(opt)"):
    """train one peer in a fresh process; ``path`` forces add_finite_'s loss-scaling path (None: its own choice);
    ``unscale``: the loop calls ``scaler.unscale_(opt)`` after every backward; ``call``: how the loop steps. Returns
    the epoch reached, the parameters, the (samples, micro-steps) loaded per epoch, the host reads of each no-sync
    micro-step's whole loop (zero_grad to update) and the scale after each micro-step"""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=_train, args=(scaler_kind, reuse_grad_buffers, overflow, queue, optimizer_cls, path,
                                               growth_interval, unscale, call))
    process.start()
    result = receive_by_value(queue, timeout=120)
    process.join(timeout=60)
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.forked
@pytest.mark.parametrize(
    "overflow", [frozenset({2}), frozenset(range(MICRO_STEPS))], ids=["one_micro_step", "a_whole_epoch"]
)
def test_exact_mode_drops_only_the_overflowing_micro_steps(overflow):
    """torch.amp.GradScaler: each overflowing micro-step is dropped (including the first one of an epoch, and all of
    them); the dropped samples do not count toward the target batch size nor the averaging weight, so every epoch
    averages MICRO_STEPS kept micro-steps; the scale backs off at once. Both loss-scaling paths give bit-identical
    parameters; the device path (CUDA's) makes no host sync in any no-sync step, the host path (what CPU data gets)
    reads the overflow decision on the host, where it costs nothing"""
    runs = {path: train("torch", reuse_grad_buffers=False, overflow=overflow, path=path) for path in LOSS_SCALING_PATHS}
    expected, _ = native_reference(drop="micro_step", overflow=overflow)
    for path, (epoch, params, loaded, host_reads, scales) in runs.items():
        assert epoch == EPOCHS, path
        assert loaded == {epoch: (MICRO_STEPS * BATCH, MICRO_STEPS) for epoch in range(EPOCHS)}, path
        for ours, ref in zip(params, expected, strict=True):
            torch.testing.assert_close(ours, ref)
        assert scales[min(overflow)] == SCALE / 2 and scales[-1] == SCALE / 2 ** len(overflow), path  # backed off
        assert len(host_reads) >= EPOCHS * (MICRO_STEPS - 1), path
    for path in "device_check", "device_staging":
        for host, device in zip(runs["host_check"][1], runs[path][1], strict=True):
            torch.testing.assert_close(host, device, rtol=0, atol=0)
        assert runs[path][3] == [0] * len(runs[path][3]), path
    # the host path reads once per no-sync step, the decision and the unscale factor together: one .item(), where
    # upstream reads the overflow flag once
    assert runs["host_check"][3] == [1] * len(runs["host_check"][3])


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
@pytest.mark.parametrize("scaler_kind", ["torch_disabled", "hivemind_no_device"])
def test_disabled_grad_scaler_counts_as_none(scaler_kind, reuse_grad_buffers):
    """a disabled scaler (enabled=False, or hivemind.GradScaler() without a device on a machine without CUDA) trains
    exactly as no scaler, in both modes, whether passed to opt.step(grad_scaler=) or used as scaler.step(opt)"""
    if scaler_kind == "hivemind_no_device":
        if torch.cuda.is_available():
            assert hivemind.GradScaler().is_enabled()
        else:
            with pytest.warns(UserWarning, match="CUDA is not available.  Disabling"):
                scaler = hivemind.GradScaler()
            assert not scaler.is_enabled()
            with pytest.raises(AttributeError, match="_per_optimizer_states"):  # upstream 1.1.12, see docs/upstream.md
                scaler.update()
    epoch, params, *_ = train(scaler_kind, reuse_grad_buffers=reuse_grad_buffers)
    expected, _ = native_reference(drop="micro_step")
    assert epoch == EPOCHS
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)


@pytest.mark.forked
@pytest.mark.parametrize("path", LOSS_SCALING_PATHS)
def test_exact_mode_with_hivemind_grad_scaler_drops_only_the_overflowing_micro_steps(path):
    """hivemind.GradScaler in exact mode is handled as torch.amp.GradScaler is: each micro-step is unscaled as it is
    accumulated and an overflowing one is dropped, so the parameters match native accumulation of the kept micro-steps
    and the scale backs off at once"""
    overflow = frozenset({2})
    epoch, params, loaded, _, scales = train("hivemind", reuse_grad_buffers=False, overflow=overflow, path=path)
    expected, _ = native_reference(drop="micro_step", overflow=overflow)
    assert epoch == EPOCHS
    assert loaded == {epoch: (MICRO_STEPS * BATCH, MICRO_STEPS) for epoch in range(EPOCHS)}
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)
    assert scales[1] == SCALE and scales[2] == scales[-1] == SCALE / 2


@pytest.mark.forked
def test_exact_mode_grows_a_hivemind_grad_scalers_scale_after_global_steps_as_in_place_mode():
    """hivemind.GradScaler grows its scale only right after a global step (its update() skips the others): exact mode
    keeps that, micro-step for micro-step as upstream's in-place mode, and still trains like native accumulation"""
    exact = train("hivemind", reuse_grad_buffers=False, growth_interval=1)
    in_place_upstream = train("hivemind", reuse_grad_buffers=True, growth_interval=1, optimizer_cls=hivemind.Optimizer)
    expected, _ = native_reference(drop="micro_step")
    assert exact[0] == in_place_upstream[0] == EPOCHS
    assert exact[4] == in_place_upstream[4]
    assert exact[4][-1] == SCALE * 2**EPOCHS and exact[4][MICRO_STEPS - 2] == SCALE  # grew once per epoch, no more
    for ours, ref in zip(exact[1], expected, strict=True):
        torch.testing.assert_close(ours, ref)


@pytest.mark.forked
def test_hivemind_grad_scaler_unscale_in_exact_mode_is_a_clear_error():
    """between global steps hivemind.GradScaler.unscale_ only checks for inf/NaN: a loop that clips after it would
    clip gradients still multiplied by the loss scale"""
    with pytest.raises(ValueError, match=r"hivemind\.GradScaler\.unscale_\(opt\) was called.*torch\.amp\.GradScaler"):
        train("hivemind", reuse_grad_buffers=False, unscale=True)


@pytest.mark.forked
@pytest.mark.parametrize("call", ["scaler.step(opt)", "opt.step(grad_scaler=scaler)"])
def test_patched_hivemind_refuses_hivemind_grad_scaler_in_exact_mode_only(call):
    """way 3: a plain hivemind.Optimizer would step with scaled gradients in exact mode with hivemind.GradScaler (see
    the test below), so the patch refuses its first micro-step before anything is accumulated; in-place mode with it
    and exact mode with torch.amp.GradScaler (scaler.step(opt)) still train like native accumulation"""
    hivemind_accum.patch_hivemind()  # the peers train() forks inherit it
    # every fork first: a process forked after torch ran its intra-op thread pool here may deadlock
    runs = {drop: train(scaler_kind, reuse_grad_buffers, optimizer_cls=hivemind.Optimizer)
            for scaler_kind, reuse_grad_buffers, drop in (("hivemind", True, "epoch"), ("torch", False, "micro_step"))}
    for drop, (epoch, params, *_) in runs.items():
        expected, _ = native_reference(drop=drop)
        assert epoch == EPOCHS
        for ours, ref in zip(params, expected, strict=True):
            torch.testing.assert_close(ours, ref)
    model = make_model()
    dht = hivemind.DHT(start=True)  # after the forks above: a process forked while a DHT runs may deadlock
    opt = hivemind.Optimizer(
        dht=dht, run_id="patched_exact_scaler", params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=LR),
        target_batch_size=MICRO_STEPS * BATCH, batch_size_per_step=BATCH, tracker_opts=SINGLE_PEER_TRACKER,
    )
    try:
        scaler = hivemind.GradScaler("cpu", init_scale=SCALE)
        (x, y), = make_batches(1)
        scaler.scale(loss_fn(model, x, y, 0, ())).backward()
        with pytest.raises(ValueError, match=r"hivemind\.GradScaler with reuse_grad_buffers=False.*hivemind_accum\.Opt"):
            scaler.step(opt) if call == "scaler.step(opt)" else opt.step(grad_scaler=scaler)
        assert opt.grad_averager.local_times_accumulated == 0 and opt.local_epoch == 0
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.forked
@pytest.mark.xfail(strict=True, reason="upstream hivemind 1.1.12 with hivemind.GradScaler and reuse_grad_buffers=False "
                   "steps with gradients still multiplied by the loss scale")
def test_upstream_exact_mode_with_hivemind_grad_scaler_steps_with_scaled_gradients():
    epoch, params, *_ = train("hivemind", reuse_grad_buffers=False, optimizer_cls=hivemind.Optimizer)
    expected, _ = native_reference(drop="micro_step")
    assert epoch == EPOCHS
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)


@pytest.mark.forked
def test_in_place_mode_drops_the_overflowing_epoch_like_native():
    overflow = frozenset({2})
    epoch, params, loaded, host_reads, scales = train("hivemind", reuse_grad_buffers=True, overflow=overflow)
    expected, expected_scale = native_reference(drop="epoch", overflow=overflow)
    assert epoch == EPOCHS
    full = (MICRO_STEPS * BATCH, MICRO_STEPS)
    assert loaded == {0: (0, 0), 1: full, 2: full}  # the overflowing round was dropped before reaching the averager
    for ours, ref in zip(params, expected, strict=True):
        torch.testing.assert_close(ours, ref)
    assert scales[-1] == expected_scale == SCALE / 2
    assert host_reads == [0] * len(host_reads) and len(host_reads) == EPOCHS * (MICRO_STEPS - 1)


class ReadsOnTheHost(Exception):
    """a no-sync micro-step's loop read a tensor's value on the host (not an AssertionError: an xfail that expects
    this one fails on any other)"""


UPSTREAM_READS = pytest.mark.xfail(
    strict=True, raises=ReadsOnTheHost,
    reason="hivemind 1.1.12 reads the overflow flag on the host twice per no-sync micro-step: are_grads_finite and "
           "GradScaler.update",
)


@pytest.mark.forked
@pytest.mark.parametrize("call", ["scaler.step(opt)", "opt.step(grad_scaler=scaler)"])
@pytest.mark.parametrize("optimizer_cls, scaler_kind, reuse_grad_buffers", [
    (hivemind_accum.Optimizer, "torch", False),
    (hivemind_accum.Optimizer, "hivemind", False),
    (hivemind_accum.Optimizer, "hivemind", True),
    pytest.param(hivemind.Optimizer, "hivemind", False, marks=UPSTREAM_READS),
    pytest.param(hivemind.Optimizer, "hivemind", True, marks=UPSTREAM_READS),
], ids=["exact-torch", "exact-hivemind", "in_place-hivemind", "upstream-exact-hivemind", "upstream-in_place-hivemind"])
def test_amp_loop_reads_nothing_on_the_host_per_no_sync_micro_step(optimizer_cls, scaler_kind, reuse_grad_buffers,
                                                                    call):
    """the whole loop (zero_grad in exact mode, scale(loss).backward(), the step, update()) of every no-sync
    micro-step, an overflowing one included, with the loss-scaling path an accelerator takes (forced on the CPU): no
    host read; the scale still backs off after the overflow. hivemind 1.1.12 reads twice (pinned: the xfail expects
    exactly 2 per micro-step)"""
    overflow = frozenset({2})  # a no-sync micro-step of the first epoch
    epoch, _, _, host_reads, scales = train(scaler_kind, reuse_grad_buffers, overflow=overflow,
                                            optimizer_cls=optimizer_cls, path="device_check", call=call)
    if optimizer_cls is hivemind.Optimizer:  # whose epochs may run longer: an overflow resets in-place accumulation
        assert host_reads == [2] * len(host_reads) and len(host_reads) >= MICRO_STEPS - 1
    else:
        assert epoch == EPOCHS and len(host_reads) >= EPOCHS * (MICRO_STEPS - 1)
        assert scales[1] == SCALE and scales[-1] == SCALE / 2
        if not reuse_grad_buffers:  # in place the overflow is found, and the scale backs off, at the epoch's end
            assert scales[2] == SCALE / 2
    if any(host_reads):
        raise ReadsOnTheHost(f"host reads per no-sync micro-step: {host_reads}")


@pytest.mark.forked
def test_plain_torch_grad_scaler_in_place_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs hivemind\.GradScaler \(got torch\.amp\.grad_scaler\.GradScaler\)"):
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
        send_by_value(queue, (rank, opt.local_epoch, initial_loss, loss(), sum(averaged_rounds),
                              all(p.isfinite().all() for p in model.parameters())))
    except Exception as e:
        send_by_value(queue, e)
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
            results = [receive_by_value(queue, timeout=200) for _ in peers]
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


@NEEDS_CUDA
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


@pytest.mark.forked
def test_missing_grad_receives_averaged_gradient_in_parameter_dtype():
    """offload_optimizer=False with a bf16 model and averaged_grads_dtype=torch.float32: a parameter without .grad at
    the global step gets the float32 averaged gradient cast to bf16 (upstream assigns a float32 clone, which torch
    refuses)"""
    model = torch.nn.Linear(4, 3).bfloat16()
    dht = hivemind.DHT(start=True)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="missing_grad", optimizer=torch.optim.SGD(model.parameters(), lr=0.1), offload_optimizer=False,
        target_batch_size=8, batch_size_per_step=2, tracker_opts=SINGLE_PEER_TRACKER,
        grad_averager_factory=partial(GradientAverager, averaged_grads_dtype=torch.float32),
    )
    try:
        with opt.grad_averager.get_tensors() as averaged:
            for k, tensor in enumerate(averaged):
                assert tensor.dtype == torch.float32
                tensor.copy_(torch.full_like(tensor, 0.25 * (k + 1)))
        for param in model.parameters():
            param.grad = None
        opt._load_averaged_gradients_into_optimizer_()
        for k, param in enumerate(model.parameters()):
            assert param.grad.dtype == torch.bfloat16
            torch.testing.assert_close(param.grad, torch.full_like(param, 0.25 * (k + 1)))
    finally:
        opt.shutdown()
        dht.shutdown()


@pytest.mark.forked
@pytest.mark.parametrize("path", ["host_check", "device"])
def test_inv_grad_scale_of_any_float_dtype(dht, path):
    """accumulate_grads_ takes inv_grad_scale as float64 (or bfloat16) on both paths, with the float32 result"""
    force_loss_scaling_path(path)
    model = torch.nn.Linear(3, 2)
    averager = GradientAverager(model.parameters(), dht=dht, prefix=f"dtype_{path}", start=False)
    for dtype in (torch.float64, torch.bfloat16):
        model.zero_grad(set_to_none=True)  # the device path unscales .grad in place
        model(torch.ones(1, 3)).sum().mul(8.0).backward()
        found_inf = averager.accumulate_grads_(batch_size=1, inv_grad_scale=torch.tensor(0.125, dtype=dtype))
        assert found_inf.item() == 0.0
    torch.testing.assert_close(list(averager._grad_accumulators())[1], torch.full((2,), 2.0))


# ------------------------------------------------- mixed swarms: upstream and ours with bf16 parameters ---------------
def _bf16_peer_gradients(model: torch.nn.Module, peer: int, micro_step: int) -> None:
    generator = torch.Generator().manual_seed(10 * peer + micro_step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator).bfloat16()


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_bf16_peers_of_upstream_and_ours_average_together(reuse_grad_buffers):
    """by default the averaged buffers keep the parameters' dtype, as upstream's: an upstream peer and one of ours
    (float32 accumulators in exact mode) join the same round, and both end with the sample-weighted mean of the
    peers' gradients, within bf16 rounding"""
    batches = [[2, 2], [3, 3, 3]]
    with swarm(2) as dhts:
        models = [torch.nn.Linear(8, 6).bfloat16() for _ in range(2)]
        averagers = [
            UpstreamGradientAverager(models[0].parameters(), dht=dhts[0], prefix="mixed", target_group_size=2,
                                     reuse_grad_buffers=reuse_grad_buffers, start=True),
            GradientAverager(models[1].parameters(), dht=dhts[1], prefix="mixed", target_group_size=2,
                             reuse_grad_buffers=reuse_grad_buffers, start=True),
        ]
        with shutting_down(*averagers):
            assert averagers[0].schema_hash == averagers[1].schema_hash
            local = []
            for peer, (model, averager) in enumerate(zip(models, averagers)):
                total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
                for k, batch_size in enumerate(batches[peer]):
                    previous = [param.grad for param in model.parameters()]
                    _bf16_peer_gradients(model, peer, k)
                    for acc, param in zip(total, model.parameters()):
                        acc += param.grad.double()
                    if reuse_grad_buffers and peer == 0 and k > 0:  # upstream's in-place mode: .grad holds the sum
                        for param, old in zip(model.parameters(), previous):
                            param.grad = old + param.grad
                    averager.accumulate_grads_(batch_size=batch_size)
                local.append(total)
            controls = [averager.step(wait=False, timeout=30) for averager in averagers]
            for control in controls:
                assert control.result(timeout=60) is not None, "the peers did not average together"
            micro = [len(b) for b in batches]
            weights = [sum(b) for b in batches]
            expected = [(weights[0] * g0 / micro[0] + weights[1] * g1 / micro[1]) / sum(weights)
                        for g0, g1 in zip(*local)]
            for averager in averagers:
                with averager.get_tensors() as averaged:
                    for avg, exp in zip(averaged, expected, strict=True):
                        assert avg.dtype == torch.bfloat16
                        torch.testing.assert_close(avg.double(), exp, atol=2e-2, rtol=2e-2)


@pytest.mark.forked
@pytest.mark.parametrize("other", ["upstream", "ours"])
def test_fp32_averaged_grads_on_one_side_is_a_warning(tmp_path, other):
    """averaged_grads_dtype=torch.float32 on one peer only: the peers never average (BAD_SCHEMA_HASH); each peer of
    ours says so at WARNING level, once, naming averaged_grads_dtype (the warning is logged in the averager's own
    process: a file handler installed before they start sees it)"""
    log_file = tmp_path / "warnings.log"
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(process)d %(levelno)d %(message)s"))
    schema_logger = logging.getLogger(schema_mismatch.__name__)
    schema_logger.addHandler(handler)
    try:
        with swarm(2) as dhts:
            models = [torch.nn.Linear(8, 6).bfloat16() for _ in range(2)]
            first_cls = UpstreamGradientAverager if other == "upstream" else GradientAverager
            kwargs = dict(prefix="split", target_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5,
                          start=True)
            averagers = [
                first_cls(models[0].parameters(), dht=dhts[0], **kwargs),
                GradientAverager(models[1].parameters(), dht=dhts[1], averaged_grads_dtype=torch.float32, **kwargs),
            ]
            with shutting_down(*averagers):
                assert averagers[0].schema_hash != averagers[1].schema_hash
                for peer, (model, averager) in enumerate(zip(models, averagers)):
                    _bf16_peer_gradients(model, peer, 0)
                    averager.accumulate_grads_(batch_size=4)
                for _ in range(2):  # two rounds: each peer warns once only
                    controls = [averager.step(wait=False, timeout=4) for averager in averagers]
                    for control in controls:
                        with pytest.raises(Exception):
                            control.result(timeout=30)
                    for averager in averagers:
                        averager.reset_accumulated_grads_()
                        averager.accumulate_grads_(batch_size=4)
                ours = averagers if other == "ours" else averagers[1:]
                pids = {averager.pid for averager in ours}
    finally:
        schema_logger.removeHandler(handler)
        handler.close()
    lines = [line for line in log_file.read_text().splitlines() if "BAD_SCHEMA_HASH" in line]
    assert sorted(int(line.split()[0]) for line in lines) == sorted(pids), lines
    for line in lines:
        assert int(line.split()[1]) == logging.WARNING and "averaged_grads_dtype" in line, line


@pytest.mark.forked
def test_offloaded_optimizer_gets_float32_grads_from_bf16_averaged_buffers():
    """a bf16 model with the default offloaded optimizer: the averaged buffers are bf16 (as upstream's), the offloaded
    float32 parameters get float32 .grad of their own, filled from them when a round's result is loaded"""
    model = torch.nn.Linear(4, 3).bfloat16()
    dht = hivemind.DHT(start=True)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="offloaded_bf16", params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        target_batch_size=8, batch_size_per_step=2, tracker_opts=SINGLE_PEER_TRACKER,
    )
    try:
        offloaded = [param for group in opt.state_averager.optimizer.param_groups for param in group["params"]]
        with opt.grad_averager.get_tensors() as averaged:
            for k, (tensor, param) in enumerate(zip(averaged, offloaded, strict=True)):
                assert tensor.dtype == torch.bfloat16 and param.grad.dtype == torch.float32
                tensor.copy_(torch.full_like(tensor, 0.25 * (k + 1)))
        opt._load_gradients_into_optimizer_()
        for k, param in enumerate(offloaded):
            torch.testing.assert_close(param.grad, torch.full_like(param, 0.25 * (k + 1)))
    finally:
        opt.shutdown()
        dht.shutdown()
