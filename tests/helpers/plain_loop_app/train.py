"""A user's Hydra app around a plain PyTorch loop: pytorch/examples' mnist/main.py (its `Net`,
`train` and `test`, the real file at tests/third_party/pytorch_examples_mnist/, copied beside this
one by the tests) driven by a config instead of argparse. Nothing in it knows gpuopt: the tests
measure and sweep it with YAML alone (`hydra.callbacks` naming gpuopt.MeasureJob)."""

from types import SimpleNamespace

import hydra
import torch
from omegaconf import DictConfig
from torchvision_stand_in import install  # the test machine's torchvision cannot load

install()

import main as mnist  # noqa: E402  (pytorch/examples' mnist/main.py)
from torchvision import datasets, transforms  # noqa: E402


@hydra.main(version_base=None, config_path="conf", config_name="config")
def run(cfg: DictConfig) -> float:
    torch.manual_seed(cfg.seed)
    device = torch.device("cpu")
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    train_set = datasets.MNIST(cfg.data_dir, train=True, download=True, transform=transform)
    test_set = datasets.MNIST(cfg.data_dir, train=False, transform=transform)
    loader = {"num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory}
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=cfg.batch_size, shuffle=True, **loader
    )
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=1000, **loader)
    model = mnist.Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=cfg.lr)
    args = SimpleNamespace(log_interval=cfg.log_interval, dry_run=False)
    for epoch in range(1, cfg.epochs + 1):
        try:
            mnist.train(args, model, device, train_loader, optimizer, epoch)
        except Exception as exc:  # an app's own handler: gpuopt's end of the job passes it
            print(f"training failed: {exc}")
            return float("nan")
        mnist.test(model, device, test_loader)
    return 0.0


if __name__ == "__main__":
    run()
