"""In-place mode refuses an in-place edit of .grad between micro-steps; exact mode and native accumulation as oracles."""
import multiprocessing as mp

import hivemind
import pytest
import torch
import torch.nn.functional as F

import hivemind_accum
from hivemind_accum import GradientAverager
from tests.conftest import SINGLE_PEER_TRACKER, receive_by_value, send_by_value

MICRO_STEPS, BATCH, EPOCHS, LR, SCALE, MAX_NORM = 3, 4, 2, 0.5, 2.0**8, 0.1
EDIT_ERROR = r"of (parameters\[0\], parameters\[1\], parameters\[2\] and 1 more|parameters\[0\] \(shape \(8, 6\)\)) was " \
    r"edited in place.*reuse_grad_buffers=False"


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(count=MICRO_STEPS * EPOCHS):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(count)]


def clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def halve_first_weight(model):
    model[0].weight.grad.mul_(0.5)


def edited_micro_batch_grads(edit):
    """each micro-batch's gradient alone, edited: what every micro-step should contribute"""
    model, grads = make_model(), []
    for x, y in batches():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if edit is not None:
            edit(model)
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def reference_params(edit):
    """plain SGD on the mean of the edited micro-batch gradients, one step per MICRO_STEPS micro-batches"""
    model = make_model()
    params = [p.detach().clone() for p in model.parameters()]
    for epoch in range(EPOCHS):
        with torch.no_grad():
            for p, value in zip(model.parameters(), params):
                p.copy_(value)
        model_grads = []
        for x, y in batches()[epoch * MICRO_STEPS:(epoch + 1) * MICRO_STEPS]:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if edit is not None:
                edit(model)
            model_grads.append([p.grad.clone() for p in model.parameters()])
        params = [p - LR * torch.stack(g).mean(0) for p, *g in zip(params, *model_grads)]
    return params


# ---- through GradientAverager ----


@pytest.mark.forked
@pytest.mark.parametrize("edit", ["clip_grad_norm_", "mul_", "zero_grad(False)"])
def test_in_place_edit_between_micro_steps_is_a_clear_error(dht, edit):
    model = make_model()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="edit", reuse_grad_buffers=True, start=False)
    edits = {
        "clip_grad_norm_": lambda: clip(model),
        "mul_": lambda: halve_first_weight(model),
        "zero_grad(False)": lambda: model.zero_grad(set_to_none=False),
    }
    (x0, y0), (x1, y1) = batches(2)
    F.cross_entropy(model(x0), y0).backward()
    edits[edit]()  # the views held nothing before this backward: the edit is this micro-batch's own
    averager.accumulate_grads_(BATCH)
    F.cross_entropy(model(x1), y1).backward()
    edits[edit]()  # now it edits the sum of both micro-steps
    with pytest.raises(ValueError, match=EDIT_ERROR):
        averager.accumulate_grads_(BATCH)
    with pytest.raises(ValueError, match=EDIT_ERROR):  # also when the round is loaded
        averager.load_accumulators_into_averager_()


@pytest.mark.forked
@pytest.mark.parametrize("zero_grad", ["before_backward", "after_step"])
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_clipping_each_micro_batch_with_zero_grad_every_step(dht, zero_grad, reuse_grad_buffers):
    """with zero_grad every micro-step each .grad is the micro-batch's own gradient, in both modes: clipping it is
    right, and the round holds the mean of the clipped micro-batch gradients"""
    model = make_model()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="clip", reuse_grad_buffers=reuse_grad_buffers,
                                start=False)
    for x, y in batches()[:MICRO_STEPS]:
        if zero_grad == "before_backward":
            model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        clip(model)
        averager.accumulate_grads_(BATCH)
        if zero_grad == "after_step":
            model.zero_grad(set_to_none=True)
    averager.load_accumulators_into_averager_()
    expected = edited_micro_batch_grads(clip)[:MICRO_STEPS]
    with averager.get_tensors() as averaged:
        for avg, *grads in zip(averaged, *expected, strict=True):
            torch.testing.assert_close(avg, torch.stack(grads).mean(0))


@pytest.mark.forked
def test_in_place_reset_and_create_graph_are_not_edits(dht):
    """the averager's own zeroing, and .grad replaced out of place by backward(create_graph=True), pass; an edit
    under create_graph touches the micro-step's own gradient and is right"""
    model = make_model()
    averager = GradientAverager(model.parameters(), dht=dht, prefix="own", reuse_grad_buffers=True, start=False)
    for epoch in range(2):
        for x, y in batches()[epoch * MICRO_STEPS:(epoch + 1) * MICRO_STEPS]:
            F.cross_entropy(model(x), y).backward(create_graph=epoch == 1)
            if epoch == 1:
                clip(model)
            averager.accumulate_grads_(BATCH)
        averager.load_accumulators_into_averager_()
        expected = edited_micro_batch_grads(clip if epoch == 1 else None)[epoch * MICRO_STEPS:(epoch + 1) * MICRO_STEPS]
        with averager.get_tensors() as averaged:
            for avg, *grads in zip(averaged, *expected, strict=True):
                torch.testing.assert_close(avg, torch.stack(grads).mean(0))
        averager.reset_accumulated_grads_()
    for param in model.parameters():
        param.grad = None  # drop the graph kept by create_graph


