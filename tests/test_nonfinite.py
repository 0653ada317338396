"""
One peer with non-finite gradients or parameters must not poison the swarm (issue 13).

Peers on loopback train one (8, 8) parameter with the linear loss ``sum(weight * direction)``, the same rank-1
direction on every peer, and SGD at lr 1: a healthy peer's every optimizer step moves its parameter by ``-direction``
(up to a float32 rounding bound, ``AVERAGED_ATOL`` and ``powersgd_atol``), whether its round averaged with healthy
peers, counted a bad one with weight 0 and zeros, or fell back to its own gradients (every healthy gradient is the
same). A bad peer multiplies its loss by NaN or inf (``BAD``), so its gradients are non-finite by construction, or
starts from NaN parameters; it must skip its optimizer step that epoch and never send inf/NaN to others. Upstream
hivemind 1.1.12 makes the healthy peer NaN at the first round (a strict expected failure).

The peers start together (a barrier), wait until their trackers see each other and then step at the same pace, so
that rounds have both peers. A peer with bad gradients that reaches an epoch waits (on shared memory, not the DHT)
until every peer that is not always bad has reached it, so that those never lag behind and never download its state.
The checks hold for any round outcome (averaged or failed; PowerSGD, which has no local fallback, gets timeouts long
enough that a slow peer delays a round instead of failing it); the tests also require that some round grouped a bad
peer with a healthy one, without which they would show nothing.
"""
import multiprocessing as mp
import time
import traceback
from functools import partial

import hivemind
import pytest
import torch

import hivemind_accum
from hivemind_accum.rounds.finite import RoundGuard, all_finite
from tests.conftest import receive_by_value, send_by_value, shutting_down, swarm, wait_for

EPOCHS, MICRO_STEPS, BATCH = 3, 3, 2  # epochs: at most, and by default; the two-peer NaN tests need two
STEP_SLEEP = 0.1
SHAPE = (8, 8)


def direction_factors():
    """(u, v) of direction() = u v^T"""
    generator = torch.Generator().manual_seed(13)
    return torch.randn(SHAPE[0], generator=generator), torch.randn(SHAPE[1], generator=generator)


def direction() -> torch.Tensor:
    """d(loss)/d(weight) of every healthy micro-step: rank 1, so that PowerSGD at rank 1 averages it exactly (up to
    float32 rounding, see powersgd_atol)"""
    return torch.outer(*direction_factors())


def initial_weight() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


EPS = torch.finfo(torch.float32).eps
# the largest entry of a healthy peer's parameter over every epoch the tests run (it moves by -direction each epoch)
WEIGHT_SCALE = max((initial_weight() - k * direction()).abs().max().item() for k in range(EPOCHS + 2))
# the float32 error of an averaged move (every entry of move + direction): at most 16 roundings (the load's sum and
# scale, the all-reduce's weighted sum, division and update of this peer's part, a parameter round, the SGD step and
# the move's subtraction), each within EPS / 2 of the larger of the largest gradient and parameter entry
AVERAGED_ATOL = 8 * EPS * max(direction().abs().max().item(), WEIGHT_SCALE)


def powersgd_atol(qs) -> float:
    """
    The float32 error of a move averaged by PowerSGD at rank 1 from the starting ``Q`` of its round (every entry of
    move + direction). With d = u v^T, P = d Q is exact up to 8 EPS |u| |v| |Q| (8 products per entry), so its
    direction is off by at most 8 EPS kappa, kappa = |v| |Q| / |v . Q|, and the rank-1 result P P^T d / |P|^2 by
    |d| times that. The load, the all-reduces, the normalization, Q = d^T P, the outer product and the SGD step add at
    most 30 EPS |d| and 2 EPS times the largest parameter entry. Q is random (``torch.rand``), so kappa is unbounded:
    the tolerance is computed from the Q the round started from.
    """
    (q,) = qs
    u, v = (factor.double() for factor in direction_factors())
    q = q.double().flatten()
    kappa = v.norm() * q.norm() / (v @ q).abs()
    return EPS * ((8 * kappa + 30) * u.norm() * v.norm() + 2 * WEIGHT_SCALE).item()


BAD = {"nan": float("nan"), "inf": float("inf")}


