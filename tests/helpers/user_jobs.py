"""Scripts of a user's own multi-rank training, as a user writes them from docs/your-training.md:
a torchrun-style script (its own process group, DDP, DistributedSampler, gpuopt.measure_step) and
a Hugging Face Trainer script (gpuopt.HFMeasureCallback) on a small GPT-2 built from its config.
Each saves rank 0's result to the path in $RESULT."""

TORCHRUN_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import gpuopt

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
data = TensorDataset(torch.randn(2048, 32), torch.randint(0, 4, (2048,)))
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))

def step(batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

result = gpuopt.measure_step(step, loader, model=model, optimizer=opt, measure="quick")
if dist.get_rank() == 0:
    result.save(os.environ["RESULT"])
dist.destroy_process_group()
"""

HF_SCRIPT = """
import os
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import gpuopt


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


config = GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=os.environ["OUT"], per_device_train_batch_size=8, gradient_accumulation_steps=2,
    learning_rate=float(os.environ.get("LR", "5e-5")), max_steps=int(os.environ.get("STEPS", "200")),
    report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
)
meter = gpuopt.HFMeasureCallback(measure="quick")
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[meter])
result = meter.train(trainer)
if int(os.environ.get("RANK", "0")) == 0:
    result.save(os.environ["RESULT"])
"""
