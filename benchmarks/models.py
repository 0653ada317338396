"""
Models the benchmarks time: stacks of Linear layers of a chosen size, and ResNet-152 and ConvNeXt-Large built from
the ``transformers`` library's configurations (random initialization, no weight download).
"""
import torch


def build_model(name: str) -> torch.nn.Module:
    """
    :param name: ``linear-<N>m`` (a stack of 2048-wide Linear layers with about N million parameters),
      ``mlp-<L>x<W>`` (L Linear(W, W) layers, 2 L parameter tensors: ``mlp-200x16`` has 400 tensors,
      ``mlp-380x512`` 99.8 M parameters in 760 tensors),
      ``resnet152`` or ``convnext-large`` (transformers' ResNet-152 and ConvNeXt-Large configs, random weights)
    :returns: the model, taking a batch of inputs from :func:`make_inputs` and returning logits
    """
    if name.startswith("mlp-"):
        layers, width = _mlp_shape(name)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if name.startswith("linear-"):
        width = 2048
        layers = max(1, round(float(name[len("linear-") : -1]) * 1e6 / (width * width + width)))
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)])
    from transformers import ConvNextConfig, ConvNextForImageClassification, ResNetConfig, ResNetForImageClassification

    if name == "resnet152":
        config = ResNetConfig(depths=[3, 8, 36, 3], layer_type="bottleneck", hidden_sizes=[256, 512, 1024, 2048], num_labels=10)
        return _Logits(ResNetForImageClassification(config))
    if name == "convnext-large":
        config = ConvNextConfig(depths=[3, 3, 27, 3], hidden_sizes=[192, 384, 768, 1536], num_labels=10)
        return _Logits(ConvNextForImageClassification(config))
    raise ValueError(f"model: unknown name {name!r}; use linear-<N>m, mlp-<L>x<W>, resnet152 or convnext-large")


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits


def make_inputs(
    name: str, batch_size: int, generator: torch.Generator, image_size: int = 32, device: str = "cpu"
) -> torch.Tensor:
    """
    a batch of random inputs for :func:`build_model`'s model ``name``, drawn on ``device`` from ``generator`` (a
    generator of that device)

    :param image_size: side of the square 3-channel images for resnet152 and convnext-large (hivemind#566 used
      224); ignored for linear models, whose inputs are ``(batch_size, 2048)``
    """
    if name.startswith("mlp-"):
        return torch.randn(batch_size, _mlp_shape(name)[1], generator=generator, device=device)
    if name.startswith("linear-"):
        return torch.randn(batch_size, 2048, generator=generator, device=device)
    return torch.randn(batch_size, 3, image_size, image_size, generator=generator, device=device)


def _mlp_shape(name: str):
    """(layers, width) of ``mlp-<L>x<W>``"""
    layers, _, width = name[len("mlp-") :].partition("x")
    return int(layers), int(width)