def test_all_finite():
    big = torch.full((4,), 3e38)  # finite, but its sum overflows to inf: checked again element by element
    assert all_finite([big, torch.ones(3, dtype=torch.float16), torch.arange(3), torch.empty(0)])
    for bad in float("nan"), float("inf"), -float("inf"):
        for dtype in torch.float32, torch.bfloat16, torch.float64:
            assert not all_finite([torch.ones(3), torch.tensor([1.0, bad], dtype=dtype)])
    assert not all_finite([torch.tensor([3e38, float("inf")])])


def test_round_guard_zeros_own_values_and_restores_them_after_a_nonfinite_result():
    guard = RoundGuard("values")
    own = [torch.tensor([1.0, float("nan")]), torch.tensor([2.0])]
    guard.snapshot(own)
    round_e, later = RoundKey(), [RoundKey() for _ in range(5)]  # a round's key: its control, alive while it runs
    assert not guard.offer_(own, round_key=round_e) and not guard.own_finite
    assert all(torch.equal(tensor, torch.zeros_like(tensor)) for tensor in own)  # sent as zeros (with weight 0)
    own[0].fill_(5.0)  # a finite average from the others is accepted
    assert guard.accept_(own) and torch.equal(own[0], torch.full((2,), 5.0))
    own[1].fill_(float("inf"))  # a non-finite one is not: the values from before the round come back
    assert not guard.accept_(own)
    torch.testing.assert_close(own[0], torch.tensor([1.0, float("nan")]), equal_nan=True)
    torch.testing.assert_close(own[1], torch.tensor([2.0]))
    for key in later:
        assert guard.offer_([torch.ones(2)], round_key=key) and guard.own_finite
    # each round's own record, however many rounds were offered since
    assert not guard.own_finite_in(round_e) and all(guard.own_finite_in(key) for key in later)
    assert guard.own_finite_in(None) and guard.own_finite_in(RoundKey())  # a round never offered: the latest offer's


class RoundKey:
    """stands for a round's control handle: hashed by identity, and weakly referenced by RoundGuard"""


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_averager_loads_nonfinite_gradients_as_zeros_with_weight_zero(dht, reuse_grad_buffers):
    """the check runs once, when the accumulators are loaded; the kept fallback is the zeros, and the next round's
    finite gradients are offered again"""
    model = torch.nn.Linear(3, 2)
    averager = hivemind_accum.GradientAverager(
        model.parameters(), dht=dht, prefix="nonfinite", reuse_grad_buffers=reuse_grad_buffers, start=False
    )
    with shutting_down(averager):
        for scale in 1.0, float("nan"):
            if not reuse_grad_buffers:
                model.zero_grad()
            (scale * model(torch.ones(1, 3))).sum().backward()
            averager.accumulate_grads_(batch_size=2)
        averager.load_accumulators_into_averager_()
        assert not averager.round_guard.own_finite and averager.local_samples_accumulated == 0  # step()'s weight
        with averager.get_tensors() as averaged:
            assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in averaged)
        averager.reset_accumulated_grads_()
        if not reuse_grad_buffers:
            model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        averager.accumulate_grads_(batch_size=2)
        averager.load_accumulators_into_averager_()
        assert averager.round_guard.own_finite and averager.local_samples_accumulated == 2
        with averager.get_tensors() as (weight_grad, bias_grad):
            torch.testing.assert_close(weight_grad, torch.ones(2, 3))
            torch.testing.assert_close(bias_grad, torch.ones(2))


@pytest.mark.forked
def test_powersgd_never_enters_a_round_with_nonfinite_error_feedback_or_q(dht):
    """a round that failed between PowerSGD's two phases leaves Q = M^T P with a 0 / 0 P, and P = M Q of a peer with
    weight 0 would still be NaN in the next round: loading the next round's gradients resets the poisoned pair first,
    and leaves finite ones alone"""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    averager = hivemind_accum.PowerSGDGradientAverager(
        model.parameters(), averager_rank=1, dht=dht, prefix="nonfinite_powersgd", start=False
    )
    with shutting_down(averager):
        with averager.get_tensors():
            averager._qs[0].fill_(float("nan"))  # what the failed round left
            averager._ms[0].fill_(1.0)
            averager._ms[1].fill_(2.0)
        healthy_q = averager._qs[1].clone()
        model(torch.ones(1, 4)).sum().backward()
        averager.accumulate_grads_(batch_size=1)
        averager.load_accumulators_into_averager_()
        assert averager.round_guard.own_finite and averager.local_samples_accumulated == 1
        with averager.get_tensors():
            assert torch.equal(averager._ms[0], torch.zeros(4, 4)) and torch.isfinite(averager._qs[0]).all()
            assert torch.equal(averager._ms[1], torch.full((4, 4), 2.0)) and torch.equal(averager._qs[1], healthy_q)


