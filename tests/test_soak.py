"""
Soak test (issue 6): a swarm of ``hivemind_accum.Optimizer`` peers on loopback, with one peer killed and one joining
mid-run and random gradient averaging failures injected; every epoch's parameter update is checked against what the
averaging round should have produced.

How to run (the epoch count is the only knob)::

    .venv/bin/python -m pytest tests/test_soak.py                                 # short version (8 epochs), in CI
    HIVEMIND_ACCUM_SOAK_EPOCHS=24 .venv/bin/python -m pytest tests/test_soak.py   # long version, on demand

The scenario: peers 0-3 start together; peer 3 SIGKILLs its whole process group (Python process, DHT, averagers, p2pd)
right after entering epoch ``max(2, EPOCHS // 4)``; peer 4 (its DHT and optimizer created in advance) starts training
once the swarm reaches epoch ``max(3, EPOCHS // 3)``, and downloads the state first. Odd peers accumulate in place
(``reuse_grad_buffers=True``), even ones in the exact mode, with different batch sizes, so sample weighting matters.
The loss is linear, ``sum(param * direction)``, with a pseudo-random direction per (peer, micro-step): every gradient
is known, and with plain SGD at lr 1 and no parameter averaging an epoch's move is exactly minus the gradient that the
optimizer used.

Injected failures: a seeded random subset of (peer, epoch) rounds fails, in one of two ways:

- ``late``: the round runs with the group, but this peer's result raises (as when its own round times out at the
  end): the group's mean includes this peer's gradients, and this peer must fall back to its own local gradients,
  which the accumulators no longer hold (hivemind_accum keeps them; upstream hivemind 1.1.12 steps with zeros);
- ``early``: this peer finds no group for the epoch (its rounds never reach the averager): the group's mean excludes
  it, and it steps with its own local gradients.

Every peer reports, per averaging round, its key (gathered from every group member), weight and local mean gradient,
and per epoch transition its parameters' move and how its round ended. The parent checks that each move equals
(fp32 tolerance) minus the sample-weighted mean over the members that the round gathered (a successful round, whatever
epoch each member was in), or minus the peer's own local mean gradient (a failed round, or no round). Transitions that
downloaded the state are skipped but counted, and so are those after the last epoch, when peers shut down; each
peer's transitions must be contiguous from epoch 0 to its last epoch.

What hivemind does, and how the scenario avoids it: its all-reduce reports success to every group member even when
some member's data never reached some reducer (a member that failed, died, cancelled its round after matchmaking or
triggered it more than ``next_chunk_timeout`` after the others). That member is left out of the parts those reducers
average, and whoever does not get a part back keeps its local values there: updates become per-part mixtures of means
over different subsets of the group. The scenario therefore kills between rounds, injects failures that leave the
all-reduce intact, waits before training until every initial peer's tracker sees all the others (a peer that believes
it is alone cancels a round its group counts on), and sets ``next_chunk_timeout`` to ``SENDER_TIMEOUT`` (members are
often an epoch apart: matchmaking does not look at epochs). The ``sender`` failure mode (the peer's gradient
compression raises, so it cannot send its parts) shows the mixtures where the sender was matched into a group, as an
expected failure.

If the swarm gets stuck, every live peer's Python processes print their stacks (faulthandler) before the test fails.
"""
import faulthandler
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import time
import traceback
from functools import partial

import hivemind
import pytest
import torch
from hivemind.averaging.control import StepControl
from hivemind.compression import NoCompression
from hivemind.utils import MPFuture, get_dht_time

import hivemind_accum
from tests.conftest import receive_by_value, send_by_value, wait_for

EPOCHS = int(os.environ.get("HIVEMIND_ACCUM_SOAK_EPOCHS", "8"))
LONG = EPOCHS >= 20
INITIAL_PEERS = 4
JOINER = INITIAL_PEERS  # rank of the peer that joins mid-run
VICTIM = INITIAL_PEERS - 1  # rank of the peer that is killed (never 0: it is everyone's initial DHT peer)
BATCH = {0: 2, 1: 3, 2: 4, 3: 5, 4: 3}  # samples per micro-step, constant within a peer
SHAPES = ((40, 50), (48,))  # two parameters, 2048 values: the all-reduce splits them between two reducers
STEP_SLEEP = 0.1
TARGET_BATCH_SIZE = 8 * sum(BATCH[rank] for rank in range(INITIAL_PEERS))  # about 8 micro-steps per peer per epoch
FAILURE_RATE = 0.15
SEED = 1234
RTOL, ATOL = 1e-4, 1e-5
# how long a reducer waits for a group member's data before averaging without it (next_chunk_timeout): members trigger
# their rounds at their own epoch transitions, seconds apart when they are in different epochs
SENDER_TIMEOUT = 5.0


