"""The main job's training data and model: scikit-learn's bundled digits (no download) and a small CNN."""
from typing import TYPE_CHECKING, Iterator, Tuple

import torch
from torch import nn

if TYPE_CHECKING:
    from benchmarks.main_job.training import TrainConfig

class DigitsCNN(nn.Module):
    """
    A small convolutional classifier for 1x8x8 images (4.6 M parameters, most of them in the first linear layer),
    sized so that a micro-step takes tens of milliseconds on one CPU thread: an epoch of a few micro-steps then
    lasts long enough for hivemind's progress tracker and matchmaking to keep up, as in a real run.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(128, 256, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build_digits_cnn(seed: int) -> nn.Module:
    """a freshly initialized :class:`DigitsCNN`; the same seed gives the same weights in every process"""
    torch.manual_seed(seed)
    return DigitsCNN()


def load_digits_split(
    seed: int, test_size: float = 0.25
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Load scikit-learn's bundled digits dataset as float images in [0, 1] with a stratified train/test split.

    :param seed: ``random_state`` of the split
    :param test_size: fraction of samples held out for testing
    :returns: train images (N, 1, 8, 8), train labels (N,), test images, test labels
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_size, random_state=seed, stratify=digits.target
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]


def peer_micro_batches(
    config: "TrainConfig", peer_index: int, steps: int
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """
    Yield ``steps`` micro-batches (images, labels) of one peer, identical in every process.

    The peer's shard is every ``num_peers``-th training sample of a seeded permutation; each pass over the shard
    visits it in a fresh seeded order, dropping the incomplete last micro-batch.

    :param config: the run; its seed, number of peers and micro-batch size matter here
    :param peer_index: which peer's micro-batches to yield
    :param steps: how many
    """
    generator = torch.Generator().manual_seed(config.seed * 1000 + peer_index)
    train_images, train_labels, _, _ = load_digits_split(config.seed)
    shard = torch.randperm(len(train_labels), generator=torch.Generator().manual_seed(config.seed))
    shard = shard[peer_index :: config.num_peers]
    batches_per_pass = len(shard) // config.micro_batch_size
    if batches_per_pass == 0:
        raise ValueError(f"micro_batch_size={config.micro_batch_size} exceeds the shard of {len(shard)} samples")
    step = 0
    while True:
        order = shard[torch.randperm(len(shard), generator=generator)]
        for start in range(0, batches_per_pass * config.micro_batch_size, config.micro_batch_size):
            if step == steps:
                return
            indices = order[start : start + config.micro_batch_size]
            yield train_images[indices], train_labels[indices]
            step += 1


def evaluate_accuracy(model: nn.Module, seed: int) -> float:
    """
    Fraction of the held-out digits the model classifies correctly.

    :param model: a model taking (N, 1, 8, 8) images
    :param seed: the seed of the train/test split
    """
    _, _, test_images, test_labels = load_digits_split(seed)
    model.eval()
    with torch.no_grad():
        predictions = model(test_images).argmax(dim=1)
    return (predictions == test_labels).float().mean().item()
