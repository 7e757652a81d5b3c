import numpy as np, torch, torch.nn as nn
from sklearn.datasets import load_digits

def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

def data():
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(1)
    p = torch.randperm(len(y), generator=g)
    return x[p[:1400]], y[p[:1400]], x[p[1400:]], y[p[1400:]]

def shard(pid, n):
    x, y, _, _ = data()
    return x[pid::n], y[pid::n]

def fit(model, x, y, epochs=2, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        for i in range(0, len(y), 16):
            opt.zero_grad(); nn.functional.cross_entropy(model(x[i:i+16]), y[i:i+16]).backward(); opt.step()
    return len(y)

def accuracy(model):
    _, _, xt, yt = data()
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())
