"""A regression the way tabular tutorials write one: tensors in a TensorDataset, an MLP, MSELoss,
SGD with momentum, and the test error printed every epoch; mixed precision as PyTorch's AMP
recipe has it (autocast, a GradScaler, unscale_ before clipping). The data is made up: a smooth
function of eight features plus noise of variance 0.01 (the best test MSE reachable).

    python tests/scripts/ported/regression_single.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X = torch.randn(6000, 8)
w = torch.randn(8, 1)
y = torch.sin(X @ w) + 0.5 * X[:, :1] * X[:, 1:2] + 0.1 * torch.randn(6000, 1)
X_train, y_train, X_test, y_test = X[:5000], y[:5000], X[5000:], y[5000:]

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)).to(device)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
scaler = torch.amp.GradScaler(device.type)
loader = DataLoader(TensorDataset(X_train, y_train), batch_size=128, shuffle=True)

for epoch in range(30):
    model.train()
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        with torch.autocast(device.type, dtype=amp_dtype):
            pred = model(xb)
            loss = criterion(pred.float(), yb)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    model.eval()
    with torch.no_grad():
        test_mse = criterion(model(X_test.to(device)), y_test.to(device)).item()
    print(f"epoch {epoch + 1:2d}  train loss {loss.item():.4f}  test mse {test_mse:.4f}")
