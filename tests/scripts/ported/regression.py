"""regression_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed.

    invoke train --script tests/scripts/ported/regression.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh  # hh:

job = hh.init()  # hh:

torch.manual_seed(0)
X = torch.randn(6000, 8)
w = torch.randn(8, 1)
y = torch.sin(X @ w) + 0.5 * X[:, :1] * X[:, 1:2] + 0.1 * torch.randn(6000, 1)
X_train, y_train, X_test, y_test = X[:5000], y[:5000], X[5000:], y[5000:]

device = job.device  # hh:
model = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)).to(device)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
scaler = torch.amp.GradScaler(device.type)
model, optimizer, loader = job.prepare(model, optimizer, TensorDataset(X_train, y_train), global_batch=128)  # hh:

for epoch in job.epochs(30):  # hh:
    model.train()
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        with torch.autocast(device.type, dtype=amp_dtype):
            pred = model(xb)
            loss = criterion(pred.float(), yb)
        optimizer.zero_grad()
        job.backward(scaler.scale(loss))  # hh:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    model.eval()
    with torch.no_grad():
        test_mse = criterion(model(X_test.to(device)), y_test.to(device)).item()
    print(f"epoch {epoch + 1:2d}  train loss {loss.item():.4f}  test mse {test_mse:.4f}")