# ---- through hivemind_accum.Optimizer ----

def _train(reuse_grad_buffers, edit, zero_grad, scaler_kind, create_graph, queue):
    model = make_model()
    dht = hivemind.DHT(start=True)
    opt = hivemind_accum.Optimizer(
        dht=dht, run_id="edits", params=model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        target_batch_size=MICRO_STEPS * BATCH, batch_size_per_step=BATCH, reuse_grad_buffers=reuse_grad_buffers,
        matchmaking_time=0.5, averaging_timeout=5, verbose=False, tracker_opts=SINGLE_PEER_TRACKER,
    )
    scaler = dict(hivemind=hivemind.GradScaler, torch=torch.amp.GradScaler).get(scaler_kind)
    scaler = scaler and scaler("cpu", init_scale=SCALE)
    step = 0
    try:
        for step, (x, y) in enumerate(batches()):
            if zero_grad:
                opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward(create_graph=create_graph)
            if scaler:
                scaler.unscale_(opt)
            if edit == "clip":
                clip(model)
            elif edit == "mul":
                halve_first_weight(model)
            if scaler:
                scaler.step(opt)
            else:
                opt.step()
            if scaler:
                scaler.update()
        for param in model.parameters():
            param.grad = None  # drop any graph kept by create_graph before the parameters are sent
        send_by_value(queue, (opt.local_epoch, [p.detach().clone() for p in model.parameters()]))
    except ValueError as e:
        send_by_value(queue, (step, str(e)))
    finally:
        opt.shutdown()
        dht.shutdown()


def train(reuse_grad_buffers, edit=None, zero_grad=False, scaler=None, create_graph=False):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    process = ctx.Process(target=_train, args=(reuse_grad_buffers, edit, zero_grad, scaler, create_graph, queue))
    process.start()
    result = receive_by_value(queue, timeout=120)
    process.join(timeout=60)
    return result


EDITS = {"clip": clip, "mul": halve_first_weight, None: None}


@pytest.mark.forked
@pytest.mark.parametrize("edit, scaler", [("clip", None), ("mul", None), ("clip", "hivemind")])
def test_optimizer_in_place_refuses_an_edit_and_exact_mode_applies_it_per_micro_batch(edit, scaler):
    step, message = train(True, edit, scaler=scaler)
    assert step == 1, message  # the first micro-step's views held nothing before its backward
    assert "edited in place" in message and "reuse_grad_buffers=False" in message
    if scaler is None:  # exact mode refuses hivemind.GradScaler.unscale_ (it leaves gradients scaled there)
        epoch, params = train(False, edit, zero_grad=True)
        assert epoch == EPOCHS
        for ours, ref in zip(params, reference_params(EDITS[edit]), strict=True):
            torch.testing.assert_close(ours, ref)


@pytest.mark.forked
def test_optimizer_plain_torch_grad_scaler_unscale_is_refused_in_place_and_right_in_exact_mode():
    """torch.amp.GradScaler.unscale_ divides the running sum at every micro-step: refused at the first step"""
    step, message = train(True, scaler="torch")
    assert step == 0 and "hivemind.GradScaler" in message and "reuse_grad_buffers=False" in message
    epoch, params = train(False, zero_grad=True, scaler="torch")
    assert epoch == EPOCHS
    for ours, ref in zip(params, reference_params(None), strict=True):
        torch.testing.assert_close(ours, ref)


@pytest.mark.forked
@pytest.mark.parametrize("edit, zero_grad, scaler, create_graph", [
    ("clip", True, None, False),  # zero_grad every micro-step: .grad is the micro-batch's own gradient
    (None, False, None, True),  # create_graph: autograd replaces .grad out of place
    ("clip", False, None, True),  # ... so the edit touches the micro-step's own gradient
    (None, False, "hivemind", False),  # hivemind.GradScaler's own writes: unscale_ every micro-step, once per round
], ids=["zero_grad_clip", "create_graph", "create_graph_clip", "hivemind_scaler"])
def test_optimizer_in_place_passes_without_edits_of_the_running_sum(edit, zero_grad, scaler, create_graph):
    epoch, params = train(True, edit, zero_grad=zero_grad, scaler=scaler, create_graph=create_graph)
    assert epoch == EPOCHS
    for ours, ref in zip(params, reference_params(EDITS[edit]), strict=True):
        torch.testing.assert_close(ours, ref)
