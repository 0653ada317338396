"""Mixed precision in in-place mode: accumulated gradients are unscaled exactly once per epoch."""
import multiprocessing as mp

import hivemind
import pytest
import torch
import torch.nn.functional as F

import hivemind_accum
from tests.conftest import SINGLE_PEER_TRACKER, receive_by_value, send_by_value

MICRO_STEPS, BATCH, EPOCHS, LR, SCALE = 4, 2, 3, 0.5, 2.0**10


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(MICRO_STEPS * EPOCHS)]


def forward_loss(model, x, y, autocast_dtype):
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        return F.cross_entropy(model(x).float(), y)


def native_reference(autocast_dtype=None):
    """native accumulation with a plain scaler: K scaled backwards of loss / K, one unscale and step per epoch"""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for i, (x, y) in enumerate(batches()):
        scaler.scale(forward_loss(model, x, y, autocast_dtype) / MICRO_STEPS).backward()
        if (i + 1) % MICRO_STEPS == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _hivemind_run(scaler_kind: str, autocast_dtype, queue):
    model = make_model()
    dht = hivemind.DHT(start=True)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="amp", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        target_batch_size=MICRO_STEPS * BATCH, batch_size_per_step=BATCH, reuse_grad_buffers=True,
        matchmaking_time=0.5, averaging_timeout=5, tracker_opts=SINGLE_PEER_TRACKER,
    )
    if scaler_kind == "hivemind":
        scaler = hivemind.GradScaler("cpu", init_scale=SCALE)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    try:
        for x, y in batches():
            # the AMP recipe's loop, unscaling on every optimizer call (clipping the running sum would be refused:
            # tests/test_in_place_edits.py)
            scaler.scale(forward_loss(model, x, y, autocast_dtype)).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        send_by_value(queue, (opt.local_epoch, [p.detach().clone() for p in model.parameters()]))
    except Exception as e:
        send_by_value(queue, e)
    finally:
        opt.shutdown()
        dht.shutdown()


def hivemind_run(scaler_kind: str, autocast_dtype=None):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=_hivemind_run, args=(scaler_kind, autocast_dtype, queue))
    process.start()
    result = receive_by_value(queue, timeout=120)
    process.join(timeout=60)
    return result


@pytest.mark.forked
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_in_place_with_hivemind_grad_scaler_unscales_once_per_epoch(autocast_dtype):
    """regression test for the report that reuse_grad_buffers=True with AMP could unscale the same accumulated
    buffer more than once: a loop calling unscale_ on every micro-step, under CPU autocast, still trains like native
    accumulation of the unscaled gradients"""
    epoch, params = hivemind_run("hivemind", autocast_dtype)
    assert epoch == EPOCHS
    expected = native_reference(autocast_dtype)
    initial = list(make_model().parameters())
    for ours, ref, start in zip(params, expected, initial, strict=True):
        torch.testing.assert_close(ours, ref)
        assert (ours - start).abs().max() > 1e-3


@pytest.mark.forked
def test_in_place_with_plain_torch_grad_scaler_is_a_clear_error():
    error = hivemind_run("torch")
    assert isinstance(error, ValueError) and "hivemind.GradScaler" in str(error)
