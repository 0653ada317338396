"""
Train a small MLP on scikit-learn's bundled digits with PyTorch Lightning's ``HivemindStrategy``, accumulating
gradients with hivemind_accum (docs/lightning.md).

One peer::

    python examples/lightning_digits.py

Two peers on one machine: start the first, then the second with the address the first one prints::

    python examples/lightning_digits.py --rank 0 --num-peers 2
    python examples/lightning_digits.py --rank 1 --num-peers 2 --initial-peers /ip4/127.0.0.1/tcp/.../p2p/...

Each peer trains on its own share of the digits (every ``num_peers``-th sample, from ``rank`` on) and waits until it
sees ``num_peers`` peers before its first micro-step. Training stops after ``--rounds`` optimizer steps of the swarm
(hivemind's epochs). Add ``--in-place`` for in-place mode (``reuse_grad_buffers=True``).
"""
import argparse
import time
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hivemind_accum


def import_hivemind_strategy():
    """
    ``lightning_hivemind.HivemindStrategy``, importable on Lightning >= 2.5.

    lightning-hivemind 0.1.0 imports ``LRScheduler`` and ``ReduceLROnPlateau`` from
    ``lightning.fabric.utilities.types``, which Lightning 2.5 removed; both are torch's classes, set back here.
    """
    import lightning.fabric.utilities.types as lightning_types
    from torch.optim import lr_scheduler

    for name in ("LRScheduler", "ReduceLROnPlateau"):
        if not hasattr(lightning_types, name):
            setattr(lightning_types, name, getattr(lr_scheduler, name))
    from lightning_hivemind.strategy import HivemindStrategy

    return HivemindStrategy


def digits(rank: int = 0, num_peers: int = 1) -> TensorDataset:
    """peer ``rank``'s share of the 1797 digits: every ``num_peers``-th sample from ``rank`` on, pixels in [0, 1]"""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images[rank::num_peers], dtype=torch.float32) / 16.0
    return TensorDataset(images, torch.tensor(labels[rank::num_peers], dtype=torch.long))


def make_module(lr: float = 0.03):
    """a LightningModule: 64 -> 64 -> 10 MLP, cross-entropy, Adam"""
    import lightning.pytorch as pl

    class DigitsMLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

        def forward(self, images):
            return self.net(images)

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return F.cross_entropy(self(images), labels)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=lr)

    return DigitsMLP()


@torch.no_grad()
def evaluate(module, dataset: TensorDataset):
    """(mean cross-entropy, accuracy) of ``module`` on ``dataset``"""
    images, labels = dataset.tensors
    logits = module(images)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item()


def make_callbacks(num_peers: int, rounds: int, peer_timeout: float = 60.0) -> list:
    """a callback that waits until this peer sees ``num_peers`` peers (hivemind publishes a peer's progress only once
    it has accumulated samples: after its first micro-step), and one that stops training after ``rounds`` optimizer
    steps of the swarm"""
    import lightning.pytorch as pl

    class WaitForPeers(pl.Callback):
        """after this peer's first micro-step, which publishes its progress, wait until the swarm has ``num_peers``"""

        def __init__(self):
            self.waited = False

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.waited or num_peers < 2:
                return
            self.waited = True
            tracker = trainer.optimizers[0].tracker  # the hivemind.Optimizer the strategy built at the first batch
            deadline = time.monotonic() + peer_timeout
            while tracker.global_progress.num_peers < num_peers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"saw {tracker.global_progress.num_peers} of {num_peers} peers")
                time.sleep(0.05)

    class StopAfterRounds(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.optimizers[0].local_epoch >= rounds:
                trainer.should_stop = True

    return [WaitForPeers(), StopAfterRounds()]


def make_strategy(
    initial_peers: Optional[Sequence[str]] = None,
    target_batch_size: int = 128,
    reuse_grad_buffers: bool = False,
    run_id: str = "lightning_digits",
    host_maddrs: Optional[List[str]] = None,
    **optimizer_kwargs,
):
    """``HivemindStrategy`` joined to ``initial_peers`` (None: the first peer); further keyword arguments go to
    ``hivemind.Optimizer``"""
    HivemindStrategy = import_hivemind_strategy()
    return HivemindStrategy(
        target_batch_size=target_batch_size, run_id=run_id, reuse_grad_buffers=reuse_grad_buffers,
        initial_peers=list(initial_peers) if initial_peers else None,
        host_maddrs=host_maddrs or ["/ip4/127.0.0.1/tcp/0"], **optimizer_kwargs,
    )


def train(
    strategy, rank: int = 0, num_peers: int = 1, rounds: int = 30, micro_batch: int = 32,
    gradient_clip_val: Optional[float] = None, callbacks: Sequence = (), seed: int = 0,
):
    """train peer ``rank`` on its share of the digits for ``rounds`` rounds; the trained LightningModule"""
    import lightning.pytorch as pl

    hivemind_accum.patch_hivemind()  # before trainer.fit, in every peer process: HivemindStrategy builds the optimizer
    pl.seed_everything(seed, verbose=False)  # every peer starts from the same parameters
    module = make_module()
    loader = DataLoader(digits(rank, num_peers), batch_size=micro_batch, shuffle=True, drop_last=True)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=10**6, gradient_clip_val=gradient_clip_val,
        callbacks=[*make_callbacks(num_peers, rounds), *callbacks], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=0, help="this peer's share of the data")
    parser.add_argument("--num-peers", type=int, default=1, help="peers to wait for before training")
    parser.add_argument("--initial-peers", nargs="*", default=None, help="a running peer's address")
    parser.add_argument("--host-maddrs", nargs="*", default=None, help="addresses to listen on (default: loopback)")
    parser.add_argument("--in-place", action="store_true", help="in-place mode: reuse_grad_buffers=True")
    parser.add_argument("--gradient-clip-val", type=float, default=None, help="clip each micro-batch (exact mode)")
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    # hivemind 1.1.12's DHT logs a request whose sender exited as an error, at shutdown: noise (docs/upstream.md)
    hivemind_accum.silence_exited_sender_errors()
    strategy = make_strategy(
        args.initial_peers, args.target_batch_size, reuse_grad_buffers=args.in_place, host_maddrs=args.host_maddrs,
        matchmaking_time=1.0,
    )
    print("other peers join with: --initial-peers", *map(str, strategy.dht.get_visible_maddrs()), flush=True)
    module = train(strategy, args.rank, args.num_peers, args.rounds, gradient_clip_val=args.gradient_clip_val)
    loss, accuracy = evaluate(module, digits())
    print(f"peer {args.rank}: loss {loss:.3f}, accuracy {accuracy:.3f} on all 1797 digits")


if __name__ == "__main__":
    main()