@pytest.mark.forked
@pytest.mark.parametrize("reuse_grad_buffers", [False, True])
def test_powersgd_round_with_weight_zero_leaves_error_feedback_as_it_was(reuse_grad_buffers):
    """A joins round 1 with weight 0 for its NaN gradients and round 2 with weight 0 given explicitly (as hivemind's
    tag-along rounds do), its buffers finite: every round gives B's gradients. PowerSGD's round adds a peer's buffers
    into its error feedback and subtracts the group's result, also with weight 0: round 2, then round 3, gave half
    (or 1.5 times) the gradient"""
    torch.manual_seed(0)  # each averager draws its starting Q with torch.rand
    with swarm(2) as dhts:
        models = [torch.nn.Linear(*SHAPE, bias=False) for _ in dhts]
        averagers = [
            hivemind_accum.PowerSGDGradientAverager(
                model.parameters(), averager_rank=1, dht=node, prefix="nonfinite_powersgd_rounds",
                target_group_size=2, reuse_grad_buffers=reuse_grad_buffers, start=True,
            )
            for model, node in zip(models, dhts)
        ]
        with shutting_down(*averagers):
            # A's gradient scale, A's weight (None: the default), both expected weights
            for a_scale, a_weight, expected_weights in (float("nan"), None, [0, 2]), (1.0, 0, [0, 2]), (1.0, None, [2, 2]):
                for model, averager, scale in zip(models, averagers, (a_scale, 1.0)):
                    model.weight.grad = direction() * scale
                    averager.accumulate_grads_(batch_size=2)
                with averagers[1].get_tensors():  # B's Q: the only one with weight in both phases of either round
                    atol = powersgd_atol([q.clone() for q in averagers[1]._qs])
                controls = [averager.schedule_step(hivemind.utils.get_dht_time() + 3) for averager in averagers]
                for averager, control, weight in zip(averagers, controls, (a_weight, None)):
                    averager.step(weight=weight, control=control, wait=False)
                for control in controls:
                    control.result(timeout=30)
                assert [control.weight for control in controls] == expected_weights
                for averager in averagers:
                    with averager.get_tensors() as (weight_grad,):
                        torch.testing.assert_close(weight_grad, direction(), rtol=0, atol=atol)
                    averager.notify_used_averaged_gradients()


@pytest.mark.forked
def test_state_averager_does_not_share_a_nonfinite_state(dht):
    params = [torch.nn.Parameter(torch.ones(3))]
    averager = hivemind_accum.integration.state_averager.TrainingStateAverager(
        dht=dht, prefix="nonfinite_state", optimizer=partial(torch.optim.SGD, lr=1.0), params=params, start=True
    )
    with shutting_down(averager):
        assert torch.equal(averager.get_current_state()[1][0], torch.ones(3))
        with torch.no_grad():
            params[0][1] = float("nan")
        with pytest.raises(RuntimeError, match="inf or NaN"):
            averager.get_current_state()


