"""A Hydra app as research code writes one: `@hydra.main` over conf/config.yaml and a config
group (conf/optimizer/sgd.yaml, adam.yaml), the optimizer built by `hydra.utils.instantiate`,
`log.info` through the logging Hydra sets up, overrides on the command line (`optimizer=adam
optimizer.lr=0.01 epochs=3`, no dashes), and the validation accuracy returned for a sweeper.
Ported: the lines marked `# hh:`.

    invoke train --script tests/scripts/hydra_app/train.py -- optimizer=adam optimizer.lr=0.01
    invoke sweep --script tests/scripts/hydra_app/train.py --space tests/scripts/hydra_app/space.yaml
"""

import logging

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh  # hh:

log = logging.getLogger(__name__)


def digits(train: bool) -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    part = slice(0, 1400) if train else slice(1400, None)
    return TensorDataset(torch.tensor(x[part] / 16.0, dtype=torch.float32), torch.tensor(y[part]))


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    job = hh.init()  # hh:
    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 10))
    optimizer = hydra.utils.instantiate(cfg.optimizer, params=model.parameters())
    loader = DataLoader(digits(True), batch_size=cfg.batch_size, shuffle=True)
    model, optimizer, loader = job.prepare(model, optimizer, loader)  # hh:
    test = digits(False)
    accuracy = 0.0
    for epoch in job.epochs(cfg.epochs):  # hh:
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            job.backward(loss)  # hh:
            optimizer.step()
        model.eval()
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (model(x.to(job.device)).argmax(1).cpu() == y).float().mean().item()
        log.info("epoch %d: val_acc %.4f", epoch, accuracy)
        job.log(val_acc=accuracy)  # hh:
    return accuracy


if __name__ == "__main__":
    main()
