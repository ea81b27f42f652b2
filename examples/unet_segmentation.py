"""UNet (about 7.7M parameters at width 32) segmenting procedurally drawn pictures, as a LightningModule.

Each picture is a shaded background with filled circles and rectangles in random colours and
sizes, plus noise; the mask labels every pixel background (0), circle (1) or rectangle (2). Colours
do not give the class away, so the net must learn shape, and the loss keeps falling.

    python examples/unet_segmentation.py --opt-level O2 --dtype bfloat16 --max-steps 100
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Example, batch_loader, main_for  # noqa: E402

NUM_CLASSES = 3  # background, circle, rectangle

#: width = channels of the first level (32 -> ~7.7M params, the seed article's UNet); image side in pixels;
#: samples per step; learning rate.
SIZES = {
    "tiny": dict(width=4, image_size=32, batch_size=2, lr=3e-3),
    "small": dict(width=32, image_size=96, batch_size=4, lr=1e-3),
    "base": dict(width=32, image_size=256, batch_size=8, lr=1e-3),
}


def draw_shapes(batch_size: int, image_size: int, g: torch.Generator, shapes_per_image: int = 6
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pictures float32 [B, 3, S, S] in about [0, 1] and class masks int64 [B, S, S]; later shapes occlude earlier."""
    b, s = batch_size, image_size
    ys, xs = torch.meshgrid(torch.linspace(0, 1, s), torch.linspace(0, 1, s), indexing="ij")
    top, bottom = torch.rand(b, 3, 1, 1, generator=g), torch.rand(b, 3, 1, 1, generator=g)
    images = top + (bottom - top) * ys  # vertical gradient "sky"
    masks = torch.zeros(b, s, s, dtype=torch.long)
    for _ in range(shapes_per_image):
        cy, cx = torch.rand(b, 1, 1, generator=g), torch.rand(b, 1, 1, generator=g)
        half = 0.05 + 0.15 * torch.rand(b, 2, 1, 1, generator=g)
        is_circle = torch.rand(b, 1, 1, generator=g) < 0.5
        circle = (ys - cy) ** 2 + (xs - cx) ** 2 <= half[:, 0] ** 2
        rectangle = ((ys - cy).abs() <= half[:, 0]) & ((xs - cx).abs() <= half[:, 1])
        inside = torch.where(is_circle, circle, rectangle)
        colour = torch.rand(b, 3, 1, 1, generator=g)
        images = torch.where(inside.unsqueeze(1), colour, images)
        masks = torch.where(inside, torch.where(is_circle, 1, 2), masks)
    images = images + 0.05 * torch.randn(images.shape, generator=g)
    return images, masks


def double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    """[3x3 conv (no bias), BatchNorm, ReLU] twice."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """Four-level UNet: widths w, 2w, 4w, 8w, bottleneck 16w; transposed-conv upsampling; 1x1 conv head."""

    def __init__(self, in_channels: int = 3, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()
        widths = [width * 2 ** i for i in range(4)]
        self.encoders = nn.ModuleList()
        channels = in_channels
        for w in widths:
            self.encoders.append(double_conv(channels, w))
            channels = w
        self.bottleneck = double_conv(widths[-1], widths[-1] * 2)
        self.upsamplers = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, stride=2) for w in reversed(widths))
        self.decoders = nn.ModuleList(double_conv(w * 2, w) for w in reversed(widths))
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skips = []
        x = images
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for upsample, decoder, skip in zip(self.upsamplers, self.decoders, reversed(skips)):
            x = decoder(torch.cat([upsample(x), skip], dim=1))
        return self.head(x)


class ShapeSegmenter(L.LightningModule):
    """Pixel-wise cross-entropy over 3 classes; logs the multiclass Jaccard index (torchmetrics)."""

    def __init__(self, width: int = 32, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = UNet(width=width)
        self.train_iou = torchmetrics.JaccardIndex(task="multiclass", num_classes=NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, masks = batch
        logits = self(images).float()
        loss = F.cross_entropy(logits, masks)
        self.train_iou(logits.detach().argmax(dim=1), masks)
        self.log("train_loss", loss)
        self.log("train_iou", self.train_iou)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def build_example(size: str = "small", seed: int = 0, batch_size: Optional[int] = None, lr: Optional[float] = None,
                  width: Optional[int] = None, image_size: Optional[int] = None) -> Example:
    """The segmenter (weights seeded by ``seed``) and its endless stream of drawn pictures."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    config = SIZES[size]
    batch_size = batch_size or config["batch_size"]
    image_size = image_size or config["image_size"]
    if image_size % 16:
        raise ValueError(f"image_size must be a multiple of 16 (four 2x poolings), got {image_size}")
    torch.manual_seed(seed)
    module = ShapeSegmenter(width=width or config["width"], lr=lr or config["lr"])
    loader = batch_loader(lambda g: draw_shapes(batch_size, image_size, g), seed=seed)
    return Example(module=module, train_dataloader=loader, batch_size=batch_size)


def main(argv=None) -> float:
    return main_for(build_example, __doc__.splitlines()[0], tuple(SIZES), "small", argv)


if __name__ == "__main__":
    main()