def _peer(rank, num_peers, epochs, config, initial_peers, conn, barrier, reached, leaders):
    dht = opt = None
    try:
        weight = torch.nn.Parameter(initial_weight())
        if config.get("nan_params"):
            weight.data.fill_(float("nan"))
        dht = hivemind.DHT(start=True, initial_peers=initial_peers)
        if rank == 0:
            send_by_value(conn, ("maddrs", [str(maddr) for maddr in dht.get_visible_maddrs()]))
        optimizer_cls = hivemind.Optimizer if config.get("upstream") else hivemind_accum.Optimizer
        opt = optimizer_cls(
            dht=dht, run_id="nonfinite", params=[weight], optimizer=partial(torch.optim.SGD, lr=1.0),
            target_batch_size=num_peers * MICRO_STEPS * BATCH, batch_size_per_step=BATCH,
            **{"matchmaking_time": 1.0, "averaging_timeout": 5.0, **config.get("opt_kwargs", {})},
        )
        rounds = []  # (epoch, control) of every gradient round this peer began
        averager_step = opt.grad_averager.step

        def recording_step(*args, **kwargs):
            epoch = opt.local_epoch
            control = averager_step(*args, **kwargs)
            rounds.append((epoch, control))
            return control

        opt.grad_averager.step = recording_step
        qs = {}  # PowerSGD: by epoch, the Q matrices its round started from (after any reset)
        load_accumulators = opt.grad_averager.load_accumulators_into_averager_

        def recording_load_accumulators():
            load_accumulators()
            if hasattr(opt.grad_averager, "_qs"):
                with opt.grad_averager.get_tensors():
                    qs.setdefault(opt.local_epoch, [q.clone() for q in opt.grad_averager._qs])

        opt.grad_averager.load_accumulators_into_averager_ = recording_load_accumulators
        downloads = []
        load_state = opt.load_state_from_peers

        def recording_load_state(*args, **kwargs):
            downloads.append(opt.local_epoch)
            return load_state(*args, **kwargs)

        opt.load_state_from_peers = recording_load_state

        d = direction()
        barrier.wait(timeout=60)
        transitions, micro_step = [], 0
        deadline = time.monotonic() + 100
        while opt.local_epoch < epochs:
            assert time.monotonic() < deadline, f"peer {rank} stuck at epoch {opt.local_epoch}"
            epoch, before = opt.local_epoch, weight.detach().clone()
            if not config.get("opt_kwargs", {}).get("reuse_grad_buffers"):
                opt.zero_grad()
            loss = (weight * d).sum()
            bad = config.get("bad", {}).get(epoch)
            if bad is not None:
                loss = loss * BAD[bad]
            if config.get("nan_params"):  # finite gradients once the parameters are finite, NaN before
                loss = loss + 0 * (weight * weight).sum()
            loss.backward()
            opt.step()
            micro_step += 1
            if micro_step == 1:  # wait until this peer's tracker sees every peer, then start together
                while opt.tracker.global_progress.num_peers < num_peers:
                    assert time.monotonic() < deadline, f"peer {rank} sees {opt.tracker.global_progress.num_peers}"
                    time.sleep(0.1)
                barrier.wait(timeout=60)
            if opt.local_epoch != epoch:
                transitions.append((epoch, weight.detach() - before, weight.detach().clone()))
                reached[rank] = opt.local_epoch
                if config.get("bad") or config.get("nan_params"):  # the peers that are not always bad go first
                    epoch_now = opt.local_epoch
                    wait_for(lambda: all(reached[leader] >= epoch_now for leader in leaders if leader != rank),
                             timeout=max(0.0, deadline - time.monotonic()), what=f"peer {rank}'s leaders {leaders}")
            time.sleep(STEP_SLEEP)
        opt.state_averager.step(wait_for_delayed_updates=True)  # apply delayed optimizer steps and averaging
        outcomes = {}
        for epoch, control in rounds:
            control.exception(timeout=30)
            ok = control.done() and not control.cancelled() and control.exception() is None
            outcomes[epoch] = dict(weight=control.weight, group=len(control.result()) if ok else 0)
        send_by_value(conn, ("done", dict(
            epoch=opt.local_epoch, transitions=transitions, final=weight.detach().clone(), rounds=outcomes,
            downloads=downloads, qs=qs,
        )))
    except BaseException:
        send_by_value(conn, ("error", traceback.format_exc()))
        raise
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


ALWAYS_NAN = {"bad": {epoch: "nan" for epoch in range(EPOCHS + 2)}}


def always_bad(config) -> bool:
    return bool(config.get("nan_params")) or config.get("bad") == ALWAYS_NAN["bad"]


