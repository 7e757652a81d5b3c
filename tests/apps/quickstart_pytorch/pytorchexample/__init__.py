"""pytorchexample: Flower's quickstart-pytorch app with fedcomp (offline data)."""