def kill_and_join_epochs(epochs: int):
    return max(2, epochs // 4), max(3, epochs // 3)


def injected_failures(epochs: int, modes=("late", "early")) -> dict:
    """{(rank, epoch): mode} for a seeded random subset of rounds, plus forced ones so that every run has each mode"""
    rng = random.Random(SEED)
    failures = {
        (rank, epoch): rng.choice(modes)
        for rank in range(JOINER + 1)
        for epoch in range(1, epochs)
        if rng.random() < FAILURE_RATE
    }
    failures.update({(1, 1): modes[0], (2, 2): modes[-1], (0, epochs - 2): modes[0]})
    return failures


def direction(rank: int, micro_step: int):
    """this peer's gradient at this micro-step (d loss / d param for the linear loss)"""
    generator = torch.Generator().manual_seed(SEED + 1_000_003 * (rank + 1) + micro_step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def flat(tensors):
    return torch.cat([tensor.detach().reshape(-1).float() for tensor in tensors])


class InjectedFailure(RuntimeError):
    pass


class UpdateMismatch(AssertionError):
    """an epoch's update matches neither the group's weighted mean nor the peer's own gradient"""


class FlaggedCompression(NoCompression):
    """``sender`` mode: no compression, but raise while ``flag`` is set, so that this peer cannot send its parts"""

    def __init__(self, flag):
        super().__init__()
        self.flag = flag

    def compress(self, tensor, info, allow_inplace=False):
        if self.flag.value:
            raise InjectedFailure("soak test: injected averaging failure (sender)")
        return super().compress(tensor, info, allow_inplace)


def fail_late(control: StepControl) -> StepControl:
    """``late`` mode: the round runs as usual, but ``control``'s result raises once the round is over. The control
    keeps its identity: the optimizer keeps a round's local gradients under its control"""
    wait_for_round = control.exception

    def result(timeout=None):
        wait_for_round(timeout)  # wait for the round to end, whatever its outcome
        raise InjectedFailure("soak test: injected averaging failure (late)")

    control.result = result
    control.exception = lambda timeout=None: InjectedFailure("soak test: injected averaging failure (late)")
    return control


class PeerContext:
    """per-peer state shared by the training loop, the recording averager and the optimizer wrappers"""

    def __init__(self, rank, conn, fail_flag, failures):
        self.rank, self.conn, self.fail_flag, self.failures = rank, conn, fail_flag, failures
        self.opt = None
        self.pending = []  # gradients of the micro-steps accumulated since the last reset
        self.seq = 0  # averaging rounds (StepControls) this peer has created
        self.keys = {}  # id(StepControl) -> (rank, seq); the controls are kept alive in `controls`
        self.controls = []
        self.events = {}

    def send(self, *message):
        send_by_value(self.conn, message)

    def failure(self):
        return self.failures.get((self.rank, self.opt.local_epoch))

    def pending_mean(self):
        return torch.stack(self.pending).mean(0) if self.pending else None


class RecordingAverager(hivemind_accum.GradientAverager):
    """gathers (rank, seq) from every group member, reports each round's weight and local gradient, injects failures"""

    def __init__(self, *args, soak: PeerContext, **kwargs):
        self.soak = soak
        super().__init__(*args, **kwargs)

    def schedule_step(self, scheduled_time=None, **kwargs):
        soak = self.soak
        key = (soak.rank, soak.seq)
        soak.seq += 1
        if soak.failure() == "early":
            # a round that never reaches the averager, so that no group can include this peer (cancelling a real
            # round, even right away, races with matchmaking: the group may already count on this peer)
            control = StepControl(
                scheduled_time=get_dht_time(), deadline=float("inf"), allow_retries=False, weight=0.0,
                data_for_gather=b"",
            )
            control.attach(MPFuture(), MPFuture())
            control.cancel()
        else:
            control = super().schedule_step(scheduled_time, gather=key, **kwargs)
        soak.keys[id(control)] = key
        soak.controls.append(control)
        return control

    def step(self, weight=None, reset_accumulators=True, control=None, timeout=None, wait=True, **kwargs):
        soak = self.soak
        failure = soak.failure()
        if failure == "early":
            raise InjectedFailure("soak test: injected averaging failure (early)")  # the round does not begin
        if control is None:
            control = self.schedule_step(timeout=timeout, **kwargs)
            kwargs = {}
        key = soak.keys[id(control)]
        soak.fail_flag.value = int(failure == "sender")
        epoch, local_mean, local_samples = soak.opt.local_epoch, soak.pending_mean(), self.local_samples_accumulated
        control = super().step(
            weight=weight, reset_accumulators=reset_accumulators, control=control, timeout=timeout, wait=False, **kwargs
        )
        soak.send(
            "round", soak.rank,
            dict(key=key, epoch=epoch, weight=control.weight, samples=local_samples, grad=local_mean, failure=failure,
                 micro_steps=len(soak.pending), tag_along=False),
        )
        soak.events["round_key"] = key
        if failure == "late":
            control = fail_late(control)
        return control.result(timeout) if wait else control


def _wrap(opt, name, before=None, after=None):
    method = getattr(opt, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args)
        result = method(*args, **kwargs)
        if after is not None:
            after(*args)
        return result

    setattr(opt, name, wrapper)


def _peer(rank, conn, initial_peers, failures, kill_at, start_barrier, go, stop, deadline):
    os.setpgid(0, 0)  # the peer and everything it starts (DHT, averagers, p2pd) form one process group
    # hivemind's MPFuture locks are module-level multiprocessing locks, inherited through fork by every peer of this
    # test: the victim's SIGKILL could land while one of its processes holds one, and every other peer would then block
    # on it forever (seen once in 15 runs: peers stuck in MPFuture._send_update). Fresh locks per peer keep each lock
    # within one peer's process group, which dies whole
    MPFuture.reset_backend()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks if the swarm gets stuck
    dht = opt = None
    try:
        torch.manual_seed(SEED)  # the same initial parameters on every peer
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        soak = PeerContext(rank, conn, mp.Value("b", 0), failures)
        dht = hivemind.DHT(start=True, initial_peers=initial_peers)
        if rank == 0:
            soak.send("maddrs", rank, [str(maddr) for maddr in dht.get_visible_maddrs()])
        reuse_grad_buffers = rank % 2 == 1
        opt = soak.opt = hivemind_accum.Optimizer(
            dht=dht, run_id="soak", params=params, optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
            target_batch_size=TARGET_BATCH_SIZE, batch_size_per_step=BATCH[rank], reuse_grad_buffers=reuse_grad_buffers,
            matchmaking_time=1.0, averaging_timeout=10.0, next_chunk_timeout=SENDER_TIMEOUT,
            grad_compression=FlaggedCompression(soak.fail_flag),
            grad_averager_factory=partial(RecordingAverager, soak=soak, request_timeout=0.5),
            average_state_every=10**6,  # no parameter averaging: each epoch's move is the gradient step alone
        )
        events = soak.events

        def round_ended(control):
            outcome = dict(key=soak.keys.get(id(control)) if control is not None else None, gathered=None, error=None)
            if control is None:
                outcome["status"] = "no_round"
            elif not control.done():
                outcome["status"] = "pending"
            elif control.cancelled():
                outcome["status"] = "cancelled"
            elif control.exception() is not None:
                outcome.update(status="failed", error=repr(control.exception()))
            else:
                outcome.update(status="ok", gathered=sorted(tuple(value) for value in control.result().values()))
            events["round"] = outcome

        def tag_along(control):
            soak.send(
                "round", rank,
                dict(key=soak.keys.get(id(control)), epoch=opt.local_epoch, weight=0.0 if not control.triggered
                     else control.weight, samples=0, grad=None, failure=None, micro_steps=0, tag_along=True),
            )
            events["tag_along"] = True

        _wrap(opt, "_average_gradients_and_load_into_optimizer", after=round_ended)
        _wrap(opt, "_load_local_gradients_into_optimizer", before=lambda: events.__setitem__("fallback", True))
        _wrap(opt, "load_state_from_peers", before=lambda: events.__setitem__("download", True))
        _wrap(opt, "_tag_along_with_zero_weight", before=tag_along)

        if start_barrier is not None:
            start_barrier.wait(timeout=120)  # the initial peers start training together
        if go is not None:  # the joiner, started in advance (as its start takes long under load), joins when told
            while not go.wait(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peer {rank} was never told to join")
            # and only once its tracker has seen the swarm two epochs ahead: then its first step downloads the state
            # (hivemind.Optimizer._should_load_state_from_peers), instead of ending an epoch on stale progress
            wait_for(lambda: opt.tracker.global_epoch >= opt.local_epoch + 2, deadline - time.monotonic(),
                     f"peer {rank} to see the swarm two epochs ahead")
        micro_step = 0
        while not stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {rank} did not finish before its deadline (epoch {opt.local_epoch})")
            epoch, before = opt.local_epoch, flat(params)
            if rank == VICTIM and epoch >= kill_at:
                # a crash between two rounds: no goodbye, no shutdown. (Dying inside an assembled group instead makes
                # the others keep local values for the parts it was to reduce, as in the ``sender`` failure mode.)
                soak.send("killed", rank, epoch)
                os.killpg(0, signal.SIGKILL)
            events.clear()
            if not reuse_grad_buffers:
                opt.zero_grad()
            grads = direction(rank, micro_step)
            micro_step += 1
            sum((param * grad).sum() for param, grad in zip(params, grads)).backward()
            soak.pending.append(flat(grads))
            local_mean = soak.pending_mean()
            opt.step()
            if micro_step == 1 and start_barrier is not None:
                # a peer publishes its progress once it has samples: wait until every initial peer sees all others,
                # or one that believes it is alone cancels a round that its group already counts on
                wait_for(lambda: opt.tracker.global_progress.num_peers >= INITIAL_PEERS, 60,
                         f"peer {rank} to see {INITIAL_PEERS} peers")
                start_barrier.wait(timeout=60)
            if events.get("download") or opt.local_epoch != epoch:
                soak.send(
                    "transition", rank,
                    dict(epoch_before=epoch, epoch_after=opt.local_epoch, move=flat(params) - before,
                         download=bool(events.get("download")), fallback=bool(events.get("fallback")),
                         tag_along=bool(events.get("tag_along")), round=events.get("round"),
                         round_key=events.get("round_key"), local_mean=local_mean),
                )
                soak.pending.clear()
            time.sleep(STEP_SLEEP)
        soak.send("done", rank, opt.local_epoch)
    except BaseException:
        send_by_value(conn, ("error", rank, traceback.format_exc()))
        raise
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


class Swarm:
    """the parent's view: starts peers, collects their reports, kills whatever is left at the end"""

    def __init__(self, epochs, failures, deadline):
        self.ctx = mp.get_context("fork")
        self.epochs, self.failures, self.deadline = epochs, failures, deadline
        self.kill_at, self.join_at = kill_and_join_epochs(epochs)
        self.stop = self.ctx.Event()
        self.processes, self.conns = {}, {}
        self.rounds, self.transitions, self.epoch_reached = {}, {}, {}
        self.done, self.errors, self.killed = {}, {}, {}
        self.maddrs = None

    def start(self, rank, initial_peers, barrier=None, go=None):
        reader, writer = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(
            target=_peer,
            args=(rank, writer, initial_peers, self.failures, self.kill_at, barrier, go, self.stop, self.deadline),
        )
        process.start()
        writer.close()
        self.processes[rank], self.conns[rank] = process, reader
        self.transitions[rank], self.epoch_reached[rank] = [], 0

    def poll(self, timeout):
        for conn in mp.connection.wait(list(self.conns.values()), timeout=timeout):
            rank = next(rank for rank, other in self.conns.items() if other is conn)
            try:
                kind, sender, payload = receive_by_value(conn)
            except (EOFError, OSError):
                del self.conns[rank]
                continue
            if kind == "maddrs":
                self.maddrs = payload
            elif kind == "round":
                assert payload["key"] not in self.rounds or payload["tag_along"], payload
                self.rounds.setdefault(payload["key"], payload)
            elif kind == "transition":
                self.transitions[sender].append(payload)
                self.epoch_reached[sender] = max(self.epoch_reached[sender], payload["epoch_after"])
            elif kind == "done":
                self.done[sender] = payload
            elif kind == "killed":
                self.killed[sender] = payload
            elif kind == "error":
                self.errors[sender] = payload
        assert not self.errors, "\n".join(f"peer {rank} failed:\n{error}" for rank, error in self.errors.items())

    def run(self):
        barrier = self.ctx.Barrier(INITIAL_PEERS)
        self.start(0, None, barrier)
        while self.maddrs is None:
            self.poll(timeout=1.0)
            assert time.monotonic() < self.deadline, "peer 0 did not start"
        for rank in range(1, INITIAL_PEERS):
            self.start(rank, self.maddrs, barrier)
        join = self.ctx.Event()
        self.start(JOINER, self.maddrs, go=join)
        while not (
            join.is_set()
            and VICTIM in self.killed
            and all(reached >= self.epochs for rank, reached in self.epoch_reached.items() if rank not in self.killed)
        ):
            self.poll(timeout=0.5)
            if time.monotonic() > self.deadline:
                self.dump_stacks()
                raise AssertionError(
                    f"the swarm did not finish in time: epochs {self.epoch_reached}, killed {self.killed}, "
                    f"alive {[rank for rank, process in self.processes.items() if process.is_alive()]}"
                )
            if not join.is_set() and max(self.epoch_reached.values()) >= self.join_at:
                join.set()
        self.stop.set()
        while any(rank not in self.done for rank in self.processes if rank not in self.killed):
            self.poll(timeout=0.5)
            assert time.monotonic() < self.deadline + 30, f"peers did not stop, done: {self.done}"

    def dump_stacks(self):
        """make every Python process of every live peer print its threads' stacks to stderr"""
        for rank, process in self.processes.items():
            if rank in self.killed or not process.is_alive():
                continue
            for pid in _python_processes_in_group(process.pid):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(2.0)

    def cleanup(self):
        self.stop.set()
        join_deadline = time.monotonic() + 20
        for process in self.processes.values():
            process.join(timeout=max(0.1, join_deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
            try:
                os.killpg(process.pid, signal.SIGKILL)  # leftovers of the peer: DHT, averagers, p2pd
            except (ProcessLookupError, PermissionError):
                pass
        for conn in self.conns.values():
            conn.close()


def _python_processes_in_group(pgid: int):
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    is_python = b"python" in cmdline.read().split(b"\0")[0]
            except OSError:
                continue
            if int(fields[2]) == pgid and is_python:
                yield int(entry)


def run_swarm(epochs: int, failures: dict, time_limit: float) -> Swarm:
    swarm = Swarm(epochs, failures, deadline=time.monotonic() + time_limit)
    try:
        swarm.run()
    finally:
        swarm.cleanup()
    return swarm


def _describe_mismatch(rank, transition, expected, members):
    update = -transition["move"]
    epochs = f"epoch {transition['epoch_before']} -> {transition['epoch_after']}"
    lines = [f"peer {rank}, {epochs}: round {transition['round']}"]
    lines.append(f"  fallback={transition['fallback']} tag_along={transition['tag_along']}")
    if expected is not None:
        lines.append(f"  max |update - expected| = {(update - expected).abs().max():.3g}")
    lines.append(f"  max |update - own local mean| = {(update - transition['local_mean']).abs().max():.3g}")
    for member in members or ():
        if member is not None and member["grad"] is not None:
            lines.append(
                f"  member {member['key']} (epoch {member['epoch']}, weight {member['weight']}, injected failure "
                f"{member['failure']}): max |update - its gradient| = {(update - member['grad']).abs().max():.3g}"
            )
    if members and expected is not None:  # a partially averaged buffer matches each expectation on some elements
        close_group = torch.isclose(update, expected, rtol=RTOL, atol=ATOL)
        close_own = torch.isclose(update, transition["local_mean"], rtol=RTOL, atol=ATOL)
        lines.append(
            f"  elements equal to the group mean: {int(close_group.sum())}, to the own gradient: "
            f"{int(close_own.sum())}, to neither: {int((~close_group & ~close_own).sum())} of {update.numel()}"
        )
        known = [member for member in members if member is not None and member["grad"] is not None]
        offset = 0
        for index, shape in enumerate(SHAPES):  # which subset of the group each parameter's update is the mean of
            size = torch.Size(shape).numel()
            part = slice(offset, offset + size)
            offset += size
            matches = []
            for subset in itertools.chain.from_iterable(
                itertools.combinations(known, count) for count in range(1, len(known) + 1)
            ):
                total = sum(member["weight"] for member in subset)
                if total > 0:
                    mean = sum(member["weight"] * member["grad"][part] for member in subset) / total
                    if torch.allclose(update[part], mean, rtol=RTOL, atol=ATOL):
                        matches.append([member["key"] for member in subset])
            lines.append(f"  parameter {index} ({size} values) is the weighted mean over: {matches or 'no subset'}")
    return "\n".join(lines)


def check_swarm(swarm: Swarm):
    """check every epoch's update; return counts of checked (and skipped) transitions and the mismatches found"""
    for (rank, _), record in swarm.rounds.items():  # each round's weight: the samples this peer accumulated
        if not record["tag_along"]:
            assert record["weight"] == record["samples"] == record["micro_steps"] * BATCH[rank], record
    counts = dict(group=0, fallback=0, local=0, download=0, after_end=0, late=0, early=0, sender=0)
    checked_by_peer = {}
    mismatches = []
    for rank, transitions in swarm.transitions.items():
        assert transitions, f"peer {rank} reported no epochs"
        epoch = checked_by_peer[rank] = 0
        for transition in transitions:  # contiguous: every epoch this peer went through is accounted for
            assert transition["epoch_before"] == epoch, (rank, epoch, transition)
            epoch = transition["epoch_after"]
            if transition["epoch_before"] >= swarm.epochs:
                counts["after_end"] += 1  # the swarm is stopping: groups may include peers that are shutting down
                continue
            if transition["download"]:
                counts["download"] += 1
                continue
            assert transition["epoch_after"] == transition["epoch_before"] + 1, (rank, transition)
            outcome, members = transition["round"], None
            if outcome is not None and outcome["status"] == "ok":
                kind = "group"
                assert outcome["key"] in outcome["gathered"], (rank, outcome)
                members = [swarm.rounds.get(key) for key in outcome["gathered"]]
                if any(member is None for member in members):
                    expected = None  # a member that never reported its round
                else:
                    total = sum(member["weight"] for member in members)
                    expected = sum(member["weight"] * member["grad"] for member in members if member["weight"]) / total
            else:
                kind = "fallback" if transition["fallback"] else "local"
                expected = transition["local_mean"]
            update = -transition["move"]  # SGD at lr 1
            if expected is None or not torch.allclose(update, expected, rtol=RTOL, atol=ATOL):
                mismatches.append(_describe_mismatch(rank, transition, expected, members))
                continue
            counts[kind] += 1
            checked_by_peer[rank] += 1
            failure = swarm.failures.get((rank, transition["epoch_before"]))
            assert failure in (None, "sender") or kind != "group", (rank, transition)  # the injection took effect
            if failure is not None and kind != "group":
                counts[failure] += 1  # an injected failure, checked to have stepped with the peer's own gradient
        if rank in swarm.killed:
            assert epoch >= swarm.kill_at, (rank, epoch)
        else:
            assert swarm.done[rank] == epoch >= swarm.epochs, (rank, epoch, swarm.done[rank])
    assert mismatches or all(checked_by_peer.values()), checked_by_peer  # every peer, the joiner included
    return counts, mismatches


@pytest.mark.forked
@pytest.mark.timeout(1200 if LONG else 240)
def test_soak_updates_match_group_mean_or_local_gradients():
    swarm = run_swarm(EPOCHS, injected_failures(EPOCHS), time_limit=1000 if LONG else 180)
    counts, mismatches = check_swarm(swarm)
    print(f"\nsoak: {EPOCHS} epochs, checked transitions: {counts}")
    if mismatches:
        raise UpdateMismatch(f"{len(mismatches)} updates match neither expectation:\n" + "\n".join(mismatches))
    assert VICTIM in swarm.killed and JOINER in swarm.done
    assert swarm.transitions[JOINER][0]["download"], swarm.transitions[JOINER][0]  # the joiner began by downloading
    assert counts["group"] >= EPOCHS, counts  # successful group rounds (typically twice as many)
    assert counts["late"] >= 1 and counts["early"] >= 1, counts  # injected failures checked, of either mode


@pytest.mark.forked
@pytest.mark.timeout(240)
# not strict: a mixture needs the failing sender matched into a group with others, which matchmaking's timing decides
# (a loaded run of the full suite checked 6 sender-failure transitions and found none); every other check still fails
# the test
@pytest.mark.xfail(
    raises=UpdateMismatch, strict=False,
    reason="hivemind's all-reduce keeps local values for the parts a failed sender/reducer was in charge of and "
    "reports success: updates are per-part mixtures of means over different subsets of the group",
)
def test_soak_sender_failures_leave_partially_averaged_updates():
    epochs = 5
    swarm = run_swarm(epochs, injected_failures(epochs, modes=("sender",)), time_limit=180)
    counts, mismatches = check_swarm(swarm)
    print(f"\nsoak (sender failures): {epochs} epochs, checked transitions: {counts}")
    if mismatches:
        raise UpdateMismatch(f"{len(mismatches)} updates match neither expectation:\n" + "\n".join(mismatches))