def run_swarm(configs, epochs=EPOCHS):
    """run one peer per config (rank 0 first: the others join its DHT); return each peer's report"""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(configs))
    reached = ctx.Array("i", len(configs))  # each peer's local epoch, written after each of its transitions
    leaders = [rank for rank, config in enumerate(configs) if not always_bad(config)]  # the others wait for them
    conns, processes, maddrs = [], [], None
    try:
        for rank, config in enumerate(configs):
            reader, writer = ctx.Pipe(duplex=False)
            initial_peers = None if rank == 0 else maddrs
            process = ctx.Process(
                target=_peer,
                args=(rank, len(configs), epochs, config, initial_peers, writer, barrier, reached, leaders),
            )
            process.start()
            writer.close()
            conns.append(reader)
            processes.append(process)
            if rank == 0:
                assert reader.poll(60), "peer 0 did not start"
                kind, maddrs = receive_by_value(reader)
                assert kind == "maddrs", maddrs
        reports = []
        for rank, conn in enumerate(conns):
            assert conn.poll(150), f"peer {rank} did not report"
            kind, payload = receive_by_value(conn)
            assert kind == "done", f"peer {rank} failed:\n{payload}"
            reports.append(payload)
        return reports
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def move_atol(report, epoch: int) -> float:
    """the float32 error bound of the peer's move in ``epoch``: PowerSGD's from its round's Q, else AVERAGED_ATOL"""
    return powersgd_atol(report["qs"][epoch]) if report["qs"] else AVERAGED_ATOL


def assert_stepped_every_epoch(report, skipped=(), per_epoch=True, epochs=EPOCHS):
    """every epoch moved the parameter by -direction up to float32 rounding (or, for ``skipped`` epochs, not at all),
    and it stayed finite; with delayed optimizer steps the move shows up later, so only the final parameter is
    checked, within the sum of the epochs' bounds"""
    d = direction()
    assert report["epoch"] >= epochs and not report["downloads"], report
    for epoch, move, weight in report["transitions"]:
        assert torch.isfinite(weight).all(), f"epoch {epoch}: parameters not finite"
        if per_epoch and epoch in skipped:
            torch.testing.assert_close(move, torch.zeros_like(d), rtol=0, atol=0, msg=f"epoch {epoch}")
        elif per_epoch:
            atol = move_atol(report, epoch)
            message = f"epoch {epoch}, atol {atol:.2e}"
            torch.testing.assert_close(move, -d, rtol=0, atol=atol, msg=lambda detail: f"{message}: {detail}")
    stepped = [epoch for epoch in range(report["epoch"]) if epoch not in skipped]
    atol = sum(move_atol(report, epoch) for epoch in stepped)
    torch.testing.assert_close(report["final"], initial_weight() - len(stepped) * d, rtol=0, atol=atol)


def assert_some_round_grouped(report, epochs=None):
    """the scenario made at least one round (of the given epochs) average with another peer"""
    groups = [outcome["group"] for epoch, outcome in report["rounds"].items() if epochs is None or epoch in epochs]
    assert any(group >= 2 for group in groups), f"no averaging round had two peers: {report['rounds']}"


def assert_took_a_healthy_state(report):
    """a parameter that is finite and one of the healthy trajectory's points (its own or one taken from a peer)"""
    d, final = direction(), report["final"]
    assert torch.isfinite(final).all()
    points = [initial_weight() - k * d for k in range(EPOCHS + 2)]
    # after k steps and a parameter averaging round (or a download) a point is within (k + 1) moves' bound
    atols = [(k + 1) * AVERAGED_ATOL for k in range(len(points))]
    assert any(torch.allclose(final, point, rtol=0, atol=atol) for point, atol in zip(points, atols)), final


