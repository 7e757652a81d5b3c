"""The model, data and train/test loops of Flower's quickstart-pytorch app.

The CNN and the loops are the quickstart's; the data are scikit-learn's bundled 8x8 digits
scaled to 3 x 32 x 32 (CIFAR-10's shape) so that the app runs offline.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """The quickstart's CNN (from 'PyTorch: A 60 Minute Blitz')."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


_DATA = None


def _dataset():
    """All digits as (N, 3, 32, 32) images normalised to [-1, 1], and labels; the last 20% held out."""
    global _DATA
    if _DATA is None:
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
        x = (x - 0.5) / 0.5
        y = torch.tensor(digits.target, dtype=torch.int64)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        _DATA = x[perm], y[perm]
    return _DATA


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """An IID partition of the training digits, split 80% train / 20% test."""
    x, y = _dataset()
    n_train = int(0.8 * len(y))
    idx = torch.arange(partition_id, n_train, num_partitions)
    cut = int(0.8 * len(idx))
    train = TensorDataset(x[idx[:cut]], y[idx[:cut]])
    test = TensorDataset(x[idx[cut:]], y[idx[cut:]])
    g = torch.Generator().manual_seed(partition_id)
    return DataLoader(train, batch_size=batch_size, shuffle=True, generator=g), DataLoader(test, batch_size=batch_size)


def load_centralized_dataset():
    x, y = _dataset()
    n_train = int(0.8 * len(y))
    return DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set: (loss, accuracy)."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
