"""
Two peers train examples/lightning_digits.py with Lightning's ``HivemindStrategy`` and ``patch_hivemind()``, in
exact and in-place mode.

Both peers join one bootstrap DHT. Each waits after its first micro-step until it sees the other (the example's
``WaitForPeers``): hivemind publishes a peer's progress only once it has accumulated samples. Both enter every epoch
boundary together (a barrier before the optimizer's epoch update, as in tests/test_configurations.py), so each makes
the same number of rounds and stops at the same epoch. Whether a round averages depends on matchmaking's timing; a
failed round steps with the peer's local gradients, so the loss bound holds either way (see LOSS_BOUND).
"""
import importlib.util
import multiprocessing as mp
import pathlib

import pytest

pytest.importorskip("lightning")
pytest.importorskip("lightning_hivemind")

import hivemind  # noqa: E402

import hivemind_accum  # noqa: E402
from tests.conftest import receive_by_value, send_by_value, swarm  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "lightning_digits.py"
ROUNDS = 20
MICRO_BATCH = 32
TARGET_BATCH_SIZE = 128
# Cross-entropy on all 1797 digits after ROUNDS rounds, from 2.3 at the start. Measured with the example's Adam (lr
# 0.03): two peers 0.189 (exact mode, clipped at 1.0) and 0.187 (in place). The least a peer's step can use is one
# micro-batch's gradient: a round steps after at least one micro-step, with the average or, after a failed round, the
# peer's own gradient. Each peer alone on its half, stepping after every micro-batch, ended at 0.42-0.43 in either
# mode: the bound is 2.3x that worst case.
LOSS_BOUND = 1.0


def load_example():
    spec = importlib.util.spec_from_file_location("lightning_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_peer(rank: int, initial_peers, reuse_grad_buffers: bool, barrier, queue) -> None:
    import lightning.pytorch as pl

    example = load_example()
    seen = {}

    class Together(pl.Callback):
        """both peers enter every epoch boundary together; records what this peer's optimizer is"""

        def on_before_optimizer_step(self, trainer, module, optimizer):
            opt = trainer.optimizers[0]  # the hivemind.Optimizer the strategy built
            if "averager" in seen:
                return
            seen.update(optimizer=type(opt), averager=type(opt.grad_averager),
                        reuse_grad_buffers=opt.grad_averager.reuse_grad_buffers)
            update_global_epoch = opt._update_global_epoch

            def together(grad_scaler):
                barrier.wait(timeout=120)
                update_global_epoch(grad_scaler)

            opt._update_global_epoch = together

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if "num_peers" not in seen:  # after the example's WaitForPeers
                seen.update(num_peers=trainer.optimizers[0].tracker.global_progress.num_peers)

        def on_train_end(self, trainer, module):
            seen.update(epoch=trainer.optimizers[0].local_epoch)
            barrier.wait(timeout=120)  # the other peer is through its last round too

    strategy = example.make_strategy(
        initial_peers, TARGET_BATCH_SIZE, reuse_grad_buffers=reuse_grad_buffers, run_id=f"digits_{reuse_grad_buffers}",
        matchmaking_time=1.0, averaging_timeout=60.0, average_state_every=10**6,
        tracker_opts=dict(max_refresh_period=1.0),
    )
    try:
        module = example.train(
            strategy, rank, num_peers=2, rounds=ROUNDS, micro_batch=MICRO_BATCH,
            gradient_clip_val=None if reuse_grad_buffers else 1.0, callbacks=[Together()],
        )
        loss, accuracy = example.evaluate(module, example.digits())
        send_by_value(queue, dict(rank=rank, loss=loss, accuracy=accuracy, **seen))
    finally:  # the strategy's teardown shuts both down, unless it was never reached
        if strategy.dht.is_alive():
            if strategy._opt is not None:
                strategy._opt.shutdown()
            strategy.dht.shutdown()
        hivemind_accum.unpatch_hivemind()


@pytest.mark.forked
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reuse_grad_buffers", [False, True], ids=["exact", "in_place"])
def test_lightning_two_peers_train(reuse_grad_buffers):
    ctx = mp.get_context("fork")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    with swarm(1) as (bootstrap,):
        maddrs = [str(maddr) for maddr in bootstrap.get_visible_maddrs()]
        peers = [ctx.Process(target=_run_peer, args=(rank, maddrs, reuse_grad_buffers, barrier, queue))
                 for rank in (0, 1)]
        for peer in peers:
            peer.start()
        try:
            results = sorted((receive_by_value(queue, timeout=240) for _ in peers), key=lambda result: result["rank"])
        finally:
            for peer in peers:
                peer.join(timeout=60)
                if peer.is_alive():
                    peer.kill()
    print(results)
    for result in results:
        assert result["optimizer"] is hivemind.Optimizer, result  # built by the strategy, upstream's class
        assert result["averager"] is hivemind_accum.GradientAverager, result  # patch_hivemind()'s averager
        assert result["reuse_grad_buffers"] == reuse_grad_buffers, result
        assert result["num_peers"] == 2, result  # each saw the other before its second micro-step
        assert result["epoch"] == ROUNDS, result  # the same rounds as the other peer: each crossing was a barrier
        assert result["loss"] < LOSS_BOUND, result
