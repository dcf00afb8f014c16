"""Synthetic datasets shaped for the built-in models, with real per-sample CPU work.

Each sample is generated deterministically from (seed, index), so every worker process, every run
and every machine sees the same data. `__getitem__` also does real numpy work proportional to
`sample_cost` (a stand-in for decoding and augmentation): without it an input pipeline would cost
nothing and DataLoader workers could not matter.

The targets are learnable: a fixed random teacher (drawn once from `seed`) labels the inputs, so the
loss really falls as a model trains (the numerics guard, gpuopt.trial.numerics, compares loss trajectories;
random labels would leave nothing to learn but their marginal).

Calibration (2-core AMD EPYC VM, numpy 2.4, one core, 2026-11-30): the work processes
WORK_ELEMENTS_PER_COST float32 elements per unit of cost at ~6-8 ns/element. sample_cost=1.0 measured
0.10 ms per sample on a quiet machine (mean of 3000 calls) and 0.14 ms (best of 15 x 200 calls) with
other jobs on the cores. Generating the sample itself costs, at sample_cost=0 (best of 15 x 200):
vectors (256,) 0.11 ms, images (3,32,32) 0.33 ms, tokens (128,) 0.07 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuopt.core.spec import HF_INPUT_KINDS

# Masked-LM batches: the share of positions masked (BERT's 15%), with this token id as [MASK].
MASK_SHARE = 0.15
# Learnable token sequences: each is an arithmetic progression mod the vocabulary, its step one
# of these: the next token follows from the two before it (a loss that can fall, unlike noise).
MAX_TOKEN_STEP = 8
# Learnable HF images: a per-class template plus noise of this scale.
IMAGE_NOISE = 0.5
# The templates' random stream: (seed, TEMPLATE_STREAM, class), apart from the samples' (seed, index).
TEMPLATE_STREAM = 2**32
# float32 elements of "decode" work per unit of sample_cost: ~0.1 ms on one core of the dev machine.
WORK_ELEMENTS_PER_COST = 16384
# Padding around an image before the random crop (as in the classic CIFAR augmentation).
CROP_PADDING = 4
# tokens: the share of positions whose token is random instead of the teacher's next token.
TOKEN_NOISE = 0.1


def _cpu_work(rng: np.random.Generator, sample_cost: float) -> float:
    """Real CPU work: fill a buffer, a transcendental pass, a scale, a reduction."""
    n = int(sample_cost * WORK_ELEMENTS_PER_COST)
    if n <= 0:
        return 0.0
    buf = rng.random(n, dtype=np.float32)
    np.tanh(buf, out=buf)
    np.multiply(buf, 0.5, out=buf)
    return float(buf.sum())


class SyntheticDataset(Dataset):
    """`size` samples of one kind:

    - vectors: float32 (D,) inputs, an int64 class target in [0, num_classes): the argmax of a
      fixed random linear teacher on the input
    - images: float32 (C, H, W) inputs after a random crop (from a padded image) and random
      horizontal flip, an int64 class target: the teacher's argmax on the image as cropped
    - tokens: int64 (T,) token ids in [0, num_classes) and the (T,) next-token targets; each token
      follows its predecessor through a fixed random map (a random token at TOKEN_NOISE of them)
    - hf_causal_lm / hf_masked_lm: dicts of (T,) `input_ids`, `attention_mask`, `labels` (learnable
      sequences; masked LM: 15% of positions masked, the others' labels -100)
    - hf_images: dicts of (C, H, W) `pixel_values` (a class template plus noise) and a `labels` id
    """

    def __init__(
        self,
        kind: str,
        shape: Sequence[int] | int,
        num_classes: int,
        size: int = 262144,
        sample_cost: float = 1.0,
        seed: int = 0,
    ) -> None:
        # checked as config (gpuopt.core.checks.workload: kind, shape's rank, sizes)
        self.kind = kind
        self.shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        self.num_classes = int(num_classes)
        self.size = int(size)
        self.sample_cost = float(sample_cost)
        self.seed = int(seed)
        # A (features, classes) projection, or for tokens the next token of each token.
        rng = np.random.default_rng((self.seed, 0x7EAC))  # apart from every sample's stream
        self._teacher = (
            rng.integers(0, self.num_classes, self.num_classes, dtype=np.int64)
            if kind == "tokens"
            else rng.standard_normal((int(np.prod(self.shape)), self.num_classes), dtype=np.float32)
        )

    def _label(self, inputs: np.ndarray) -> torch.Tensor:
        return torch.tensor(int(np.argmax(inputs.reshape(-1) @ self._teacher)), dtype=torch.int64)

    def _tokens(self, rng: np.random.Generator, length: int) -> np.ndarray:
        noise = rng.random(length) < TOKEN_NOISE
        random_tokens = rng.integers(0, self.num_classes, length, dtype=np.int64)
        following = self._teacher.tolist()
        sequence = [int(random_tokens[0])]
        for i in range(1, length):
            sequence.append(int(random_tokens[i]) if noise[i] else following[sequence[-1]])
        return np.asarray(sequence, dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    def __getitem__(
        self, index: int
    ) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng = np.random.default_rng((self.seed, index))
        _cpu_work(rng, self.sample_cost)
        if self.kind in HF_INPUT_KINDS:
            return self._hf_sample(rng)
        if self.kind == "tokens":
            (length,) = self.shape
            sequence = self._tokens(rng, length + 1)
            return torch.from_numpy(sequence[:-1].copy()), torch.from_numpy(sequence[1:].copy())
        if self.kind == "vectors":
            vector = rng.standard_normal(self.shape, dtype=np.float32)
            return torch.from_numpy(vector), self._label(vector)
        channels, height, width = self.shape
        padded = rng.standard_normal(
            (channels, height + 2 * CROP_PADDING, width + 2 * CROP_PADDING), dtype=np.float32
        )
        top, left = rng.integers(0, 2 * CROP_PADDING + 1, size=2)
        image = padded[:, top : top + height, left : left + width]
        if rng.random() < 0.5:
            image = image[:, :, ::-1]
        image = np.ascontiguousarray(image)
        return torch.from_numpy(image), self._label(image)

    def _hf_sample(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """A Hugging Face-format sample (the model computes its own loss from `labels`)."""
        if self.kind == "hf_images":
            label = int(rng.integers(0, self.num_classes))
            template_rng = np.random.default_rng((self.seed, TEMPLATE_STREAM, label))
            template = template_rng.standard_normal(self.shape)
            noise = rng.standard_normal(self.shape)
            pixels = (template + IMAGE_NOISE * noise).astype(np.float32)
            return {
                "pixel_values": torch.from_numpy(pixels),
                "labels": torch.tensor(label, dtype=torch.int64),
            }
        (length,) = self.shape
        start = int(rng.integers(0, self.num_classes))
        step = int(rng.integers(1, MAX_TOKEN_STEP + 1))
        ids = (start + step * np.arange(length, dtype=np.int64)) % self.num_classes
        input_ids = torch.from_numpy(ids)
        # Causal LM: labels are the inputs (the model shifts them); masked LM: the masked ones.
        labels = input_ids.clone()
        if self.kind == "hf_masked_lm":
            masked = torch.from_numpy(rng.random(length) < MASK_SHARE)
            labels[~masked] = -100  # ignored by the loss
            input_ids = input_ids.masked_fill(masked, self.num_classes - 1)  # the [MASK] id
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones(length, dtype=torch.int64),
            "labels": labels,
        }
