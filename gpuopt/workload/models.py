"""Built-in model families: MLP (input-bound), CNN (convolution-bound), GPT (matmul/attention-bound).

Each takes width/depth knobs and `activation_checkpointing` (recompute each block's activations in
backward: less memory, about one extra forward of compute). They follow gpuopt's workload contract
(see gpuopt.engines._build): `model(inputs) -> outputs`, with outputs of shape (N, C) or (N, T, C)
for the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    for block in blocks:
        if checkpointed and torch.is_grad_enabled():
            # use_reentrant=False: the supported mode; works with autocast and torch.compile.
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x


class MLP(nn.Module):
    """`depth` hidden Linear+GELU layers of size `width` on (N, in_features) vectors."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        width: int = 512,
        depth: int = 3,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, out_features)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.stem(x))
        x = _run_blocks(self.blocks, x, self.activation_checkpointing)
        return self.head(x)


class _ResidualBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CNN(nn.Module):
    """A small ResNet: a 3x3 stem, 3 stages of `depth` residual blocks (channels width, 2w, 4w;
    stride 2 between stages), global average pooling and a linear classifier."""

    def __init__(
        self,
        in_channels: int,
        out_features: int,
        width: int = 32,
        depth: int = 2,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks = []
        channels = width
        for stage in range(3):
            out_channels = width * 2**stage
            for index in range(depth):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(_ResidualBlock(channels, out_channels, stride))
                channels = out_channels
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, out_features)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = _run_blocks(self.blocks, x, self.activation_checkpointing)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Flash/memory-efficient attention kernels where the device has them.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(n, t, c))


class _TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder (pre-LayerNorm blocks, causal attention) over (N, T) token ids,
    returning (N, T, vocab_size) next-token logits."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        width: int = 128,
        depth: int = 2,
        heads: int = 4,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()  # width % heads: checked as config (gpuopt.core.checks.workload)
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(_TransformerBlock(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        x = _run_blocks(self.blocks, x, self.activation_checkpointing)
        return self.head(self.ln_f(x))