@pytest.mark.forked
@pytest.mark.parametrize(
    "reuse_grad_buffers, average_state_every, bad_peer",
    [(False, 10**6, "guarded"), (True, 1, "guarded"), (True, 1, "upstream")],
)
def test_peer_with_nan_gradients_does_not_poison_the_other(reuse_grad_buffers, average_state_every, bad_peer):
    """B's gradients are NaN at every micro-step: A moves by its own gradient every epoch, with parameter averaging off
    (exact mode) and on (in-place mode: B, which skips its steps, joins state rounds with weight 0). A B that runs
    upstream's optimizer sends its NaN gradients with its weight, then (after stepping with them) NaN parameters: A
    finds both averages non-finite and falls back to its own gradients and parameters"""
    healthy = dict(opt_kwargs=dict(reuse_grad_buffers=reuse_grad_buffers, average_state_every=average_state_every))
    bad = dict(healthy, upstream=bad_peer == "upstream", **ALWAYS_NAN)
    a, b = run_swarm([healthy, bad], epochs=2)
    assert_stepped_every_epoch(a, epochs=2)
    assert_some_round_grouped(a)
    if bad_peer == "upstream":
        assert any(outcome["weight"] > 0 for outcome in b["rounds"].values()), b["rounds"]
        assert not torch.isfinite(b["final"]).any()  # what A would have become
        return
    assert all(outcome["weight"] == 0 for outcome in b["rounds"].values()), b["rounds"]
    if average_state_every == 1:
        assert_took_a_healthy_state(b)
    else:  # B skipped every step and never averaged parameters: exactly where it started
        torch.testing.assert_close(b["final"], initial_weight(), rtol=0, atol=0)


@pytest.mark.forked
def test_peer_with_nan_parameters_is_not_averaged_in_and_recovers():
    """B starts with NaN parameters (so its gradients are NaN too), with delay_grad_averaging and parameter averaging
    every epoch: it never sends them, takes A's parameters, and A moves by its own gradient every epoch"""
    opt_kwargs = dict(delay_grad_averaging=True, delay_optimizer_step=True, average_state_every=1)
    a, b = run_swarm([dict(opt_kwargs=opt_kwargs), dict(opt_kwargs=opt_kwargs, nan_params=True)])
    assert_stepped_every_epoch(a, per_epoch=False)
    assert_some_round_grouped(a)
    assert_took_a_healthy_state(b)


@pytest.mark.forked
def test_one_inf_epoch_among_three_peers():
    """C's gradients are inf in epoch 1 only: A (exact mode) and B (in place) average with each other (C with weight
    0) or fall back; C skips that step and rejoins with its weight the next epoch; all stay finite"""
    exact, in_place = dict(opt_kwargs=dict(average_state_every=10**6)), dict(
        opt_kwargs=dict(reuse_grad_buffers=True, average_state_every=10**6)
    )
    a, b, c = run_swarm([exact, in_place, dict(exact, bad={1: "inf"})])
    for healthy in a, b:
        assert_stepped_every_epoch(healthy)
    assert_stepped_every_epoch(c, skipped={1})
    assert_some_round_grouped(a, epochs={1})
    assert c["rounds"][1]["weight"] == 0 and c["rounds"][2]["weight"] > 0, c["rounds"]


@pytest.mark.forked
def test_powersgd_recovers_from_a_round_of_weight_zero_peers():
    """PowerSGD (rank 1, in place): B's gradients are NaN every epoch and A's in epoch 1: that round's members all have
    weight 0, its average is 0 / 0 = NaN and reaches the error-feedback buffers; A skips that step, resets them and
    moves by its own gradient again from epoch 2 (without the reset it would stay stuck)"""
    opt_kwargs = dict(
        reuse_grad_buffers=True, average_state_every=10**6,
        grad_averager_factory=partial(hivemind_accum.PowerSGDGradientAverager, averager_rank=1),
        # no local fallback for PowerSGD, so every round must complete: a slow peer delays a round and does not fail it
        averaging_timeout=60.0, next_chunk_timeout=30.0,
    )
    torch.manual_seed(0)  # each peer draws its starting Q with torch.rand (forked: from this state)
    a, b = run_swarm([dict(opt_kwargs=opt_kwargs, bad={1: "nan"}), dict(opt_kwargs=opt_kwargs, **ALWAYS_NAN)])
    assert_stepped_every_epoch(a, skipped={1})
    assert_some_round_grouped(a, epochs={0, 2})
    assert_some_round_grouped(a, epochs={1})


@pytest.mark.forked
@pytest.mark.xfail(strict=True, reason="upstream hivemind 1.1.12 averages a peer's NaN gradients into everyone's")
def test_upstream_peer_with_nan_gradients_poisons_the_other():
    healthy = dict(upstream=True, opt_kwargs=dict(average_state_every=10**6))
    a, _ = run_swarm([healthy, dict(healthy, **ALWAYS_NAN)], epochs=2)
    assert_stepped_every_epoch(a, epochs=2)
